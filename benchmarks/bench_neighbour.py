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
- dicts:  small dicts made and turned into text (allocation-heavy Python)
- syscall: the cheapest system call (getppid) in a loop: kernel entries and exits only
- futex:  two threads of the neighbour waking each other in turn (futex wake-ups, context switches)
- mmap:   1 MiB mapped, a byte written in each page, unmapped, in a loop (page faults, page-table updates)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WINDOW_S = 0.5
WORKLOADS = ("none", "spin", "json", "fsync", "sqlite", "memory", "dicts", "syscall", "futex", "mmap")


def neighbour(kind: str, workdir: str, duty: float = 0.5, period_s: float = 2 * WINDOW_S, nice: int = 0) -> None:
    """The neighbour process: works the first `duty` of every `period_s` of the monotonic clock (by
    default its even `WINDOW_S` windows) and sleeps the rest (``wake``: does nothing but wake every
    `period_s`); in the idle class, `nice` lower; ends with its parent.  (Also
    `benchmarks/_lockstep_demo.py`'s ``LOCKSTEP_BURN`` and ``LOCKSTEP_WAKE``.)"""
    if nice > 0:
        os.nice(nice)
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    parent = os.getppid()
    if kind == "wake":  # no work at all: only wakes every `period_s` (_lockstep_demo.py's LOCKSTEP_WAKE)
        while os.getppid() == parent:
            time.sleep(period_s)
        return
    busy_s = duty * period_s
    con = sqlite3.connect(os.path.join(workdir, "neighbour.db"))
    con.execute("CREATE TABLE IF NOT EXISTS t (a TEXT, b TEXT)")
    rnd = random.Random(0)
    rows = [{f"k{i}": "v" * 50 + str(rnd.random()) for i in range(200)} for _ in range(50)]
    buf = bytearray(64 << 20)
    ones = b"\1" * (len(buf) // 64)
    ping, pong = threading.Event(), threading.Event()
    if kind == "futex":
        def answer() -> None:
            while True:
                ping.wait()
                ping.clear()
                pong.set()

        threading.Thread(target=answer, daemon=True).start()
    page_marks = b"\1" * 256
    while os.getppid() == parent:
        now = time.monotonic()
        phase = now % period_s
        if phase >= busy_s or kind == "none":
            time.sleep(period_s - phase + 0.001)
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
        elif kind == "dicts":  # small dicts made and turned into text: allocation-heavy Python
            "".join(repr({"name": f"span{i}", "attrs": {"k": str(i) * 3, "v": i * 1.5}}) for i in range(200))
        elif kind == "syscall":
            for _ in range(1000):
                os.getppid()
        elif kind == "futex":
            for _ in range(200):
                ping.set()
                pong.wait()
                pong.clear()
        elif kind == "mmap":
            for _ in range(20):
                m = mmap.mmap(-1, 1 << 20)
                m[::4096] = page_marks
                m.close()
        # spin: nothing to do but loop


def measure(kind: str, steps: int, seed: int) -> dict:
    """One demo run (telemetry off) next to a neighbour doing `kind`; step times by window."""
    from otel_rl.demo import trainer as demo_trainer

    marks: list[float] = []
    original = demo_trainer.GRPOTrainer.__init__

    def init(self, cfg, on_step=None):  # type: ignore[no-untyped-def]
        def hook(*args, _inner=on_step):  # type: ignore[no-untyped-def]
            marks.append(time.monotonic())
            if _inner is not None:
                _inner(*args)
        original(self, cfg, hook)

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, __file__, "--neighbour", kind, "--workdir", tmp])
        demo_trainer.GRPOTrainer.__init__ = init  # type: ignore[method-assign]
        try:
            argv = ["--no-progress", "--seed", str(seed), "--steps", str(steps), "--output-dir",
                    os.path.join(tmp, "out"), "trainer.logger=[]", "actor_rollout_ref.rollout.trace.backend=null"]
            _run_demo(argv)
        finally:
            demo_trainer.GRPOTrainer.__init__ = original  # type: ignore[method-assign]
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--neighbour", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--duty", type=float, default=0.5, help=argparse.SUPPRESS)
    ap.add_argument("--period", type=float, default=2 * WINDOW_S, help=argparse.SUPPRESS)
    ap.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.neighbour:
        neighbour(args.neighbour, args.workdir or tempfile.gettempdir(), args.duty, args.period, args.nice)
        return
    os.environ.setdefault("WANDB_MODE", "offline")
    results = []
    for kind in args.workloads.split(","):
        kind = kind.strip()
        if kind not in WORKLOADS:
            sys.exit(f"unknown workload {kind!r}; one of {', '.join(WORKLOADS)}")
        r = measure(kind, args.steps, args.seed)
        if not r["busy"] or not r["idle"]:
            sys.exit(f"{kind}: too few steps inside the windows; use more --steps")
        results.append((kind, r))
    print(f"demo, telemetry off, {args.steps} steps per workload; neighbour in the idle class, "
          f"working in alternate {WINDOW_S} s windows")
    print(f"{'neighbour':10s} {'steps busy':>10s} {'steps idle':>10s} {'median busy':>12s} {'median idle':>12s} "
          f"{'ratio':>7s}")
    for kind, r in results:
        mb, mi = statistics.median(r["busy"]), statistics.median(r["idle"])
        print(f"{kind:10s} {len(r['busy']):10d} {len(r['idle']):10d} {mb * 1000:10.1f}ms {mi * 1000:10.1f}ms "
              f"{mb / mi:7.3f}")


if __name__ == "__main__":
    main()
