"""The CPU time telemetry takes from the training process per demo step, without torch's noise.

    .venv/bin/python benchmarks/bench_telemetry_cpu.py                 # 30 blocks of 20 steps each way
    .venv/bin/python benchmarks/bench_telemetry_cpu.py --blocks 60 --profile /tmp/tel.prof

The demo's trainer with the configuration of ``bench_demo.py``'s "on" variant (console,
MLflow, JSONL, wandb, SwanLab; 4 samples/step/worker traced to MLflow with token2text), but
with its torch work taken out of the steps: the rollout server answers every request at once
with what the trained policy writes (a calculator call, then the tool's result), and the
old_log_prob, ref and update_actor phases only report their metrics.  What is left of a step
is the instrumented part: 256 agent loops (32 of them traced: ~160 spans), the step and its
timers, one ``log()`` of the step's ~45 metrics, and a validation every ``trainer.test_freq``
steps (64 more agent loops, ``log_generations``).

The steps alternate in blocks with telemetry on as configured and switched off (no handle,
tracing off: every decorator, context manager and ``log()`` takes its disabled path).  Each
block ends with a flush, so the work it caused (the pipeline's packing and hand-over, the
console and JSONL lines) is done inside it.  Reported per step (medians over the blocks, and the
median of the differences of each "on" block and the "off" block after it): the CPU time of the
whole training process (all its threads: the training thread, the pipeline, the export
process's sender and reader, the console and JSONL queues), of the training thread alone, of
the cyclic GC on it, and of the export process (all its threads and what it started; it runs on
the other core).  Set against a demo step (``--step-ms``, ~175 ms on the development machine),
the training process's on minus off is what telemetry's own work adds to a training step.  It
leaves out what it does to the code around it: the export process's work on the other core
slows the training thread too (``bench_demo.py --lockstep`` sees the sum).

``--pause-export`` stops the export process (and wandb's service under it) during the steps of
the "on" blocks and lets it work only in their flush: whether its work changes the training
process's figures.  Dotlist overrides change the configuration, e.g.
``actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=0`` or ``=8`` for the cost of
the traced trajectories alone (the slope).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_demo import GcClock, in_process_environment, in_process_parser, run_in_process  # noqa: E402


def _proc_cpu_s(pid: int) -> float:
    """CPU time of process `pid` so far, all its threads (nanosecond counters of the scheduler)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (the export process and what it started: wandb's service)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


def main() -> None:
    ap = in_process_parser(__doc__)
    ap.add_argument("--blocks", type=int, default=30, help="blocks each way")
    ap.add_argument("--block", type=int, default=20, help="steps per block (a multiple of trainer.test_freq, 10)")
    ap.add_argument("--step-ms", type=float, default=175.0, help="a demo training step, to give the cost as a share")
    ap.add_argument("--pause-export", action="store_true",
                    help="stop the export process (and what it started) during the 'on' blocks' steps and let it "
                         "run only in their flush: the training process's own cost, without the export process's "
                         "work on the other core slowing the training thread")
    ap.add_argument("--profile", default=None, help="write a cProfile of the training thread's 'on' blocks here")
    args = ap.parse_args()
    in_process_environment()

    import torch

    from otel_rl import _runtime
    from otel_rl.demo import agent_loop, trainer as trainer_mod
    from otel_rl.demo.task import CALL, RESULT

    def decode(self, prompts, params):  # what a policy that has learnt the tool writes, with no model
        self.batches += 1
        out = []
        for p in prompts:
            if RESULT in p:
                k = len(p) - 1 - p[::-1].index(RESULT)
                out.append(p[k + 1:])  # the tool's digits and </s>
            else:
                out.append([CALL])
        return out

    agent_loop.RolloutServer.decode = decode

    def token_log_probs(model, ids, with_entropy=False):  # the shapes of the real ones, no model
        zeros = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        return zeros, (zeros if with_entropy else None)

    trainer_mod.token_log_probs = token_log_probs

    gc_clock = GcClock(time.thread_time, threading.get_ident()).start()  # the training thread's GC seconds
    base = trainer_mod.GRPOTrainer
    total = args.blocks * 2 * args.block
    rows: list[tuple[bool, float, float, float, float]] = []  # (on, CPU s: process, thread, export process, GC)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()

    class Bare(base):  # type: ignore[misc, valid-type]
        def pretrain(self):
            self.ref = self.actor
            return {}

        def update_actor(self, batch, old_logp, ref_logp, token_adv):
            return {"actor/pg_loss": 0.1, "actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0,
                    "actor/ppo_kl": 0.0, "actor/kl_loss": 0.01, "actor/grad_norm": 1.0, "actor/lr": 1e-3,
                    "actor/kl_coef": 1e-3}

        def __init__(self, cfg, on_step=None):
            state = paused_state
            state.update(saved=None, mark=None)

            def paced(step, metrics):
                if on_step is not None:
                    on_step(step, metrics)
                if step == 0:
                    state["saved"] = _runtime.active
                    state["mark"] = self._mark()
                    self._switch(state, True)
                    return
                if step % args.block == 0:
                    on = _runtime.active.handle is not None
                    if on:
                        if state.get("paused"):
                            _signal_all(state.pop("paused"), signal.SIGCONT)
                        _runtime.active.handle.flush()
                    if profiler is not None and on:
                        profiler.disable()
                    now = self._mark()
                    m0 = state["mark"]
                    rows.append((on, now[0] - m0[0], now[1] - m0[1], now[2] - m0[2], now[3] - m0[3]))
                    if step == total:
                        return  # the run ends as configured (nothing paused)
                    self._switch(state, not on)
                    state["mark"] = self._mark()

            super().__init__(cfg, on_step=paced)

        def _mark(self):
            saved = paused_state.get("saved")
            remote = saved.handle._pipeline.remote if saved is not None else None
            return (time.process_time(), time.thread_time(), _proc_cpu_s(remote.pid) if remote is not None else 0.0,
                    gc_clock.seconds)

        def _switch(self, state, on):
            if on:
                _runtime.install(state["saved"])
                remote = state["saved"].handle._pipeline.remote if state["saved"] is not None else None
                if args.pause_export and remote is not None:
                    state["paused"] = _descendants(remote.pid)
                    _signal_all(state["paused"], signal.SIGSTOP)
                if profiler is not None:
                    profiler.enable()
            else:
                _runtime.uninstall()

    trainer_mod.GRPOTrainer = Bare
    paused_state: dict = {}
    try:
        run_in_process(0, total, args.overrides, "bench_telemetry_cpu")
    finally:
        gc_clock.stop()
        if paused_state.get("paused"):  # a run that failed inside an "on" block
            _signal_all(paused_state["paused"], signal.SIGCONT)
    asyncio.set_event_loop(None)

    def per_step(on: bool, k: int) -> list[float]:
        return [r[k] / args.block * 1000 for r in rows if r[0] == on]

    print(f"{len([r for r in rows if r[0]])} blocks of {args.block} steps each way; CPU time per step, ms:")
    print(f"{'figure':44} {'on':>8} {'off':>8} {'on-off':>8} {'paired':>8}  share of a {args.step_ms:g} ms step")
    for label, k in (("the training process", 1), ("  of it the training thread", 2),
                     ("    of it the cyclic GC", 4), ("the export process (other core)", 3)):
        ons, offs = per_step(True, k), per_step(False, k)
        on, off = statistics.median(ons), statistics.median(offs)
        paired = statistics.median(a - b for a, b in zip(ons, offs))  # each "on" block and the "off" after it
        share = f"{100 * paired / args.step_ms:+.2f} %" if k != 3 else ""
        print(f"{label:44} {on:8.2f} {off:8.2f} {on - off:8.2f} {paired:8.2f}  {share}")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"profile of the 'on' blocks (training thread): {args.profile}")


if __name__ == "__main__":
    main()
