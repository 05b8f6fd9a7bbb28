"""What telemetry costs the demo: the same GRPO run with every exporter on, and with everything off.

    .venv/bin/python benchmarks/bench_demo.py                 # default demo config, 2 repeats per variant
    .venv/bin/python benchmarks/bench_demo.py --steps 60 --repeats 3
    .venv/bin/python benchmarks/bench_demo.py --json out.json
    .venv/bin/python benchmarks/bench_demo.py --steps 40 --breakdown      # + each exporter alone
    .venv/bin/python benchmarks/bench_demo.py --lockstep --repeats 10     # side by side, step by step
    .venv/bin/python benchmarks/bench_demo.py --lockstep --repeats 10 --group 5   # 5 steps in a row each

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
import gc
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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
#: --lockstep A,B also takes these: all the metrics of "on" without traces, its traces without metrics, and
#: those traces at 1 and at 0 samples/step/worker (tracing on, every trajectory unsampled)
def _traces(samples: int) -> list[str]:
    return ["trainer.logger=[]", "actor_rollout_ref.rollout.trace.backend=mlflow",
            f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={samples}"]


LOCKSTEP_PARTS = {
    "metrics": ['trainer.logger=["console","mlflow","file","wandb","swanlab"]',
                "actor_rollout_ref.rollout.trace.backend=null"],
    "traces": _traces(4), "traces1": _traces(1), "traces0": _traces(0),
}
CLEAN_ENV = ("MLFLOW_TRACKING_URI", "WANDB_DIR", "SWANLAB_LOG_DIR", "OTEL_RL_JSONL_PATH", "VERL_FILE_LOGGER_PATH",
             "VERL_FILE_LOGGER_ROOT", "OTEL_RL_EXPORTERS", "OTEL_SDK_DISABLED")


def in_process_parser(doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of a benchmark that runs the demo in process: `doc` as its help, and the
    dotlist overrides added after the "on" configuration."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="more dotlist overrides (after the 'on' configuration)")
    return ap


class GcClock:
    """Time spent in the cyclic GC between `start()` and `stop()`, by `clock`
    (e.g. ``time.perf_counter`` or ``time.thread_time``); with `thread` (an ident) only collections
    run on that thread count.  `seconds`: the total so far."""

    def __init__(self, clock, thread: int | None = None):
        self.clock = clock
        self.thread = thread
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if self.thread is not None and threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._start = self.clock()
        else:
            self.seconds += self.clock() - self._start

    def start(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)


def in_process_environment() -> None:
    """This process's environment as a benchmark's demo process gets it (for benchmarks that run the demo
    in process, with a patched trainer): no store or log path of the caller's, the trackers offline."""
    for k in CLEAN_ENV:
        os.environ.pop(k, None)
    os.environ.update(WANDB_MODE="offline", SWANLAB_MODE="offline", WANDB_SILENT="true")


def run_in_process(seed: int, steps: int, overrides: list[str], prefix: str) -> None:
    """`otel-rl demo` with the "on" configuration (+ `overrides`) in this process, its output directory a
    temporary one and its stdout discarded; exits if the demo fails."""
    from otel_rl.cli import main as cli_main

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        argv = ["demo", "--no-progress", "--seed", str(seed), "--steps", str(steps),
                "--output-dir", str(Path(tmp) / "demo"), *ON, *overrides]
        with open(os.devnull, "w") as devnull:
            stdout, sys.stdout = sys.stdout, devnull
            try:
                rc = cli_main(argv)
            finally:
                sys.stdout = stdout
    if rc != 0:
        sys.exit(f"the demo failed ({rc})")


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
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{variant} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    data["wall_s"] = wall
    # the CPU time of the whole process tree: the demo, its export process, wandb's service (each waited for)
    data["tree_cpu_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return data


def layout_padding(cmd: list[str], env: dict[str, str], layout_bytes: int) -> str:
    """The value of ``LOCKSTEP_LAYOUT`` that makes `cmd`'s strings and `env`'s (with it) `layout_bytes` long in
    all, as a new process holds them (each NUL-terminated, the environment as NAME=VALUE)."""
    size = sum(len(os.fsencode(a)) + 1 for a in cmd) + sum(
        len(os.fsencode(k)) + len(os.fsencode(v)) + 2 for k, v in env.items() if k != "LOCKSTEP_LAYOUT")
    pad = layout_bytes - size - len("LOCKSTEP_LAYOUT=") - 1
    if pad < 0:
        raise ValueError(f"its command line and environment take {size} bytes, more than the {layout_bytes} "
                         "they are padded to")
    return "x" * pad


class Paced:
    """One variant's demo process, paused between training steps (see ``_lockstep_demo.py``)."""

    def __init__(self, variant: str, seed: int, steps: int | None, extra: list[str], workdir: Path,
                 config: str | None = None, slot: str | None = None, layout_bytes: int = 0):
        self.variant = variant
        config, *assignments = (config or variant).split("@")  # "on@NAME=VALUE@...": that variant's environment
        # its files: named after `slot` (the order it was launched in) rather than the variant, so that both
        # variants' paths are alike (the same length) and each variant has either name in turn
        slot = slot or variant
        self.report = workdir / f"lockstep-{slot}.json"
        self.log = open(workdir / f"lockstep-{slot}.log", "w+b")
        r_done, w_done = os.pipe()
        r_go, self.go = os.pipe()
        cmd = [sys.executable, str(Path(__file__).with_name("_lockstep_demo.py")), "demo", "--no-progress",
               "--seed", str(seed), "--output-dir", str(workdir / f"lockstep-{slot}"),
               "--report-json", str(self.report)]
        if steps is not None:
            cmd += ["--steps", str(steps)]
        cmd += (ON if config == "on" else OFF if config == "off" else {**PARTS, **LOCKSTEP_PARTS}[config]) + extra
        own = dict(a.split("=", 1) for a in assignments)
        cmd += own.pop("LOCKSTEP_ARGS", "").split()  # this variant's own dotlist overrides, last
        env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
        env.update(WANDB_MODE="offline", SWANLAB_MODE="offline", WANDB_SILENT="true",
                   LOCKSTEP_DONE_FD=str(w_done), LOCKSTEP_GO_FD=str(r_go))
        env.update(own)
        if layout_bytes:
            # the strings of its command line and environment padded to `layout_bytes` in all: they lie at the
            # top of the new process's stack, and their size sets where its stack starts, which alone can
            # speed up or slow down a process by a few per cent (its alignment against caches and pages).
            # Both variants get the same size, and each pair of repeats (both launch orders) another one.
            try:
                env["LOCKSTEP_LAYOUT"] = layout_padding(cmd, env, layout_bytes)
            except ValueError as exc:
                sys.exit(f"lockstep: {variant}: {exc}")
        self.t0 = time.perf_counter()
        # a session of its own: one signal stops the demo, its threads, its export process and their children
        self.proc = subprocess.Popen(cmd, env=env, cwd=workdir, pass_fds=(w_done, r_go), start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        os.close(w_done)
        os.close(r_go)
        self.done = os.fdopen(r_done, "r")
        self.steps: dict[int, float] = {}  # step -> seconds (wall) of the training loop for it
        self.cpu: dict[int, float] = {}  # step -> CPU seconds of the training thread for it
        self.faults: dict[int, int] = {}  # step -> page faults (minor) of the training thread in it

    def wait_step(self) -> int:
        line = self.done.readline()
        if not line:
            self.log.seek(0)
            sys.exit(f"{self.variant} run failed:\n{self.log.read().decode(errors='replace')[-3000:]}")
        k, seconds, cpu, faults = line.split()
        self.faults[int(k)] = int(faults)
        self.steps[int(k)] = float(seconds)
        self.cpu[int(k)] = float(cpu)
        return int(k)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.go_on()

    def go_on(self) -> None:
        """The go-ahead for the next step (after `resume`, or at once within a ``--group``)."""
        os.write(self.go, b"g")

    def finish(self) -> dict:
        """Let it run to its end (the final flush, the tracker runs closed, the process gone)."""
        t0 = time.perf_counter()
        self.resume()
        os.close(self.go)
        rc = self.proc.wait()
        self.tail_s = time.perf_counter() - t0
        if rc != 0:
            self.log.seek(0)
            sys.exit(f"{self.variant} run failed ({rc}):\n{self.log.read().decode(errors='replace')[-3000:]}")
        return json.loads(self.report.read_text())


#: what each demo process's command line and environment are padded to (`Paced`), before a repeat's offset
LAYOUT_BYTES = 16384


def lockstep(args: argparse.Namespace, launch: tuple[str, str] = ("on", "off"), repeat: int = 0) -> dict:
    """Both variants at once, one step at a time each: on's step k, off's step k, off's k+1, on's k+1, ...
    (with ``--group K``: K steps of one, K of the other, and so on).

    The two processes train identically (same seed), so step k costs both the same work but for
    the telemetry; run back to back, the two halves of a pair see the same machine.  While one
    variant's step runs, the other one is stopped entirely (SIGSTOP to its process group: its
    threads and its export process too), so what telemetry does in the background lands in the
    steps of its own variant, as in a run of its own.  Setup and step 0 run one variant at a time
    first; each finishes (final flush, exit) alone at the end.

    Step by step, every step of either variant starts right after the other process ran: with the
    CPU's caches and the interpreter's hot paths taken by the other process's step, both variants
    start each step cold.  A run of its own runs warm.  ``--group K`` gives each variant K steps in
    a row, K-1 of them warm: nearer to a run of its own, a little further from "the same machine".

    Both processes are laid out alike: their files are named by the order they were launched in, not
    by variant (paths of the same length), and their command lines and environments are padded to
    the same size, another one for each pair of repeats (`Paced`).  With the files named after the
    variants ("lockstep-on", "lockstep-off") "on" against "on" read 1.012 in the median of ten runs; named
    and padded alike, 1.006 (benchmarks/results/2026-12-04-demo-cost.md, "The method checked against itself").
    """
    with tempfile.TemporaryDirectory(prefix="bench_demo_lockstep_") as tmp:
        work = Path(tmp)
        paced: dict[str, Paced] = {}
        configs = dict(zip(("on", "off"), args.lockstep.split(",")))
        for n, variant in enumerate(launch):  # setup + step 0, alone
            p = paced[variant] = Paced(variant, args.seed, args.steps, args.overrides, work, configs[variant],
                                       slot=f"launched-{n + 1}", layout_bytes=LAYOUT_BYTES + (repeat * 1552) % 4096)
            p.wait_step()
            p.first_s = time.perf_counter() - p.t0
            p.pause()
        k, total, group = 0, args.steps or 100, max(1, args.group)
        rounds = 0
        while k < total:
            order = launch if rounds % 2 == 0 else launch[::-1]
            n = min(group, total - k)
            for variant in order:
                p = paced[variant]
                p.resume()
                for j in range(n):
                    if j:
                        p.go_on()
                    if p.wait_step() != k + j + 1:
                        sys.exit("lockstep: the two variants are not at the same step")
                p.pause()
            k += n
            rounds += 1
        reports = {v: paced[v].finish() for v in launch}
    on, off = paced["on"], paced["off"]
    steps = sorted(set(on.steps) & set(off.steps) - {0})
    ratios = [on.steps[i] / off.steps[i] for i in steps]
    total_on = sum(on.steps[i] for i in steps)
    total_off = sum(off.steps[i] for i in steps)
    q = statistics.quantiles(ratios, n=4)
    print(f"lockstep demo: {len(steps)} training steps, seed {args.seed}, the two variants alternating "
          f"{'step by step' if args.group <= 1 else f'every {args.group} steps'}; "
          f"{launch[0]} started first")
    for v in ("on", "off"):  # the columns: "on" is A of --lockstep A,B, "off" is B
        base, *env = configs[v].split("@")
        what = (f"exporters {', '.join(reports[v]['exporters'])}; traced samples per step per worker: 4"
                if base == "on" else "no exporter, tracing off" if base == "off" else base)
        print(f"  {v:<3}: {what}" + (f"; {', '.join(env)}" if env else ""))
    print(f"{'figure':<40}{'on':>10}{'off':>10}{'ratio':>9}")
    print(f"{'training steps 1..N, total (s)':<40}{total_on:>10.2f}{total_off:>10.2f}{total_on / total_off:>9.3f}")
    print(f"{'steps/s':<40}{len(steps) / total_on:>10.2f}{len(steps) / total_off:>10.2f}"
          f"{total_off / total_on:>9.3f}")
    cpu_on = sum(on.cpu[i] for i in steps)
    cpu_off = sum(off.cpu[i] for i in steps)
    print(f"{'  CPU time of the training thread (s)':<40}{cpu_on:>10.2f}{cpu_off:>10.2f}{cpu_on / cpu_off:>9.3f}")
    f_on = sum(on.faults[i] for i in steps) / len(steps)
    f_off = sum(off.faults[i] for i in steps) / len(steps)
    print(f"{'  page faults of that thread per step':<40}{f_on:>10.0f}{f_off:>10.0f}")
    print(f"{'per-step ratio, median (quartiles)':<40}{'':>20}{statistics.median(ratios):>9.3f}"
          f"  ({q[0]:.3f} / {q[2]:.3f})")
    print(f"{'start + setup + step 0 (s)':<40}{on.first_s:>10.2f}{off.first_s:>10.2f}{on.first_s / off.first_s:>9.3f}")
    print(f"{'end: final flush + exit (s)':<40}{on.tail_s:>10.2f}{off.tail_s:>10.2f}")
    wall_on = on.first_s + total_on + on.tail_s
    wall_off = off.first_s + total_off + off.tail_s
    print(f"{'process wall time, sum of the parts (s)':<40}{wall_on:>10.2f}{wall_off:>10.2f}{wall_on / wall_off:>9.3f}")
    sums = {v: _phase_sums(r) for v, r in reports.items()}
    phases = sorted(k for k in sums["off"] if k != "timing_s/step")
    if phases:
        print("by phase (timing_s/*, steps 1..N):")
        for key in phases:
            a, b = sums["on"].get(key, 0.0), sums["off"][key]
            print(f"  {key[len('timing_s/'):]:<38}{a:>10.3f}{b:>10.3f}{a / b if b else float('nan'):>9.3f}")
    same = _same_training(reports["on"], reports["off"])
    print(f"same training (validation rewards, last-step metrics): {'yes' if same else 'NO'}")
    print(f"training steps with telemetry on: {(total_on / total_off - 1) * 100:+.1f}% (goal <= +2%); "
          f"wall time {(wall_on / wall_off - 1) * 100:+.1f}%")
    result = {"train_ratio": total_on / total_off, "wall_ratio": wall_on / wall_off, "launch": launch,
              "faults": (f_on, f_off), "first": (on.first_s, off.first_s), "tail": (on.tail_s, off.tail_s),
              "wall": (wall_on, wall_off),
              # on minus off per training step, ms, by phase (the whole step under "step")
              "phase_ms": {key[len("timing_s/"):]: (sums["on"].get(key, 0.0) - b) * 1000 / len(steps)
                           for key, b in sums["off"].items()}}
    if args.json:
        Path(args.json).write_text(json.dumps({
            "mode": "lockstep", "group": max(1, args.group), "steps": len(steps), "seed": args.seed,
            "on_steps": on.steps, "off_steps": off.steps,
            "on_cpu": on.cpu, "off_cpu": off.cpu, "on_faults": on.faults, "off_faults": off.faults,
            "total_on": total_on, "total_off": total_off, "first_on": on.first_s, "first_off": off.first_s,
            "tail_on": on.tail_s, "tail_off": off.tail_s, "same_training": same,
            "phase_on": sums["on"], "phase_off": sums["off"]}, indent=1))
    return result


def _phase_sums(report: dict) -> dict[str, float]:
    """timing_s/<phase> summed over the training steps of a demo report."""
    sums: dict[str, float] = {}
    for timings in report.get("step_timings", ()):
        for key, seconds in timings.items():
            sums[key] = sums.get(key, 0.0) + seconds
    return sums


def _same_training(a: dict, b: dict) -> bool:
    def strip(m: dict) -> dict:
        return {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}

    return a["val_history"] == b["val_history"] and strip(a["last_metrics"]) == strip(b["last_metrics"])


def _compile(root: Path) -> None:
    compileall.compile_dir(str(root / "otel_rl"), quiet=1)
    for pkg in sorted((root / "exporters").glob("*/otel_rl_*")):
        compileall.compile_dir(str(pkg), quiet=1)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of what `values` are a sample of: the
    k-th smallest and the k-th largest value for the largest k whose interval covers the median with
    probability >= `level` (the number of values below the median is binomial(n, 1/2)).  Returns
    (low, high, its coverage), or None when there are too few values for `level` (fewer than 6 at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    best = None
    tail = 0.0  # P(Binomial(n, 1/2) <= k - 1)
    for k in range(1, n // 2 + 1):
        tail += math.comb(n, k - 1) / 2 ** n
        coverage = 1 - 2 * tail
        if coverage < level:
            break
        best = (xs[k - 1], xs[n - k], coverage)
    return best


def _median_interval(values: list[float]) -> str:
    ci = median_interval(values)
    return "" if ci is None else f" (interval {ci[0]:.3f}–{ci[1]:.3f}, {ci[2]:.0%} confidence)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps (default: the demo's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every number here")
    ap.add_argument("--breakdown", action="store_true",
                    help="also run each part of 'on' alone (console+file, mlflow metrics, wandb, swanlab, "
                         "traces to the in-memory test exporter, traces to mlflow), one run each")
    ap.add_argument("--lockstep", nargs="?", const="on,off", default=None, metavar="A,B",
                    help="run the two variants side by side, alternating step by step (see lockstep()); "
                         "A,B: the configurations compared (default on,off; off,off or on,on show the noise; "
                         "NAME@VAR=VALUE gives one its environment, e.g. on@LOCKSTEP_MUTE=start: set up in full, "
                         "switched off from step 0 (=1: after step 0); on@LOCKSTEP_SETTLE=1: step 0 ends with a "
                         "flush, so the export process's start-up is over before step 1; on@LOCKSTEP_HOLD_EXPORT=1: its "
                         "export process stays stopped during the steps and catches up at the end; on@LOCKSTEP_QUIET_GEN=1: "
                         "stopped only while the trainer's 'gen' timer is open; off@LOCKSTEP_BURN=0.1: a process beside it "
                         "busy 10 %% of every 100 ms at the export process's priority (=F:P: F of every P s); "
                         "off@LOCKSTEP_WAKE=100: one that only wakes 100 times a second; "
                         "off@LOCKSTEP_ARGS=\"k=v ...\": dotlist overrides for "
                         "that variant only)")
    ap.add_argument("--group", type=int, default=1, metavar="K",
                    help="--lockstep: each variant runs K steps in a row before the other one runs (default 1: "
                         "they alternate step by step)")
    ap.add_argument("overrides", nargs="*", help="more dotlist overrides for both variants")
    args = ap.parse_args()
    # both variants import otel-rl's modules from bytecode, as from an installed package (pip compiles
    # it at install; a checkout run with PYTHONDONTWRITEBYTECODE=1 would compile the exporters' modules
    # at every start of the "on" runs only)
    _compile(Path(__file__).resolve().parent.parent)
    if args.lockstep:
        runs = []
        for k in range(args.repeats):
            runs.append(lockstep(args, ("on", "off") if k % 2 == 0 else ("off", "on"), repeat=k // 2))
            print(flush=True)
        ratios = sorted(r["train_ratio"] for r in runs)
        walls = sorted(r["wall_ratio"] for r in runs)
        print(f"lockstep, {len(runs)} runs (first variant alternating): training steps on/off "
              + ", ".join(f"{r['train_ratio']:.3f}" for r in runs)
              + f"; median {statistics.median(ratios):.3f}{_median_interval(ratios)}; wall time median "
              f"{statistics.median(walls):.3f}{_median_interval(walls)}")
        print("  page faults of the training thread per step (on/off): "
              + ", ".join(f"{r['faults'][0]:.0f}/{r['faults'][1]:.0f}" for r in runs))
        phases = [p for p in runs[0]["phase_ms"] if all(p in r["phase_ms"] for r in runs)]
        if phases:  # where the difference lands: each run's on - off per step, by phase
            print("  on - off per training step (ms), by phase, median over the runs: " + ", ".join(
                f"{p} {statistics.median(r['phase_ms'][p] for r in runs):+.2f}"
                for p in sorted(phases, key=lambda p: (p != "step", p))))
        for part, label in (("first", "start + setup + step 0"), ("tail", "end: final flush + exit"),
                            ("wall", "wall time, sum of the parts")):
            print(f"  {label} (s, on/off): " + ", ".join(f"{r[part][0]:.2f}/{r[part][1]:.2f}" for r in runs)
                  + f"; medians {statistics.median(r[part][0] for r in runs):.2f}/"
                  f"{statistics.median(r[part][1] for r in runs):.2f}, paired difference median "
                  f"{statistics.median(r[part][0] - r[part][1] for r in runs):+.2f}")
        return
    results: dict[str, list[dict]] = {"on": [], "off": []}
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
                       ("wall_s", "process wall time (s)"), ("tree_cpu_s", "CPU time, all processes (s)")):
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
