"""How much work on the *other* core slows the demo's training: the cost of an export process that only
uses CPU time nobody else wants.

    .venv/bin/python benchmarks/bench_neighbour.py                       # all workloads, 150 steps each
    .venv/bin/python benchmarks/bench_neighbour.py --workloads sqlite,none --steps 100

The demo runs with telemetry off, in this process.  Next to it runs a neighbour process in Linux's idle
scheduling class (as otel-rl's export process does) which works in the even half-second windows of the
monotonic clock and sleeps in the odd ones.  Each training step that falls entirely inside one window is
counted as "busy" or "idle"; the ratio of their medians is what that kind of work on the other core costs
the training thread.  The same process, the same steps interleaved: no run-to-run noise.

Workloads:
- none:   the neighbour never works (the method's own bias: the ratio should be ~1)
- spin:   a Python loop (CPU only, nothing leaves the core's own caches)
- json:   JSON encoding and decoding of small dicts (no I/O)
- fsync:  4 KiB written to a file and fsync'ed, in a loop (I/O only)
- sqlite: the "json" work and sqlite inserts with a commit: the export process's kind of work
- memory: writes across a 64 MiB buffer (memory bandwidth and the shared cache)
- export: no neighbour of ours: the demo runs with telemetry fully on (as ``bench_demo.py``'s "on"), and
          its own export process (with its children, e.g. wandb's service) is stopped (SIGSTOP) in
          the odd windows and let run (SIGCONT) in the even ones.  It catches up on what it was
          sent meanwhile, so a busy window holds about two windows' worth of export work: the
          average cost of the export process is about (ratio - 1) / 2.  The trainer's own
          telemetry work (instrumentation, its pipeline thread) is in both windows alike, so this
          isolates what the export process costs the training thread, without run-to-run noise;
          ``--env NAME=VALUE`` runs it again with that environment (an A/B of an export setting)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import signal
import tempfile
import threading
import time

WINDOW_S = 0.5
WORKLOADS = ("none", "spin", "json", "fsync", "sqlite", "memory", "export")
#: the demo's "on" configuration (see bench_demo.py)
ON = ['trainer.logger=["console","mlflow","file","wandb","swanlab"]',
      "actor_rollout_ref.rollout.trace.backend=mlflow",
      "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=4"]
OFF = ["trainer.logger=[]", "actor_rollout_ref.rollout.trace.backend=null"]


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for k in kids:
            out.append(k)
            out.extend(_descendants(k))
    return out


class _Pacer(threading.Thread):
    """Stops this process's export process (and its children) in the odd windows, resumes it in the even ones."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.stopped: set[int] = set()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.monotonic()
            self.done.wait(WINDOW_S - (now % WINDOW_S) + 0.0005)
            if self.done.is_set():
                break
            odd = int(time.monotonic() / WINDOW_S) % 2
            for pid in _descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGSTOP if odd else signal.SIGCONT)
                except OSError:
                    continue
                (self.stopped.add if odd else self.stopped.discard)(pid)
        self.release()

    def release(self) -> None:
        for pid in list(self.stopped) + _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        self.stopped.clear()


def neighbour(kind: str, workdir: str) -> None:
    """The neighbour process: works in even windows, sleeps in odd ones."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    con = sqlite3.connect(os.path.join(workdir, "neighbour.db"))
    con.execute("CREATE TABLE IF NOT EXISTS t (a TEXT, b TEXT)")
    rnd = random.Random(0)
    rows = [{f"k{i}": "v" * 50 + str(rnd.random()) for i in range(200)} for _ in range(50)]
    buf = bytearray(64 << 20)
    ones = b"\1" * (len(buf) // 64)
    while True:
        now = time.monotonic()
        if int(now / WINDOW_S) % 2 or kind == "none":
            time.sleep(WINDOW_S - (now % WINDOW_S) + 0.001)
        elif kind == "sqlite":
            texts = [json.dumps(r) for r in rows]
            con.executemany("INSERT INTO t VALUES (?, ?)", [(x, x[:100]) for x in texts])
            con.commit()
            for x in texts:
                json.loads(x)
        elif kind == "json":
            for x in [json.dumps(r) for r in rows]:
                json.loads(x)
        elif kind == "fsync":
            with open(os.path.join(workdir, "neighbour.bin"), "ab") as f:
                f.write(b"x" * 4096)
                f.flush()
                os.fsync(f.fileno())
        elif kind == "memory":
            buf[::64] = ones
        # spin: nothing to do but loop


def measure(kind: str, steps: int, seed: int) -> dict:
    """One demo run next to a neighbour doing `kind` (or pacing its own export process); step times by window."""
    from otel_rl.demo import trainer as demo_trainer

    marks: list[float] = []
    original = demo_trainer.GRPOTrainer.__init__
    pacer = _Pacer() if kind == "export" else None

    def init(self, cfg, on_step=None):  # type: ignore[no-untyped-def]
        def hook(*args, _inner=on_step):  # type: ignore[no-untyped-def]
            marks.append(time.monotonic())
            if pacer is not None and len(marks) == 1:
                pacer.start()  # after setup and step 0
            if _inner is not None:
                _inner(*args)
            if pacer is not None and len(marks) == steps + 1:
                pacer.done.set()  # before the final flush
                pacer.join()
        original(self, cfg, hook)

    with tempfile.TemporaryDirectory() as tmp:
        proc = None
        if pacer is None:
            proc = subprocess.Popen([sys.executable, __file__, "--neighbour", kind, "--workdir", tmp])
        demo_trainer.GRPOTrainer.__init__ = init  # type: ignore[method-assign]
        try:
            argv = ["--no-progress", "--seed", str(seed), "--steps", str(steps), "--output-dir",
                    os.path.join(tmp, "out"), *(ON if kind == "export" else OFF)]
            _run_demo(argv)
        finally:
            demo_trainer.GRPOTrainer.__init__ = original  # type: ignore[method-assign]
            if pacer is not None:
                pacer.done.set()
                pacer.release()
            if proc is not None:
                proc.kill()
                proc.wait()
    busy, idle = [], []
    for a, z in zip(marks[1:], marks[2:]):  # step 0 (setup, validation) left out
        wa, wz = int(a / WINDOW_S), int(z / WINDOW_S)
        if wa == wz:
            (busy if wa % 2 == 0 else idle).append(z - a)
    return {"busy": busy, "idle": idle}


def _run_demo(argv: list[str]) -> None:
    """`otel-rl demo ARGV` in this process (the step marks are taken here)."""
    from otel_rl.cli import main

    old = sys.argv
    sys.argv = ["otel-rl", "demo", *argv]
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.argv = old


def main() -> None:
    global WINDOW_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w != "export"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=float, default=WINDOW_S, help="window length in seconds (default 0.5)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="measure each workload again with this environment (repeatable: one setting)")
    ap.add_argument("--repeats", type=int, default=1, help="measure each workload (and setting) this many times")
    ap.add_argument("--neighbour", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    WINDOW_S = args.window
    if args.neighbour:
        neighbour(args.neighbour, args.workdir or tempfile.gettempdir())
        return
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("SWANLAB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    setting = dict(a.split("=", 1) for a in args.env)
    base = {k: os.environ.get(k) for k in setting}
    results = []
    for kind in args.workloads.split(","):
        kind = kind.strip()
        if kind not in WORKLOADS:
            sys.exit(f"unknown workload {kind!r}; one of {', '.join(WORKLOADS)}")
        for k in range(args.repeats):
            for label, env in ((kind, base), (f"{kind} {' '.join(args.env)}", setting))[:2 if setting else 1]:
                for name, value in env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                r = measure(kind, args.steps, args.seed)
                if not r["busy"] or not r["idle"]:
                    sys.exit(f"{kind}: too few steps inside the windows; use more --steps")
                results.append((label, r))
                mb, mi = statistics.median(r["busy"]), statistics.median(r["idle"])
                print(f"  {label}: {mb / mi:.3f}", flush=True)
    for name, value in base.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    print(f"demo, {args.steps} steps per measurement; neighbour in the idle class, working in alternate "
          f"{WINDOW_S} s windows (export: the demo's own export process, let run in alternate windows)")
    print(f"{'neighbour':24s} {'steps busy':>10s} {'steps idle':>10s} {'median busy':>12s} {'median idle':>12s} "
          f"{'ratio':>7s}")
    for kind, r in results:
        mb, mi = statistics.median(r["busy"]), statistics.median(r["idle"])
        print(f"{kind:24s} {len(r['busy']):10d} {len(r['idle']):10d} {mb * 1000:10.1f}ms {mi * 1000:10.1f}ms "
              f"{mb / mi:7.3f}")


if __name__ == "__main__":
    main()
