"""Telemetry on vs off in blocks of steps of one demo process.

    .venv/bin/python benchmarks/bench_blocks.py                       # 300 steps, blocks of 20, 4 skipped
    .venv/bin/python benchmarks/bench_blocks.py --block 4 --skip 1    # short blocks: see below

One ``otel-rl demo`` process with the configuration of ``bench_demo.py``'s "on" variant (no
validation after step 0, so every block is training steps only).  Its training steps alternate
in blocks: ``--block`` steps with telemetry on as configured, then ``--block`` steps with it
switched off (tracing off, no handle: every decorator, context manager and ``log()`` takes its
disabled path, as in a run without telemetry), and so on.  The first ``--skip`` steps of each
block are left out: what telemetry does after the steps that made it (the pipeline's batches
every ``batch_delay_s``, the export process's deliveries gathered over ``export_interval_s``) lands
there.  Reported: the training thread's CPU time and the wall time per step, mean and median,
on against off.

Unlike ``bench_demo.py --lockstep`` there is one process: no process-to-process spread (memory
layout, which variant started first), but the two halves share the process's history, and
work that telemetry leaves for later than ``--skip`` steps is charged to "off" (with blocks of 4
and one step skipped the export process's work of an "on" block mostly falls into the "off"
block after it).  The training changes over a run (responses grow as the policy learns the
tool), which long blocks see as a trend: several hundred steps keep it small.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_demo import GcClock, in_process_environment, in_process_parser, run_in_process  # noqa: E402


def main() -> None:
    ap = in_process_parser(__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--skip", type=int, default=4, help="steps left out at the start of each block")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 0 <= args.skip < args.block:
        sys.exit("--skip must be at least 0 and less than --block")
    in_process_environment()

    from otel_rl import _runtime
    from otel_rl.demo import trainer as trainer_mod

    base = trainer_mod.GRPOTrainer
    rows: list[tuple] = []  # (step, telemetry on, CPU s, wall s, GC s, voluntary, involuntary switches, CPU moves)
    gc_clock = GcClock(time.perf_counter).start()  # seconds in the cyclic GC so far

    def switches() -> tuple[int, int, int]:
        """The calling thread's (voluntary, involuntary) context switches and its moves between CPUs so far."""
        try:
            with open("/proc/thread-self/status") as f:
                v = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
            moves = 0
            try:
                with open("/proc/thread-self/sched") as f:
                    moves = next(int(line.split(":")[1]) for line in f if line.startswith("se.nr_migrations"))
            except (OSError, StopIteration, ValueError):  # a kernel without scheduler statistics
                pass
            return int(v["voluntary_ctxt_switches"]), int(v["nonvoluntary_ctxt_switches"]), moves
        except (OSError, KeyError, ValueError):  # not Linux
            return 0, 0, 0
    saved: list = []

    class Blocks(base):  # type: ignore[misc, valid-type]
        def __init__(self, cfg, on_step=None):
            mark = [0.0, 0.0, 0.0, 0, 0, 0]
            on = [True]

            def paced(step, metrics):
                if on_step is not None:
                    on_step(step, metrics)
                cpu, wall = time.thread_time(), time.perf_counter()
                if step > 0:
                    vol, invol, moves = switches()
                    rows.append((step, on[0], cpu - mark[0], wall - mark[1], gc_clock.seconds - mark[2], vol - mark[3],
                                 invol - mark[4], moves - mark[5]))
                if not saved:
                    saved.append(_runtime.active)
                on[0] = ((step + 1) // args.block) % 2 == 0  # for the next step: blocks by step number
                _runtime.install(saved[0]) if on[0] else _runtime.uninstall()
                mark[:] = [time.thread_time(), time.perf_counter(), gc_clock.seconds, *switches()]

            super().__init__(cfg, on_step=paced)

    trainer_mod.GRPOTrainer = Blocks
    try:
        run_in_process(args.seed, args.steps, ["trainer.test_freq=0", *args.overrides], "bench_blocks_")
    finally:
        if saved:
            _runtime.install(saved[0])
        gc_clock.stop()
    # block b holds steps b*block .. b*block+block-1; the first block (step 0 is not a training step) is left out
    kept = [r for r in rows if r[0] >= args.block and r[0] % args.block >= args.skip]
    print(f"blocks: {args.steps} training steps of one demo process, telemetry on and off in blocks of "
          f"{args.block} steps, the first {args.skip} of each left out")
    print(f"{'per step (ms)':<34}{'on':>10}{'off':>10}{'ratio':>9}")
    for label, i, fn in (("training thread CPU, mean", 2, statistics.mean),
                         ("training thread CPU, median", 2, statistics.median),
                         ("wall time, mean", 3, statistics.mean), ("wall time, median", 3, statistics.median),
                         ("  of which the cyclic GC, mean", 4, statistics.mean)):
        a = fn(r[i] for r in kept if r[1])
        b = fn(r[i] for r in kept if not r[1])
        print(f"{label:<34}{a * 1e3:>10.2f}{b * 1e3:>10.2f}{a / b:>9.4f}")
    for label, i in (("voluntary switches of the thread", 5), ("involuntary switches of the thread", 6),
                     ("moves of the thread to another CPU", 7)):
        a = statistics.mean(r[i] for r in kept if r[1])
        b = statistics.mean(r[i] for r in kept if not r[1])
        print(f"{label + ', per step':<44}{a:>10.1f}{b:>10.1f}")
    print(f"steps kept: {sum(r[1] for r in kept)} on, {sum(not r[1] for r in kept)} off")


if __name__ == "__main__":
    main()
