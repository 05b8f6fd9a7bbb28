"""What the export process's work costs the training steps, inside one demo process.

    .venv/bin/python benchmarks/bench_hold_export.py                    # 120 steps, blocks of 3
    .venv/bin/python benchmarks/bench_hold_export.py --check            # the same blocks, nothing stopped
    .venv/bin/python benchmarks/bench_hold_export.py --only wandb       # stop only wandb's service

One ``otel-rl demo`` process with the configuration of ``bench_demo.py``'s "on" variant.  Its
training steps alternate in blocks of ``--block`` steps: in one kind the export process (and
everything it started: wandb's service) runs as usual; in the other it is stopped (``SIGSTOP``)
from the end of each step to the end of the block.  Every block ends with the export process
continued and a flush, not timed, so that each block starts with nothing left over from the one
before.  Reported: the median of each step's time and of its phases (``timing_s/*``), running
against stopped; validation steps are left out.

Stopping the export process also stops, once the pipe to it is full, the training process's
sender thread (pickling and writing batches) and the acknowledgements its reader thread handles.
``--only NAME`` stops only the processes under the export process whose command name starts with
NAME (``wandb``: wandb-core and its system monitor).  ``--check`` stops nothing: the spread of the
method itself (the two kinds of block differ only by chance).
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_demo import in_process_environment, in_process_parser, run_in_process  # noqa: E402
from bench_telemetry_cpu import _descendants, _signal_all  # noqa: E402


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def main() -> None:
    ap = in_process_parser(__doc__)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--block", type=int, default=3, help="steps per block")
    ap.add_argument("--only", default=None, help="stop only the export process's descendants named so")
    ap.add_argument("--check", action="store_true", help="stop nothing: the method's own spread")
    args = ap.parse_args()
    in_process_environment()

    import otel_rl
    from otel_rl import _runtime
    from otel_rl.demo import trainer as trainer_mod

    def signal_export(sig: int) -> None:
        if args.check:
            return
        h = _runtime.active.handle
        remote = h._pipeline.remote if h is not None else None
        pids = _descendants(remote.pid) if remote is not None else []
        if args.only:
            pids = [p for p in pids if _comm(p).startswith(args.only)]
        _signal_all(pids, sig)

    rows: dict[str, list[dict[str, float]]] = {"running": [], "stopped": []}
    base = trainer_mod.GRPOTrainer

    class Blocks(base):  # type: ignore[misc, valid-type]
        def __init__(self, cfg, on_step=None):
            state: dict = {"kind": None, "t": 0.0}

            def paced(step, metrics):
                if on_step is not None:
                    on_step(step, metrics)
                now = time.perf_counter()
                validation = self.test_freq > 0 and step % self.test_freq == 0
                if state["kind"] is not None and step >= 1 and not validation and self.step_timings:
                    row = dict(self.step_timings[-1])
                    row["wall"] = now - state["t"]
                    rows[state["kind"]].append(row)
                if state["kind"] is None or step % args.block == 0:
                    signal_export(signal.SIGCONT)
                    otel_rl.flush()  # the block starts with nothing left over
                    state["kind"] = "stopped" if state["kind"] == "running" else "running"
                if state["kind"] == "stopped":
                    signal_export(signal.SIGSTOP)
                state["t"] = time.perf_counter()

            super().__init__(cfg, on_step=paced)

    trainer_mod.GRPOTrainer = Blocks
    try:
        run_in_process(0, args.steps, args.overrides, "bench_hold_export_")
    finally:
        signal_export(signal.SIGCONT)

    what = "nothing (--check)" if args.check else (f"processes named {args.only}*" if args.only
                                                   else "the export process and all it started")
    run, held = rows["running"], rows["stopped"]
    if not run or not held:
        raise SystemExit("too few steps for two kinds of block")
    print(f"{len(run)} steps running, {len(held)} stopped ({what}), blocks of {args.block}; medians, ms:")
    print(f"{'':28s}{'running':>10s}{'stopped':>10s}{'difference':>12s}")
    keys = ["wall"] + sorted(k for k in run[0] if k != "wall")
    for k in keys:
        a = statistics.median(r[k] for r in run if k in r) * 1e3
        b = statistics.median(r[k] for r in held if k in r) * 1e3
        print(f"  {k:26s}{a:10.2f}{b:10.2f}{a - b:+12.2f}")
    step_a = statistics.median(r["wall"] for r in run)
    step_b = statistics.median(r["wall"] for r in held)
    print(f"the steps with it running: {100 * (step_a / step_b - 1):+.2f} % against stopped")


if __name__ == "__main__":
    main()
