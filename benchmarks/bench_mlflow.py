"""Throughput of the MLflow exporter on a sqlite store, beside MLflow's own ways, in one run.

    .venv/bin/python benchmarks/bench_mlflow.py            # ~2-3 min
    .venv/bin/python benchmarks/bench_mlflow.py --quick    # smoke run, noisier

Metric values/s (100 verl-named keys per step):
  ours        MlflowExporter.export_records(StepMetrics of 50 steps), as the delivery thread
              calls it: key mapping, Inf flagging, log_batch of up to 1000 points across steps
  ours e2e    otel_rl.init(exporters=["mlflow"]) + otel_rl.log() per step, then flush():
              the whole pipeline (log spans -> records -> exporter), sustained
  verl        mlflow.log_metrics(dict, step=n) per step on the fluent active run (verl's
              _MlflowLoggingAdapter)
  limit       MlflowClient.log_batch of 1000 prebuilt Metric objects (MLflow's per-request
              maximum): the store's limit
  ours, a step per call   export_records([StepMetrics]) once per step, as in a run that delivers
              every step on its own: on sqlite the direct metric writer (otel_rl_mlflow.direct.metrics)
  ours, MLflow path, a step per call   the same with OTEL_RL_MLFLOW_BULK_METRICS=false: log_batch
Traces/s (4-span trajectories: AGENT root, CHAIN, LLM with token usage, TOOL; 5 trace tags):
  ours        MlflowExporter.export_records(Trajectory records): build MLflow spans; on sqlite the
              direct writer (otel_rl_mlflow.direct.traces: the rows log_spans + link_traces_to_run
              write, verified against them for the first trajectory of each shape)
  ours, MLflow path   the same with OTEL_RL_MLFLOW_BULK_TRACES=false: log_spans of up to 100
              traces per call, link_traces_to_run
  verl        mlflow.start_span per op (verl's mlflow trace backend), tags via
              update_current_trace, async export drained with flush_trace_async_logging()
  batched     TracingClient.log_spans of prebuilt MLflow spans, 100 traces per call, no
              run link: the fastest batched span logging the store offers

The variants run in rounds on one database; each round runs every variant once, in an order
rotated round by round, so load drift on a shared machine hits all of them alike.  A rate is
total units / total seconds over the rounds (min / median / max of the rounds beside it);
ratio = ours / other, also as the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import logging  # noqa: E402

logging.getLogger("mlflow").setLevel(logging.WARNING)
logging.getLogger("alembic").setLevel(logging.WARNING)

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric  # noqa: E402
from mlflow.tracing.client import TracingClient  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, StepMetrics, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402
from otel_rl_mlflow import MlflowExporter, verl_sanitize  # noqa: E402
from otel_rl_mlflow.direct import metrics as direct_metrics  # noqa: E402
from otel_rl_mlflow._traces import SpanBuilder  # noqa: E402


def verl_keys(n: int = 100) -> list[str]:
    groups = ["actor", "critic", "critic/score", "critic/rewards", "response_length", "timing_s", "perf",
              "val-core/openai/gsm8k/reward", "val-aux/openai/gsm8k/acc", "global_seqlen"]
    return [f"{groups[i % len(groups)]}/m{i}" for i in range(n)]


class Result:
    """Units and seconds of each round of one variant."""

    def __init__(self, name: str, unit: str):
        self.name = name
        self.unit = unit
        self.units: list[int] = []
        self.secs: list[float] = []

    def add(self, units: int, secs: float) -> None:
        self.units.append(units)
        self.secs.append(secs)

    @property
    def rate(self) -> float:
        return sum(self.units) / sum(self.secs)

    def round_rates(self) -> list[float]:
        return [u / s for u, s in zip(self.units, self.secs)]


def rounds(variants: list[tuple[Result, Callable[[int], tuple[int, float]]]], n_rounds: int) -> None:
    """Round r runs every variant once, in an order rotated by r (load drift hits all alike)."""
    for r in range(n_rounds):
        k = r % len(variants)
        for res, fn in variants[k:] + variants[:k]:
            res.add(*fn(r))


# ----------------------------------------------------------------------------- metrics


def bench_metrics(uri: str, n_rounds: int, steps: int, keys: list[str]) -> list[Result]:
    """Per round: `steps` steps x len(keys) values for ours, e2e and limit; steps/5 for verl's per-step calls."""
    client = MlflowClient(uri)
    exp_id = client.create_experiment("bench-metrics")
    ours, e2e, verl, limit = (Result("ours (exporter)", "values/s"), Result("ours e2e (log()+flush)", "values/s"),
                              Result("verl: mlflow.log_metrics per step", "values/s"),
                              Result("limit: log_batch x1000", "values/s"))
    per_step, per_step_mlflow = (Result("ours, a step per call", "values/s"),
                                 Result("ours, MLflow path, a step per call", "values/s"))
    clean = [verl_sanitize(k) for k in keys]
    cfg = resolve(project="bench-metrics", experiment="ours")
    exporter = MlflowExporter(cfg, tracking_uri=uri)
    ident = RunIdentity("bench-metrics", cfg.experiment, cfg.run_id)
    exporter.export_records([RunStart(ident, {}, 0, time.time_ns())])  # open the run outside the timing
    step_exporters = {}
    for name, env in (("direct", "true"), ("mlflow", "false")):  # the writer is chosen at the first metrics
        os.environ[direct_metrics.ENV_BULK_METRICS] = env
        cfg_s = resolve(project="bench-metrics", experiment=f"per-step-{name}")
        ex = MlflowExporter(cfg_s, tracking_uri=uri)
        ident_s = RunIdentity("bench-metrics", cfg_s.experiment, cfg_s.run_id)
        ex.export_records([RunStart(ident_s, {}, 0, time.time_ns()), StepMetrics(ident_s, 0, {"warm": 1.0}, 1)])
        step_exporters[name] = (ex, ident_s)
    os.environ.pop(direct_metrics.ENV_BULK_METRICS)
    h = otel_rl.init(project="bench-metrics", experiment="e2e", exporters=["mlflow"], batch_delay_s=0.05)
    h.flush(60)
    limit_run = client.create_run(exp_id, run_name="limit").info.run_id
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=exp_id)
    mlflow.start_run(run_name="verl")

    def run_ours(r: int) -> tuple[int, float]:
        now = time.time_ns()
        batch = [StepMetrics(ident, r * steps + s, {k: float(s + i) for i, k in enumerate(keys)}, now + s)
                 for s in range(steps)]
        t0 = time.perf_counter()
        exporter.export_records(batch)  # what the delivery thread does with one batch
        return steps * len(keys), time.perf_counter() - t0

    def per_step_run(name: str, r: int) -> tuple[int, float]:
        ex, ident_s = step_exporters[name]
        now = time.time_ns()
        batches = [[StepMetrics(ident_s, 1 + r * steps + s, {k: float(s + i) for i, k in enumerate(keys)}, now + s)]
                   for s in range(steps)]
        t0 = time.perf_counter()
        for b in batches:
            ex.export_records(b)
        return steps * len(keys), time.perf_counter() - t0

    def run_e2e(r: int) -> tuple[int, float]:
        values = [{k: float(s + i) for i, k in enumerate(keys)} for s in range(steps)]
        t0 = time.perf_counter()
        for s, v in enumerate(values):
            otel_rl.log(v, step=r * steps + s)
        assert h.flush(600)
        return steps * len(keys), time.perf_counter() - t0

    def run_verl(r: int) -> tuple[int, float]:
        n = max(2, steps // 5)
        values = [{k: float(s + i) for i, k in enumerate(clean)} for s in range(n)]
        t0 = time.perf_counter()
        for s, v in enumerate(values):
            mlflow.log_metrics(v, step=r * n + s)
        return n * len(keys), time.perf_counter() - t0

    def run_limit(r: int) -> tuple[int, float]:
        now = int(time.time() * 1000)
        total = steps * len(keys)
        chunks = [[Metric(clean[j % len(clean)], float(j), now, r * steps + j // len(clean))
                   for j in range(i, min(i + 1000, total))] for i in range(0, total, 1000)]
        t0 = time.perf_counter()
        for c in chunks:
            client.log_batch(limit_run, metrics=c)
        return total, time.perf_counter() - t0

    try:
        rounds([(ours, run_ours), (e2e, run_e2e), (verl, run_verl), (limit, run_limit),
                (per_step, lambda r: per_step_run("direct", r)),
                (per_step_mlflow, lambda r: per_step_run("mlflow", r))], n_rounds)
        assert step_exporters["direct"][0]._bulk_metrics and not step_exporters["mlflow"][0]._bulk_metrics
    finally:
        mlflow.end_run()
        h.shutdown()
        exporter.shutdown()
        for ex, _ in step_exporters.values():
            ex.shutdown()
    return [ours, e2e, verl, limit, per_step, per_step_mlflow]


# ----------------------------------------------------------------------------- traces


@otel_rl.op
def plan(question: str) -> dict:
    return {"question": question, "steps": ["read", "compute"]}


@otel_rl.generate(model="policy")
def generate(prompt_ids: list) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9, 10], "text": "the answer is 4"}


@otel_rl.tool(name="calculator")
def calculator(expression: str, tool_call_id: str) -> float:
    return 4.0


def make_trajectories(n: int, ident: RunIdentity) -> list[Trajectory]:
    cap = CaptureExporter()
    h = otel_rl.init(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, exporters=[cap],
                     tracing=True, batch_delay_s=0.05)
    for i in range(n):
        with otel_rl.trajectory(step=i // 16, sample_index=i % 16, rollout_n=0):
            plan(f"question {i}")
            generate(list(range(32)))
            calculator("2+2", tool_call_id=f"c{i}")
    h.flush(120)
    h.shutdown()
    out = cap.of_type(Trajectory)
    assert len(out) == n and all(sum(1 for _ in t.root.walk()) == 4 for t in out)
    return out


def bench_traces(uri: str, n_rounds: int, per_round: int) -> list[Result]:
    """Per round: `per_round` trajectories for ours and batched, per_round/10 for verl's span-per-op."""
    client = MlflowClient(uri)
    tracing = TracingClient(uri)
    exp_id = client.create_experiment("bench-traces")
    ours = Result("ours (exporter)", "traces/s")
    slow = Result("ours, MLflow path", "traces/s")
    verl = Result("verl: mlflow.start_span per op", "traces/s")
    batched = Result("batched: log_spans x100, prebuilt", "traces/s")
    cfg = resolve(project="bench-traces", experiment="ours", trace_backend="mlflow")
    ident = RunIdentity("bench-traces", cfg.experiment, cfg.run_id)
    exporter = MlflowExporter(cfg, tracking_uri=uri)
    exporter.export_records([RunStart(ident, {}, 0, time.time_ns())])
    cfg2 = resolve(project="bench-traces", experiment="mlflow-path", trace_backend="mlflow")
    ident2 = RunIdentity("bench-traces", cfg2.experiment, cfg2.run_id)
    mlflow_path = MlflowExporter(cfg2, tracking_uri=uri)
    mlflow_path._bulk = False  # as with OTEL_RL_MLFLOW_BULK_TRACES=false: log_spans + link_traces_to_run
    mlflow_path.export_records([RunStart(ident2, {}, 0, time.time_ns())])
    trajs = make_trajectories(per_round * n_rounds * 3, ident)
    trajs2 = [dataclasses.replace(t, run=ident2) for t in trajs]
    builder = SpanBuilder()
    n_verl = max(5, per_round // 10)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=exp_id)
    mlflow.start_run(run_name="verl")

    def run_ours(r: int) -> tuple[int, float]:
        mine = trajs[3 * r * per_round:(3 * r + 1) * per_round]
        t0 = time.perf_counter()
        exporter.export_records(mine)
        return len(mine), time.perf_counter() - t0

    def run_slow(r: int) -> tuple[int, float]:
        mine = trajs2[(3 * r + 1) * per_round:(3 * r + 2) * per_round]
        t0 = time.perf_counter()
        mlflow_path.export_records(mine)
        return len(mine), time.perf_counter() - t0

    def run_batched(r: int) -> tuple[int, float]:
        mine = trajs[(3 * r + 2) * per_round:(3 * r + 3) * per_round]
        secs = 0.0
        for i in range(0, len(mine), 100):
            spans = [s for t in mine[i:i + 100] for s in builder.mlflow_spans(t)]  # built outside the timing
            t0 = time.perf_counter()
            tracing.log_spans(exp_id, spans)
            secs += time.perf_counter() - t0
        return len(mine), secs

    def run_verl(r: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        for j in range(n_verl):
            i = r * n_verl + j
            with mlflow.start_span("agent_loop", span_type="AGENT") as root:
                root.set_inputs({"sample_index": i})
                mlflow.update_current_trace(tags={"step": str(i // 16), "sample_index": str(i % 16),
                                                  "rollout_n": "0", "validate": "False",
                                                  "experiment_name": "verl"})
                with mlflow.start_span("plan", span_type="CHAIN") as s:
                    s.set_inputs({"question": f"question {i}"})
                    s.set_outputs({"question": f"question {i}", "steps": ["read", "compute"]})
                with mlflow.start_span("chat policy", span_type="LLM") as s:
                    s.set_inputs({"prompt_ids": list(range(32))})
                    s.set_outputs({"prompt_ids": list(range(32)), "response_ids": [7, 8, 9, 10],
                                   "text": "the answer is 4"})
                    s.set_attribute("mlflow.chat.tokenUsage",
                                    {"input_tokens": 32, "output_tokens": 4, "total_tokens": 36})
                with mlflow.start_span("execute_tool calculator", span_type="TOOL") as s:
                    s.set_inputs({"expression": "2+2", "tool_call_id": f"c{i}"})
                    s.set_outputs(4.0)
        mlflow.flush_trace_async_logging()
        return n_verl, time.perf_counter() - t0

    try:
        rounds([(ours, run_ours), (slow, run_slow), (verl, run_verl), (batched, run_batched)], n_rounds)
    finally:
        mlflow.end_run()
        exporter.shutdown()
        mlflow_path.shutdown()
    return [ours, slow, verl, batched]


# ----------------------------------------------------------------------------- report


def report(title: str, results: list[Result], refs: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    width = max(len(r.name) for r in results)
    for r in results:
        rr = r.round_rates()
        print(f"  {r.name:<{width}}  {r.rate:>10,.0f} {r.unit}   (rounds: min {min(rr):,.0f}, "
              f"median {statistics.median(rr):,.0f}, max {max(rr):,.0f})")
    by = {r.name: r for r in results}
    for a, b in refs:
        paired = [x / y for x, y in zip(by[a].round_rates(), by[b].round_rates())]
        print(f"  ratio {a} / {b}: {by[a].rate / by[b].rate:.2f}  (median of per-round ratios "
              f"{statistics.median(paired):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_rounds, steps, per_round = (4, 20, 100) if args.quick else (12, 50, 100)
    tmp = tempfile.mkdtemp(prefix="bench-mlflow-")
    os.chdir(tmp)  # artifacts of the sqlite store go to ./mlruns
    uri = f"sqlite:///{tmp}/bench.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    print(f"bench_mlflow: mlflow {mlflow.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, store {uri}")
    print(f"{n_rounds} rounds; a round: metrics {steps} steps x 100 keys (verl: {max(2, steps // 5)} steps), "
          f"traces {per_round} x 4 spans (verl: {max(5, per_round // 10)})")
    MlflowClient(uri).search_experiments()  # create the database (migrations) outside the timings
    try:
        m = bench_metrics(uri, n_rounds, steps, verl_keys())
        report("metric values/s (sqlite)", m,
               [("ours (exporter)", "limit: log_batch x1000"), ("ours (exporter)", "verl: mlflow.log_metrics per step"),
                ("ours e2e (log()+flush)", "limit: log_batch x1000"),
                ("ours, a step per call", "ours, MLflow path, a step per call")])
        t = bench_traces(uri, n_rounds, per_round)
        report("traces/s, 4-span trajectories (sqlite)", t,
               [("ours (exporter)", "batched: log_spans x100, prebuilt"),
                ("ours (exporter)", "ours, MLflow path"),
                ("ours, MLflow path", "batched: log_spans x100, prebuilt"),
                ("ours (exporter)", "verl: mlflow.start_span per op")])
    finally:
        os.chdir("/")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
