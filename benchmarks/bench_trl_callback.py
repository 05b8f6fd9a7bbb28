"""Training-thread time of otel-rl's `OtelRLCallback` against transformers' own `MLflowCallback` and
`WandbCallback`, all three on the same GRPO run.

    .venv/bin/python benchmarks/bench_trl_callback.py              # 3 runs x 30 steps (a few minutes)
    .venv/bin/python benchmarks/bench_trl_callback.py --quick      # 1 run x 8 steps (smoke)
    .venv/bin/python benchmarks/bench_trl_callback.py --json out.json

One TRL `GRPOTrainer` (the tests' tiny Llama on CPU, 4 completions a step, ``logging_steps=1``) gets the
three callbacks at once, each behind a shim that adds up the time spent in its event methods; the
trainer calls them for the same events of the same steps, so the ratios come from one run. Each run
rotates the callbacks' order.  Per step: the events of the training loop (``on_step_begin``,
``on_step_end``, ``on_log``, ...), ``on_train_begin`` / ``on_train_end`` (opening and closing the
trackers' runs) apart.  otel-rl exports to the same two trackers (MLflow sqlite, wandb offline), its
exporters in the export process (``--export-process``), and traces every completion through
`trace_rewards`: the wrappers' own time (a wrapped call minus the reward function's) is its "reward
tracing" figure, which the HF callbacks have no counterpart for.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, HERE, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

LOOP_EVENTS = (
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_prediction_step",
    "on_save",
    "on_epoch_begin",
    "on_epoch_end",
)
EDGE_EVENTS = ("on_init_end", "on_train_begin", "on_train_end")


def offline_env(tmp: str) -> None:
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_WEAVE": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DIR": os.path.join(tmp, "wandb"),
        "WANDB_CACHE_DIR": os.path.join(tmp, "wandb", "cache"),
        "WANDB_CONFIG_DIR": os.path.join(tmp, "wandb", "cfg"),
        "WANDB_PROJECT": "bench-trl",
        "MLFLOW_TRACKING_URI": "sqlite:///" + os.path.join(tmp, "mlflow.db"),
        "MLFLOW_EXPERIMENT_NAME": "bench-trl-hf",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "MLFLOW_LOGGING_LEVEL": "WARNING",
    }
    os.environ.update(env)
    for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        os.makedirs(os.environ[k], exist_ok=True)
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            del os.environ[k]


def timed(inner: Any, name: str) -> Any:
    """A TrainerCallback that calls `inner` and adds up the seconds each of its events took."""
    from transformers import TrainerCallback

    class Timed(TrainerCallback):
        def __init__(self) -> None:
            self.name = name
            self.seconds: dict[str, float] = {}
            self.calls: dict[str, int] = {}

    def make(event: str) -> Any:
        target = getattr(inner, event)

        def method(self: Any, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return target(args, state, control, **kwargs)
            finally:
                self.seconds[event] = self.seconds.get(event, 0.0) + time.perf_counter() - t0
                self.calls[event] = self.calls.get(event, 0) + 1

        return method

    for event in LOOP_EVENTS + EDGE_EVENTS:
        setattr(Timed, event, make(event))
    return Timed()


class RewardClock:
    """Seconds inside the reward functions themselves and inside their traced wrappers."""

    def __init__(self) -> None:
        self.inner = 0.0
        self.outer = 0.0

    def inner_fn(self, fn: Any) -> Any:
        def f(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inner += time.perf_counter() - t0

        f.__name__ = fn.__name__
        return f

    def outer_fn(self, fn: Any) -> Any:
        def f(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.outer += time.perf_counter() - t0

        f.__name__ = fn.__name__
        return f


def count_a(completions: list, **kwargs: Any) -> list[float]:
    return [float(c.count("a")) for c in completions]


def length_bonus(completions: list, **kwargs: Any) -> list[float]:
    return [len(c) / 10 for c in completions]


def one_run(tmp: str, run: int, steps: int, order: list[str], export_process: str) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from transformers.integrations import MLflowCallback, WandbCallback

    import otel_rl
    from integrations import tiny_lm
    from otel_rl.integrations.transformers import OtelRLCallback, trace_rewards

    clock = RewardClock()
    traced = trace_rewards([clock.inner_fn(count_a), clock.inner_fn(length_bonus)])
    reward_funcs = [clock.outer_fn(f) for f in traced]
    made = {
        "otel-rl": OtelRLCallback(
            project="bench-trl",
            experiment=f"otel-rl-{run}",
            exporters=["mlflow", "wandb"],
            trace_backend="mlflow",
            export_process=export_process,
        ),
        "hf-mlflow": MLflowCallback(),
        "hf-wandb": WandbCallback(),
    }
    shims = {k: timed(v, k) for k, v in made.items()}
    tok = tiny_lm.tokenizer()
    args = trl.GRPOConfig(
        output_dir=os.path.join(tmp, f"run{run}"),
        run_name=f"hf-{run}",
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=run,
    )
    trainer = trl.GRPOTrainer(
        model=tiny_lm.model(tok, seed=run),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": tiny_lm.prompts(64)}),
        processing_class=tok,
        callbacks=[shims[k] for k in order],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    otel_rl.shutdown()
    n = trainer.state.global_step
    edges = sum(s.seconds.get(e, 0.0) for s in shims.values() for e in EDGE_EVENTS)
    out: dict[str, Any] = {
        "run": run,
        "order": order,
        "steps": n,
        "step_ms": (wall - edges) / n * 1e3,
        "keys_per_log": statistics.mean(len(e) - 1 for e in trainer.state.log_history),
    }
    for k, s in shims.items():
        loop = sum(v for e, v in s.seconds.items() if e in LOOP_EVENTS)
        out[k] = {
            "loop_ms_per_step": loop / n * 1e3,
            "train_begin_ms": s.seconds.get("on_train_begin", 0.0) * 1e3,
            "train_end_ms": s.seconds.get("on_train_end", 0.0) * 1e3,
            "by_event_ms_per_step": {e: v / n * 1e3 for e, v in sorted(s.seconds.items()) if e in LOOP_EVENTS},
        }
    out["otel-rl reward tracing"] = {"loop_ms_per_step": (clock.outer - clock.inner) / n * 1e3}
    return out


def report(runs: list[dict[str, Any]]) -> str:
    lines = []
    names = ["otel-rl", "hf-mlflow", "hf-wandb"]
    lines.append(
        "| run | order | step (ms) | otel-rl (ms/step) | HF MLflow (ms/step) | HF wandb (ms/step) | "
        "otel-rl / HF MLflow | otel-rl / HF wandb | otel-rl reward tracing (ms/step) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        o, m, w = (r[k]["loop_ms_per_step"] for k in names)
        lines.append(
            f"| {r['run']} | {' > '.join(r['order'])} | {r['step_ms']:.1f} | {o:.3f} | {m:.3f} | {w:.3f} | "
            f"{o / m:.2f} | {o / w:.2f} | {r['otel-rl reward tracing']['loop_ms_per_step']:.3f} |"
        )
    med = {k: statistics.median(r[k]["loop_ms_per_step"] for r in runs) for k in names}
    rm = statistics.median(r["otel-rl"]["loop_ms_per_step"] / r["hf-mlflow"]["loop_ms_per_step"] for r in runs)
    rw = statistics.median(r["otel-rl"]["loop_ms_per_step"] / r["hf-wandb"]["loop_ms_per_step"] for r in runs)
    lines.append(
        f"| median | | {statistics.median(r['step_ms'] for r in runs):.1f} | {med['otel-rl']:.3f} | "
        f"{med['hf-mlflow']:.3f} | {med['hf-wandb']:.3f} | {rm:.2f} | {rw:.2f} | "
        f"{statistics.median(r['otel-rl reward tracing']['loop_ms_per_step'] for r in runs):.3f} |"
    )
    lines.append("")

    def with_tracing(r: dict[str, Any], hf: str) -> float:
        own = r["otel-rl"]["loop_ms_per_step"] + r["otel-rl reward tracing"]["loop_ms_per_step"]
        return own / r[hf]["loop_ms_per_step"]

    lines.append(
        "otel-rl with its reward tracing counted in (median of the runs' ratios): "
        f"{statistics.median(with_tracing(r, 'hf-mlflow') for r in runs):.2f} of HF MLflow, "
        f"{statistics.median(with_tracing(r, 'hf-wandb') for r in runs):.2f} of HF wandb"
    )
    lines.append("")
    lines.append(
        "| run | otel-rl train begin / end (ms) | HF MLflow train begin / end (ms) | HF wandb train begin / end (ms) |"
    )
    lines.append("|---|---|---|---|")
    for r in runs:
        cells = [f"{r[k]['train_begin_ms']:.0f} / {r[k]['train_end_ms']:.0f}" for k in names]
        lines.append(f"| {r['run']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Per event (ms per step, median over runs):")
    lines.append("")
    for k in names:
        events = sorted({e for r in runs for e in r[k]["by_event_ms_per_step"]})
        cells = [f"{e} {statistics.median(r[k]['by_event_ms_per_step'].get(e, 0.0) for r in runs):.3f}" for e in events]
        lines.append(f"- {k}: " + ", ".join(cells))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 run of 8 steps")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--export-process", default="true", choices=["true", "false", "auto"])
    ap.add_argument("--json", help="also write every figure to this file")
    a = ap.parse_args()
    runs_n, steps = (1, 8) if a.quick else (a.runs, a.steps)
    tmp = tempfile.mkdtemp(prefix="bench-trl-")
    offline_env(tmp)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    names = ["otel-rl", "hf-mlflow", "hf-wandb"]
    runs = []
    for i in range(runs_n):
        order = names[i % 3 :] + names[: i % 3]
        runs.append(one_run(tmp, i, steps, order, a.export_process))
        print(f"run {i}: {json.dumps({k: v for k, v in runs[-1].items() if k in ('steps', 'step_ms')})}", flush=True)
    import transformers
    import trl

    import otel_rl

    print(
        f"\n{platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}, otel-rl {otel_rl.__version__}, "
        f"export_process={a.export_process}, {steps} steps x {runs_n} runs"
    )
    print(report(runs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
