"""Training-thread cost of `otel_rl.log(<100 verl keys>)` with the tracker exporters on, against
each tracker's own call as verl's `Tracking.log` makes it.

    .venv/bin/python benchmarks/bench_trackers_log.py            # full run (~1-2 min)
    .venv/bin/python benchmarks/bench_trackers_log.py --quick    # smoke run (noisier)
    .venv/bin/python benchmarks/bench_trackers_log.py --json out.json

What is compared (every tracker offline / local, in a temporary directory):

- verl: ``wandb.log(data=data, step=step)`` (offline), ``mlflow.log_metrics(metrics={k.replace("@",
  "_at_"): v ...}, step=step)`` (sqlite tracking store), ``swanlab.log(data=data, step=step)``
  (offline) — each alone, and their sum, which is what verl's ``Tracking.log`` costs the training
  thread with all three in ``trainer.logger`` (it calls each backend in turn);
- otel-rl: ``otel_rl.log(data, step=step)`` with ``exporters=[mlflow, wandb, swanlab]`` — those whose
  exporter distribution (``otel_rl_mlflow``, ``otel_rl_wandb``, ``otel_rl_swanlab``) is installed
  when the benchmark runs; the missing ones are named in the output and left out of the fair sum.

Figures for otel-rl:

- "caller": the ``log()`` calls alone, the pipeline flushed between timed chunks (outside the timed
  region) so the delivery threads do not run inside it — the cost the training thread pays;
- "end-to-end": a chunk of ``log()`` calls followed by ``flush()``: wall time per step until the
  tracker has the step — for each exporter alone (against that tracker's verl call) and with all on.
  That includes the trackers' own work on otel-rl's delivery threads, which in training overlaps
  the GPU work (but holds the GIL while it runs Python).

Method (as in bench_core.py): per variant `repeats` repeats of `chunks` timed chunks of `chunk` calls
(gc off inside a chunk); variants interleaved repeat by repeat; the figure is the minimum over
repeats of the per-call time (the median is printed too).  The verl baselines run first (their own
runs, then finished), otel-rl after, so the trackers' global state does not mix.  Steps only grow
(wandb drops a ``step=`` lower than the last one, which would flatter it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

TRACKERS = ("mlflow", "wandb", "swanlab")
EXPORTER_MODULES = {"mlflow": "otel_rl_mlflow", "wandb": "otel_rl_wandb", "swanlab": "otel_rl_swanlab"}


def offline_env(tmp: str) -> None:
    """Every tracker offline, in `tmp`; set before any tracker is imported."""
    env = {
        "WANDB_MODE": "offline", "WANDB_DISABLE_WEAVE": "true", "WANDB_SILENT": "true",
        "WANDB_DIR": os.path.join(tmp, "wandb"), "WANDB_DATA_DIR": os.path.join(tmp, "wandb", "data"),
        "WANDB_CACHE_DIR": os.path.join(tmp, "wandb", "cache"), "WANDB_CONFIG_DIR": os.path.join(tmp, "wandb", "cfg"),
        "MLFLOW_TRACKING_URI": "sqlite:///" + os.path.join(tmp, "mlflow.db"),
        "SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": os.path.join(tmp, "swanlog"),
        "VERL_FILE_LOGGER_ROOT": tmp, "MLFLOW_LOGGING_LEVEL": "WARNING",
    }
    for k, v in env.items():
        os.environ[k] = v
    for k in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "SWANLAB_LOG_DIR"):
        os.makedirs(os.environ[k], exist_ok=True)
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            del os.environ[k]


VERL_CONFIG = {
    "trainer": {"project_name": "bench", "experiment_name": "trackers", "total_epochs": 1, "n_gpus_per_node": 8},
    "data": {"train_batch_size": 256, "max_prompt_length": 1024},
    "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}, "rollout": {"name": "vllm", "n": 5}},
}


@contextlib.contextmanager
def quiet():
    """Trackers' banners (run folders, sync hints) off the report; errors still go to stderr."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def load() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average n/a"


# ----------------------------------------------------------------------------- verl's calls


class Verl:
    """The three backends opened and called the way verl's `Tracking` does."""

    def __init__(self, project: str, experiment: str):
        self.step = 0
        self.calls: dict[str, Callable[[dict, int], Any]] = {}
        self.closers: list[Callable[[], Any]] = []
        import wandb

        wandb.init(project=project, name=experiment, config=VERL_CONFIG)
        self.calls["wandb"] = lambda data, step: wandb.log(data=data, step=step)
        self.closers.append(wandb.finish)

        import mlflow

        mlflow.set_experiment(project)
        mlflow.start_run(run_name=experiment)
        from otel_rl.exporters.tracker import flatten_config

        mlflow.log_params(flatten_config(VERL_CONFIG))

        def mlflow_log(data: dict, step: int) -> None:
            results = {k.replace("@", "_at_"): v for k, v in data.items()}
            mlflow.log_metrics(metrics=results, step=step)

        self.calls["mlflow"] = mlflow_log
        self.closers.append(mlflow.end_run)

        import swanlab

        swanlab.init(project=project, name=experiment, config={"FRAMEWORK": "verl", **VERL_CONFIG},
                     log_dir=os.environ["SWANLAB_LOG_DIR"], mode=os.environ["SWANLAB_MODE"])
        self.calls["swanlab"] = lambda data, step: swanlab.log(data=data, step=step)
        self.closers.append(swanlab.finish)

    def body(self, name: str, data: dict) -> Callable[[int], int]:
        call = self.calls[name]
        pc = time.perf_counter_ns

        def run(n: int) -> int:
            s = self.step
            t0 = pc()
            for i in range(n):
                call(data, s + i)
            t1 = pc()
            self.step = s + n
            return t1 - t0

        return run

    def close(self) -> None:
        for c in self.closers:
            try:
                c()
            except Exception as exc:  # a benchmark still reports what it measured
                print(f"  (closing a verl backend failed: {exc})", flush=True)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test; noisier)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary tracker directories")
    args = ap.parse_args(argv)
    cfg = (dict(repeats=3, chunk_verl=10, chunks_verl=2, chunk_ours=200, chunks_ours=2, e2e_steps=50, e2e_repeats=2)
           if args.quick else
           dict(repeats=7, chunk_verl=10, chunks_verl=3, chunk_ours=200, chunks_ours=5, e2e_steps=100, e2e_repeats=3))

    tmp = tempfile.mkdtemp(prefix="otel-rl-bench-trackers-")
    offline_env(tmp)
    import bench_core  # noqa: E402  (verl_metrics, measure: the same method and data as the core benchmark)
    from bench_core import Timed, measure, verl_metrics

    import otel_rl
    from otel_rl.exporters import registry

    logging.getLogger("otel_rl").setLevel(logging.ERROR)
    for noisy in ("wandb", "mlflow", "alembic", "swanlab"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    versions = {}
    for t in TRACKERS + tuple(EXPORTER_MODULES.values()):
        try:
            from importlib import metadata

            versions[t] = metadata.version(t.replace("_", "-"))
        except Exception:
            versions[t] = None
    installed = set(registry.installed_names())
    ours_names = [t for t in TRACKERS if t in installed and importlib.util.find_spec(EXPORTER_MODULES[t])]
    missing = [t for t in TRACKERS if t not in ours_names]
    print(f"otel-rl {otel_rl.__version__}  python {platform.python_version()}  cpus={os.cpu_count()}  "
          f"mode={'quick' if args.quick else 'full'}  repeats={cfg['repeats']}  {load()}", flush=True)
    print("trackers: " + ", ".join(f"{t} {versions.get(t) or 'not installed'}" for t in TRACKERS))
    print("otel-rl exporters on: " + (", ".join(ours_names) or "none"), end="")
    print(("; skipped (exporter distribution not installed): " + ", ".join(
        f"{t} ({EXPORTER_MODULES[t]})" for t in missing)) if missing else "", flush=True)

    data = verl_metrics()
    assert len(data) == 100
    t_start = time.monotonic()
    results: dict[str, Timed] = {}

    # -- verl's own calls ------------------------------------------------------------------
    print("\n1. verl's Tracking.log: each backend's own call on the training thread", flush=True)
    with quiet():
        verl = Verl("bench-verl", "verl")
    variants = [(f"verl {t}", verl.body(t, data), None) for t in TRACKERS]
    for tm in measure(variants, cfg["chunk_verl"], cfg["chunks_verl"], cfg["repeats"]):
        results[tm.name] = tm
        print(f"  {tm.name:<14} min {tm.best / 1e3:10.1f} us   median {tm.median / 1e3:10.1f} us", flush=True)
    with quiet():
        verl.close()

    # -- otel-rl ----------------------------------------------------------------------------
    print(f"\n2. otel_rl.log(100 keys) with exporters {ours_names}", flush=True)
    step = [0]
    with quiet():  # the trackers open their runs at the first delivery
        h = otel_rl.init(VERL_CONFIG, project="bench-otel", experiment="otel-rl", exporters=ours_names)
        otel_rl.log(data, step=0)
        h.flush(600)
    step[0] = 1
    pc = time.perf_counter_ns
    log = otel_rl.log

    def ours(n: int) -> int:
        s = step[0]
        t0 = pc()
        for i in range(n):
            log(data, step=s + i)
        t1 = pc()
        step[0] = s + n
        return t1 - t0

    def e2e(n: int) -> int:
        s = step[0]
        t0 = pc()
        for i in range(n):
            log(data, step=s + i)
        h.flush(600)
        t1 = pc()
        step[0] = s + n
        return t1 - t0

    ours_t, = measure([("otel-rl caller", ours, lambda: h.flush(600))], cfg["chunk_ours"], cfg["chunks_ours"],
                      cfg["repeats"])
    results[ours_t.name] = ours_t
    print(f"  {ours_t.name:<22} min {ours_t.best / 1e3:10.2f} us   median {ours_t.median / 1e3:10.2f} us", flush=True)
    e2e_t, = measure([("otel-rl end-to-end", e2e, None)], cfg["e2e_steps"], 1, cfg["e2e_repeats"])
    results[e2e_t.name] = e2e_t
    print(f"  {e2e_t.name:<22} min {e2e_t.best / 1e3:10.2f} us   median {e2e_t.median / 1e3:10.2f} us", flush=True)
    stats = h.stats()
    with quiet():
        h.shutdown()
    failures = {k: v for k, v in stats["exporters"].items() if v["failed_attempts"] or v["dropped"]}

    print("\n3. end-to-end (log() + delivery until flushed), each exporter alone", flush=True)
    alone: dict[str, Timed] = {}
    for t in ours_names:
        with quiet():
            h = otel_rl.init(VERL_CONFIG, project="bench-otel", experiment=f"alone-{t}", exporters=[t])
            otel_rl.log(data, step=step[0])
            h.flush(600)
            step[0] += 1
        tm, = measure([(f"otel-rl {t} end-to-end", e2e, None)], cfg["e2e_steps"], 1, cfg["e2e_repeats"])
        alone[t] = tm
        st = h.stats()["exporters"][t]
        if st["failed_attempts"] or st["dropped"]:
            failures[f"{t} alone"] = st
        with quiet():
            h.shutdown()
        print(f"  {tm.name:<30} min {tm.best / 1e3:10.1f} us   median {tm.median / 1e3:10.1f} us", flush=True)

    # -- report -----------------------------------------------------------------------------
    ob, em = ours_t.best, e2e_t.best

    def r(x: float, y: float) -> str:
        return f"{x / y:.4f}x" if x / y < 0.1 else f"{x / y:.2f}x"

    print()
    hdr = (f"{'per log() of 100 keys':<26} {'verl call':>11} {'otel-rl caller':>15} {'ratio':>9} "
           f"{'otel-rl end-to-end':>19} {'ratio':>8}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for t in TRACKERS:
        b = results[f"verl {t}"].best
        if t in ours_names:
            a = alone[t].best
            print(f"{t:<26} {b / 1e3:9.1f}us {ob / 1e3:13.2f}us {r(ob, b):>9} {a / 1e3:17.1f}us {r(a, b):>8}")
        else:
            print(f"{t:<26} {b / 1e3:9.1f}us {'-':>15} {'-':>9} {'-':>19} {'-':>8}  (exporter not installed: skipped)")
        rows.append({"tracker": t, "verl_us": b / 1e3, "in_otel_rl": t in ours_names,
                     "otel_rl_alone_end_to_end_us": alone[t].best / 1e3 if t in ours_names else None})
    fair = sum(results[f"verl {t}"].best for t in ours_names)
    if ours_names:
        label = "+".join(ours_names)
        print(f"{label:<26} {fair / 1e3:9.1f}us {ob / 1e3:13.2f}us {r(ob, fair):>9} {em / 1e3:17.1f}us {r(em, fair):>8}")
    print("-" * len(hdr))
    print("verl call: the tracker's own call as verl makes it, on the training thread.  otel-rl caller: "
          "otel_rl.log() with all the exporters above on (the training thread's cost).  End-to-end: log() "
          "plus delivery until the tracker has the step (per exporter alone; last row: all on).  "
          "ratio = otel-rl / verl, min over repeats.")
    if fair:
        print(f"=> the training thread pays {ob / 1e3:.2f} us per log() instead of {fair / 1e3:.1f} us "
              f"({fair / ob:.0f}x less).")
    if failures:
        print(f"exporter failures during the run: {failures}")
    print(f"(total wall {time.monotonic() - t_start:.1f}s; {load()}; tracker files in {tmp}"
          f"{'' if args.keep else ', removed'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"exporters_on": ours_names, "skipped": missing, "versions": versions, "rows": rows,
                       "otel_rl_caller_us": ob / 1e3, "otel_rl_caller_median_us": ours_t.median / 1e3,
                       "otel_rl_end_to_end_us": em / 1e3, "verl_same_set_us": fair / 1e3,
                       "failures": failures}, f, indent=2)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    del bench_core
    return 0


if __name__ == "__main__":
    sys.exit(main())
