"""What telemetry costs the demo: the same GRPO run with every exporter on, and with everything off.

    .venv/bin/python benchmarks/bench_demo.py                 # default demo config, 2 repeats per variant
    .venv/bin/python benchmarks/bench_demo.py --steps 60 --repeats 3
    .venv/bin/python benchmarks/bench_demo.py --json out.json
    .venv/bin/python benchmarks/bench_demo.py --steps 40 --breakdown      # + each exporter alone

Variants (same seed, same config otherwise; each run is its own `otel-rl demo` process with a
fresh output directory):

- **on**: ``trainer.logger=["console","mlflow","file","wandb","swanlab"]``, trajectories traced to
  MLflow (``trace.backend=mlflow``, token2text) at ``max_samples_per_step_per_worker=4``;
  wandb and swanlab offline.  The tracker exporters run in the export process (``export_process``
  auto: the demo's training process does not import their libraries).
- **off**: ``trainer.logger=[]`` and ``actor_rollout_ref.rollout.trace.backend=null``: no
  exporter, tracing off (``otel_rl.init`` still runs; every decorator takes its disabled path).

Runs alternate (on, off, off, on, ...) so a noisy neighbour slows both alike.  Reported per
variant: the training loop (``fit``: every step incl. validation; what the ratio goal is about),
setup (MLflow store, ``init``, model), the flush at shutdown, and the process wall time; min and
median over the repeats; ratio = on / off of the minima, and the median of the paired ratios
(run k of "on" against run k of "off").  The two variants must train identically: validation
rewards and last-step metrics (except timings) are compared.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ON = ['trainer.logger=["console","mlflow","file","wandb","swanlab"]',
      "actor_rollout_ref.rollout.trace.backend=mlflow",
      "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=4"]
OFF = ["trainer.logger=[]", "actor_rollout_ref.rollout.trace.backend=null"]
#: --breakdown: one part of "on" at a time (one run each), against the "off" runs
PARTS = {
    "console+file": ["trainer.logger=[console,file]", "actor_rollout_ref.rollout.trace.backend=null"],
    "mlflow metrics": ["trainer.logger=[mlflow]", "actor_rollout_ref.rollout.trace.backend=null"],
    "wandb": ["trainer.logger=[wandb]", "actor_rollout_ref.rollout.trace.backend=null"],
    "swanlab": ["trainer.logger=[swanlab]", "actor_rollout_ref.rollout.trace.backend=null"],
    "traces -> memory": ["trainer.logger=[]", "actor_rollout_ref.rollout.trace.backend=memory"],
    "traces -> mlflow": ["trainer.logger=[]", "actor_rollout_ref.rollout.trace.backend=mlflow"],
}
CLEAN_ENV = ("MLFLOW_TRACKING_URI", "WANDB_DIR", "SWANLAB_LOG_DIR", "OTEL_RL_JSONL_PATH", "VERL_FILE_LOGGER_PATH",
             "VERL_FILE_LOGGER_ROOT", "OTEL_RL_EXPORTERS", "OTEL_SDK_DISABLED")


def run_once(variant: str, seed: int, steps: int | None, extra: list[str], workdir: Path, k: int) -> dict:
    slug = "".join(c if c.isalnum() else "_" for c in variant)
    out = workdir / f"{slug}-{k}"
    report = workdir / f"{slug}-{k}.json"
    cmd = [sys.executable, "-m", "otel_rl.cli", "demo", "--no-progress", "--seed", str(seed),
           "--output-dir", str(out), "--report-json", str(report)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    cmd += (ON if variant == "on" else OFF if variant == "off" else PARTS[variant]) + extra
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env.update(WANDB_MODE="offline", SWANLAB_MODE="offline", WANDB_SILENT="true")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{variant} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    data["wall_s"] = wall
    return data


def _same_training(a: dict, b: dict) -> bool:
    def strip(m: dict) -> dict:
        return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}

    return a["val_history"] == b["val_history"] and strip(a["last_metrics"]) == strip(b["last_metrics"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the demo's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every number here")
    ap.add_argument("--breakdown", action="store_true",
                    help="also run each part of 'on' alone (console+file, mlflow metrics, wandb, swanlab, "
                         "traces to the in-memory test exporter, traces to mlflow), one run each")
    ap.add_argument("overrides", nargs="*", help="more dotlist overrides for both variants")
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"on": [], "off": []}
    # both variants import otel-rl's modules from bytecode, as from an installed package (pip compiles
    # it at install; a checkout run with PYTHONDONTWRITEBYTECODE=1 would compile the exporters' modules
    # at every start of the "on" runs only)
    root = Path(__file__).resolve().parent.parent
    compileall.compile_dir(str(root / "otel_rl"), quiet=1)
    for pkg in sorted((root / "exporters").glob("*/otel_rl_*")):
        compileall.compile_dir(str(pkg), quiet=1)
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
        for k in range(args.repeats):
            order = ("on", "off") if k % 2 == 0 else ("off", "on")
            for variant in order:
                r = run_once(variant, args.seed, args.steps, args.overrides, Path(tmp), k)
                results[variant].append(r)
                print(f"  run {k + 1}/{args.repeats} {variant:>3}: train {r['train_s']:.2f} s, "
                      f"setup {r['setup_s']:.2f} s, flush {r['flush_s']:.2f} s, wall {r['wall_s']:.2f} s", flush=True)
        parts = {}
        if args.breakdown:
            for name in PARTS:
                r = run_once(name, args.seed, args.steps, args.overrides, Path(tmp), 0)
                parts[name] = r
                print(f"  part {name}: train {r['train_s']:.2f} s, setup {r['setup_s']:.2f} s, "
                      f"wall {r['wall_s']:.2f} s", flush=True)
    on, off = results["on"], results["off"]
    steps = on[0]["steps"]
    print()
    print(f"demo: {steps} steps, seed {args.seed}, {on[0]['trajectories']} trajectories per run, "
          f"{args.repeats} runs per variant; machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    print(f"  on : exporters {', '.join(on[0]['exporters'])}; traced samples per step per worker: 4")
    print("  off: no exporter, tracing off")
    print(f"{'figure':<28}{'on min':>10}{'on med':>10}{'off min':>10}{'off med':>10}{'ratio':>9}{'paired':>9}")
    table = {}
    for key, label in (("train_s", "training loop (s)"), ("setup_s", "setup (s)"), ("flush_s", "flush at end (s)"),
                       ("wall_s", "process wall time (s)")):
        a = [r[key] for r in on]
        b = [r[key] for r in off]
        ratio = min(a) / min(b) if min(b) > 0 else float("nan")
        paired = statistics.median(x / y for x, y in zip(a, b)) if all(b) else float("nan")
        table[key] = {"on": a, "off": b, "ratio": ratio, "paired": paired}
        print(f"{label:<28}{min(a):>10.2f}{statistics.median(a):>10.2f}{min(b):>10.2f}{statistics.median(b):>10.2f}"
              f"{ratio:>9.3f}{paired:>9.3f}")
    pairs = sorted(a["wall_s"] / b["wall_s"] for a, b in zip(on, off))
    tpairs = sorted(a["train_s"] / b["train_s"] for a, b in zip(on, off))
    if len(pairs) >= 4:
        q = statistics.quantiles(pairs, n=4)
        tq = statistics.quantiles(tpairs, n=4)
        print(f"paired ratios, quartiles: training loop {tq[0]:.3f} / {tq[1]:.3f} / {tq[2]:.3f}; "
              f"wall time {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}")
    sps_on = steps / min(r["train_s"] for r in on)
    sps_off = steps / min(r["train_s"] for r in off)
    print(f"{'steps/s (best run)':<28}{sps_on:>10.2f}{'':>10}{sps_off:>10.2f}{'':>10}{sps_on / sps_off:>9.3f}")
    slower = (table["train_s"]["ratio"] - 1) * 100
    print(f"training loop with telemetry on: {slower:+.1f}% (min vs min; goal <= +2%), "
          f"paired median {(table['train_s']['paired'] - 1) * 100:+.1f}%")
    print(f"process wall time with telemetry on: {(table['wall_s']['ratio'] - 1) * 100:+.1f}% (min vs min), "
          f"paired median {(table['wall_s']['paired'] - 1) * 100:+.1f}%")
    if parts:
        base = statistics.median(r["train_s"] for r in off)
        print(f"breakdown (one run each; training loop vs the median 'off' run, {base:.2f} s):")
        for name, r in parts.items():
            print(f"  {name:<20}{r['train_s']:>8.2f} s{(r['train_s'] / base - 1) * 100:>+9.1f}%")
    same = all(_same_training(x, off[0]) for x in on + off + list(parts.values()))
    print(f"same training in every run (validation rewards, last-step metrics): {'yes' if same else 'NO'}")
    print(f"validation reward: {on[0]['val_history'][0][1]:.3f} at step {on[0]['val_history'][0][0]} -> "
          f"{on[0]['val_history'][-1][1]:.3f} at step {on[0]['val_history'][-1][0]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": steps, "seed": args.seed, "table": table,
                                               "parts": {k: v["train_s"] for k, v in parts.items()},
                                               "same_training": same}, indent=1))


if __name__ == "__main__":
    main()
