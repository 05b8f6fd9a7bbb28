"""What otel-rl's calls cost the training thread itself, measured inside one demo run.

    .venv/bin/python benchmarks/bench_foreground.py                # 100 steps, telemetry fully on
    .venv/bin/python benchmarks/bench_foreground.py --check        # both halves off: the method's reading
    .venv/bin/python benchmarks/bench_foreground.py --steps 200 'actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=0'
    .venv/bin/python benchmarks/bench_foreground.py --steps 30 --replay 6     # the rollout again without the model

One ``otel-rl demo`` process with the configuration of ``bench_demo.py``'s "on" variant (console,
MLflow, JSONL, wandb, SwanLab; trajectories traced to MLflow at 4 samples/step/worker).  Every
training step's rollout (``gen``: the instrumented agent loops, where nearly all of otel-rl's
calls are) runs twice on the same problems from the same random state: once as configured,
once with otel-rl switched off for it (tracing off, no handle: every decorator and context
manager takes its disabled path, as in a run without telemetry); which one first alternates
from step to step.  Both produce the same trajectories (checked); training goes on with the
traced one.

The two halves share everything else: the machine at that moment, the process's memory, and
otel-rl's background work (the pipeline thread, the export process, the tracker libraries),
which keeps running through both.  What differs is only the instrumentation on the training
thread: trajectory and op spans, the JSON of inputs and outputs, token2text's bookkeeping, the
unsampled trajectories' context.  The difference (CPU time of the training thread) is that part
of the cost, free of run-to-run noise; it is also given as a share of the mean training step
(CPU time of the training thread per step without the second rollout).  The rest of the cost
of telemetry (background threads contending for the GIL, the export process's memory traffic,
the step and timer spans, ``log()``) is what ``bench_demo.py --lockstep`` adds on top.

With ``--replay K`` each step's rollout is, after it ran (once, as configured), run K more times
each way with the model's decoding replayed: the policy's sampled tokens of that rollout, batch by
batch, returned without running the model.  Everything else is as in the rollout (the agent loops,
the rollout server's batching, the tool, the reward, all of otel-rl's calls), and the trajectories
are the same; the torch work (~90 % of the rollout's CPU time) is gone, and with it most of the
run-to-run noise: the instrumentation's CPU time per rollout reads to a few hundredths of a
millisecond.  Caches are warmer than between the model's batches, so this is a floor of the cost
in the real rollout, which the default mode measures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_demo import in_process_environment, in_process_parser, run_in_process  # noqa: E402


def main() -> None:
    ap = in_process_parser(__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="both halves with telemetry off: the method's own reading")
    ap.add_argument("--json", default=None, help="also write the per-step figures here")
    ap.add_argument("--replay", type=int, default=0, metavar="K",
                    help="run each rollout K more times each way with the model's decoding replayed (see above)")
    args = ap.parse_args()
    in_process_environment()

    from otel_rl import _runtime
    from otel_rl.demo import trainer as trainer_mod

    base = trainer_mod.GRPOTrainer
    gen: dict[int, tuple[float, float]] = {}  # step -> CPU s of the rollout (configured, off)
    steps: dict[int, float] = {}  # step -> CPU s of the training thread for the step, second rollout excluded
    mismatched: list[int] = []

    class Paired(base):  # type: ignore[misc, valid-type]
        def __init__(self, cfg, on_step=None):
            mark = [0.0]

            def paced(step, metrics):
                if on_step is not None:
                    on_step(step, metrics)
                now = time.thread_time()
                if step > 0:
                    steps[step] = now - mark[0] - self.extra
                self.extra = 0.0
                mark[0] = time.thread_time()

            self.extra = 0.0
            super().__init__(cfg, on_step=paced)

        def generate_sequences(self, problems, n, sampling_params, step, validate):
            if validate:
                return super().generate_sequences(problems, n, sampling_params, step, validate)
            if args.replay:
                return self._replayed(problems, n, sampling_params, step)
            state = self.server.generator.get_state()
            halves = ("on", "off") if step % 2 else ("off", "on")
            outs, cpu = {}, {}
            for half in halves:
                self.server.generator.set_state(state)
                outs[half], cpu[half] = self._half(half, problems, n, sampling_params, step)
            if _trajectories(outs["on"]) != _trajectories(outs["off"]):
                mismatched.append(step)
            gen[step] = (cpu["on"], cpu["off"])
            self.trajectories -= len(outs["off"])
            self.extra += cpu["off"]  # the second rollout is not part of the training step
            return outs["on"]

        def _replayed(self, problems, n, sampling_params, step):
            """The rollout as configured, recording each decoding batch's tokens; then `args.replay` runs
            each way (which first alternating) with those batches returned in order instead of decoded."""
            server = self.server
            decode = server.decode
            batches: list = []

            def recording(prompts, params):
                out = decode(prompts, params)
                batches.append([list(x) for x in out])
                return out

            server.decode = recording
            try:
                outs = super().generate_sequences(problems, n, sampling_params, step, False)
            finally:
                del server.decode  # the class's method again
            want = _trajectories(outs)
            cpu: dict[str, list[float]] = {"on": [], "off": []}
            for k in range(args.replay):
                for half in (("on", "off") if (k + step) % 2 else ("off", "on")):
                    server.decode = _replay(batches)
                    try:
                        again, seconds = self._half(half, problems, n, sampling_params, step)
                    finally:
                        del server.decode
                    cpu[half].append(seconds)
                    self.trajectories -= len(again)
                    self.extra += seconds
                    if _trajectories(again) != want:
                        mismatched.append(step)
            gen[step] = (statistics.median(cpu["on"]), statistics.median(cpu["off"]))
            return outs

        def _half(self, half, problems, n, sampling_params, step):
            """One rollout (not validation), with otel-rl switched off for the "off" half (both with
            --check): its outputs and the training thread's CPU time for it."""
            rt = _runtime.active
            if half == "off" or args.check:
                _runtime.uninstall()  # what the decorators and context managers read
            try:
                t0 = time.thread_time()
                outs = super().generate_sequences(problems, n, sampling_params, step, False)
                return outs, time.thread_time() - t0
            finally:
                _runtime.install(rt)

    trainer_mod.GRPOTrainer = Paired
    run_in_process(args.seed, args.steps, args.overrides, "bench_foreground_")
    if args.replay:
        report_replay(args, gen, steps, mismatched)
        return
    if mismatched:
        sys.exit(f"the two rollouts of steps {mismatched[:5]} differ: the comparison is void")
    on = sum(a for a, _ in gen.values()) / len(gen)
    off = sum(b for _, b in gen.values()) / len(gen)
    step_cpu = sum(steps.values()) / len(steps)
    ratios = [a / b for a, b in gen.values()]
    q = statistics.quantiles(ratios, n=4)
    label = "check: both halves off" if args.check else "telemetry fully on vs off"
    print(f"foreground cost: {len(gen)} training steps, each rollout run twice in one demo process ({label}); "
          f"same trajectories: yes")
    print(f"{'per step, mean (CPU time of the training thread)':<52}{'on':>10}{'off':>10}{'ratio':>9}")
    print(f"{'  gen (the rollout), ms':<52}{on * 1e3:>10.2f}{off * 1e3:>10.2f}{on / off:>9.4f}")
    print(f"{'  gen, per-step ratio: median (quartiles)':<52}{'':>20}{statistics.median(ratios):>9.4f}"
          f"  ({q[0]:.3f} / {q[2]:.3f})")
    print(f"{'  the training step (one rollout), ms':<52}{step_cpu * 1e3:>10.2f}")
    print(f"the instrumentation in gen on the training thread: {(on - off) * 1e3:+.2f} ms per step, "
          f"{(on - off) / step_cpu * 100:+.2f}% of a training step")
    if args.json:
        Path(args.json).write_text(json.dumps({"gen": gen, "steps": steps, "gen_ratio": on / off,
                                               "step_share": (on - off) / step_cpu}, indent=1))


def _trajectories(outs: list) -> list[tuple]:
    """What two rollouts must share to be the same: each trajectory's response and reward."""
    return [(o.response_ids, o.reward_score) for o in outs]


def _replay(batches: list) -> Any:
    """A stand-in for the rollout server's ``decode`` that returns `batches` in order (copies); a rollout
    that asks for more batches, or for one of another size, fails (every waiting agent loop sees it)."""
    it = iter(batches)

    def decode(prompts: list, params: list) -> list:
        out = next(it, None)
        if out is None or len(out) != len(prompts):
            raise RuntimeError("the replayed rollout asked for a decoding batch its recording does not have")
        return [list(x) for x in out]

    return decode


def report_replay(args: Any, gen: dict, steps: dict, mismatched: list) -> None:
    if mismatched:
        sys.exit(f"a replayed rollout of steps {sorted(set(mismatched))[:5]} differs from the rollout: "
                 "the comparison is void")
    on = statistics.median(a for a, _ in gen.values())
    off = statistics.median(b for _, b in gen.values())
    diffs = [a - b for a, b in gen.values()]
    q = statistics.quantiles(diffs, n=4)
    step_cpu = sum(steps.values()) / len(steps)
    label = "check: both halves off" if args.check else "telemetry fully on vs off"
    print(f"foreground cost, replayed: {len(gen)} training steps, each rollout replayed {args.replay} times each way "
          f"without the model ({label}); same trajectories: yes")
    print(f"{'per step, median (CPU time of the training thread)':<52}{'on':>10}{'off':>10}{'on-off':>9}")
    print(f"{'  gen replayed (agent loops + otel-rl, no model), ms':<52}{on * 1e3:>10.3f}{off * 1e3:>10.3f}"
          f"{(on - off) * 1e3:>9.3f}")
    print(f"{'  on-off per step, median (quartiles), ms':<52}{'':>20}{statistics.median(diffs) * 1e3:>9.3f}"
          f"  ({q[0] * 1e3:.3f} / {q[2] * 1e3:.3f})")
    print(f"{'  the training step (one rollout), ms':<52}{step_cpu * 1e3:>10.2f}")
    print(f"the instrumentation in gen on the training thread, replayed: {statistics.median(diffs) * 1e3:+.3f} ms per "
          f"step, {statistics.median(diffs) / step_cpu * 100:+.2f}% of a training step")
    if args.json:
        Path(args.json).write_text(json.dumps({"gen": gen, "steps": steps, "replay": args.replay}, indent=1))


if __name__ == "__main__":
    main()
