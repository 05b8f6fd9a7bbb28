"""verl's `Tracking` lifecycle with four trackers: what `Tracking(...)`, a short run and `finish()` cost,
verl's own class beside otel-rl's (``otel_rl.compat.verl.Tracking``), in the same run.

    .venv/bin/python benchmarks/bench_tracker_startup.py                  # 3 repeats per variant
    .venv/bin/python benchmarks/bench_tracker_startup.py --repeats 5 --run-s 3
    .venv/bin/python benchmarks/bench_tracker_startup.py --compare-tree /path/to/other/checkout
    .venv/bin/python benchmarks/bench_tracker_startup.py --md benchmarks/results/<date>-tracker-startup.md

Each run is its own Python process with fresh, offline tracker stores in a temporary directory
(``trainer.logger`` = ``--loggers``, by default mlflow (sqlite), wandb (offline), swanlab (offline) and
tensorboard).  A run:

1. ``Tracking(project, experiment, default_backend=loggers, config)`` — timed ("init");
2. a training loop for ``--run-s`` seconds from there: each step a CPU-bound computation (pure Python,
   ``--step-ms`` long when nothing else runs) and one ``tracking.log(<100 verl keys>, step)``; timed:
   the ``log()`` calls (the training thread's cost of telemetry) and the computations (which grow
   when something takes the training thread's core);
3. ``tracking.finish()`` — timed ("finish"): for otel-rl, everything logged delivered and every tracker
   run closed, its export process ended.

One untimed run of each variant comes first: what a machine caches after its first run (the files read, otel-rl's
template of an empty MLflow store) is then there for every timed run, as for a user's second training.
Variants alternate run by run (verl, otel-rl, verl, ...), so a noisy neighbour slows both alike.
``--compare-tree`` adds a variant "otel-rl@tree": the same otel-rl run with the ``otel_rl`` package (and
exporters) of another checkout, e.g. the code before a change.  Reported: min and median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGGERS = ("mlflow", "wandb", "swanlab", "tensorboard")
VERL_CONFIG = {
    "trainer": {"project_name": "bench", "experiment_name": "startup", "total_epochs": 1, "n_gpus_per_node": 8},
    "data": {"train_batch_size": 256, "max_prompt_length": 1024},
    "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}, "rollout": {"name": "vllm", "n": 5}},
}


def offline_env(tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLFLOW_RUN_ID", "WANDB_", "SWANLAB_"))}
    env.update({
        "WANDB_MODE": "offline", "WANDB_DISABLE_WEAVE": "true", "WANDB_SILENT": "true",
        "WANDB_DIR": os.path.join(tmp, "wandb"), "WANDB_CACHE_DIR": os.path.join(tmp, "wandb-cache"),
        "WANDB_CONFIG_DIR": os.path.join(tmp, "wandb-cfg"), "WANDB_DATA_DIR": os.path.join(tmp, "wandb-data"),
        "MLFLOW_TRACKING_URI": "sqlite:///" + os.path.join(tmp, "mlflow.db"), "MLFLOW_LOGGING_LEVEL": "WARNING",
        "SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": os.path.join(tmp, "swanlog"),
        "TENSORBOARD_DIR": os.path.join(tmp, "tb"), "VERL_FILE_LOGGER_ROOT": tmp,
        "TRACKIO_DIR": os.path.join(tmp, "trackio"), "CLEARML_CACHE_DIR": os.path.join(tmp, "clearml"),
        "HOME": os.path.join(tmp, "home"), "PYTHONDONTWRITEBYTECODE": "1",
    })
    for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "SWANLAB_LOG_DIR", "HOME"):
        os.makedirs(env[k], exist_ok=True)
    return env


def metrics(step: int) -> dict[str, float]:
    prefixes = ("actor", "critic", "response_length", "timing_s", "perf")
    return {f"{prefixes[i % 5]}/metric_{i}": step * 0.001 + i for i in range(100)}


def compute(n: int) -> int:
    x = 0
    for i in range(n):
        x = (x * 31 + i) & 0xFFFFFFFF
    return x


def child(variant: str, loggers: list[str], run_s: float, step_ms: float) -> dict:
    """One run, in this (fresh) process; the environment is already offline and in a temporary directory."""
    import contextlib
    import io
    import logging

    logging.disable(logging.WARNING)
    # the loop's size for `step_ms` when this process has a core to itself (measured before any import)
    n = 200_000
    t0 = time.perf_counter()
    compute(n)
    n = max(1000, int(n * (step_ms / 1000) / max(1e-6, time.perf_counter() - t0)))
    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet:
        t0 = time.perf_counter()
        if variant == "verl":
            from verl.utils.tracking import Tracking
        else:
            from otel_rl.compat.verl import Tracking
        tracking = Tracking("bench-startup", "run", default_backend=loggers, config=VERL_CONFIG)
        t_init = time.perf_counter() - t0
        log_s = []
        compute_s = []
        step = 0
        end = time.perf_counter() + run_s
        while time.perf_counter() < end:
            step += 1
            c0 = time.perf_counter()
            compute(n)
            c1 = time.perf_counter()
            tracking.log(metrics(step), step)
            log_s.append(time.perf_counter() - c1)
            compute_s.append(c1 - c0)
        t0 = time.perf_counter()
        tracking.finish()
        t_finish = time.perf_counter() - t0
    return {"init_s": t_init, "finish_s": t_finish, "steps": step, "log_us_mean": statistics.mean(log_s) * 1e6,
            "log_us_max": max(log_s) * 1e6, "compute_ms_mean": statistics.mean(compute_s) * 1e3,
            "compute_ms_first5": statistics.mean(compute_s[:5]) * 1e3}


def run_one(variant: str, args: argparse.Namespace, run_s: float | None = None) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench-startup-")
    env = offline_env(tmp)
    env["XDG_CACHE_HOME"] = args.cache  # shared by the runs, as on a user's machine (MLflow's store template)
    tree = args.compare_tree if variant.endswith("@tree") else ROOT
    env["PYTHONPATH"] = os.pathsep.join([tree] + [os.path.join(tree, "exporters", d) for d in
                                                  sorted(os.listdir(os.path.join(tree, "exporters")))
                                                  if os.path.isdir(os.path.join(tree, "exporters", d))])
    out = os.path.join(tmp, "result.json")
    code = ("import json, sys; sys.path.insert(0, %r); import bench_tracker_startup as b; "
            "r = b.child(%r, %r, %r, %r); json.dump(r, open(%r, 'w'))"
            % (os.path.dirname(os.path.abspath(__file__)), "verl" if variant == "verl" else "otel-rl",
               list(args.loggers), args.run_s if run_s is None else run_s, args.step_ms, out))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp, capture_output=True, text=True,
                          timeout=600)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            r = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r["process_wall_s"] = wall
    return r


FIELDS = (("init_s", "Tracking(...) s", 3), ("finish_s", "finish() s", 3), ("process_wall_s", "process wall s", 2),
          ("steps", "steps", 0), ("log_us_mean", "log() µs mean", 0), ("log_us_max", "log() µs max", 0),
          ("compute_ms_mean", "step compute ms mean", 1), ("compute_ms_first5", "first 5 steps compute ms", 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run-s", type=float, default=3.0)
    ap.add_argument("--step-ms", type=float, default=100.0)
    ap.add_argument("--loggers", default=",".join(LOGGERS))
    ap.add_argument("--compare-tree", default=None, help="another checkout: its otel-rl as a third variant")
    ap.add_argument("--md", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    args.loggers = [x for x in args.loggers.split(",") if x]
    variants = ["verl", "otel-rl"] + (["otel-rl@tree"] if args.compare_tree else [])
    results: dict[str, list[dict]] = {v: [] for v in variants}
    args.cache = tempfile.mkdtemp(prefix="bench-startup-cache-")
    for v in variants:  # untimed: what a first run on a machine caches (MLflow's empty store), and the page cache
        run_one(v, args, run_s=0.5)
    load0 = os.getloadavg()
    for i in range(args.repeats):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            r = run_one(v, args)
            results[v].append(r)
            print(f"[{i + 1}/{args.repeats}] {v:13s} " + "  ".join(
                f"{k}={r[k]:.{p}f}" for k, _, p in FIELDS), flush=True)
    load1 = os.getloadavg()
    shutil.rmtree(args.cache, ignore_errors=True)
    cmd = "python benchmarks/bench_tracker_startup.py " + " ".join(
        a if " " not in a else repr(a) for a in (argv if argv is not None else sys.argv[1:]))
    lines = [f"# verl's Tracking with {', '.join(args.loggers)}: init, a {args.run_s:g} s run, finish "
             f"({time.strftime('%Y-%m-%d')})", "",
             f"`{cmd.strip()}` on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}); "
             f"{args.repeats} runs per variant, alternated; each step {args.step_ms:g} ms of pure-Python work "
             f"(alone on a core) and one `log()` of 100 keys; one untimed run of each variant first (a machine's "
             f"caches: MLflow's empty store kept by otel-rl, the page cache); "
             f"load average {load0[0]:.2f} at the start, "
             f"{load1[0]:.2f} at the end.  min (median) over the runs.", "",
             "| figure | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for key, label, prec in FIELDS:
        cells = []
        for v in variants:
            xs = [r[key] for r in results[v]]
            cells.append(f"{min(xs):.{prec}f} ({statistics.median(xs):.{prec}f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        with open(args.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
