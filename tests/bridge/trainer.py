"""A trainer process for the bridge tests: an instrumented workload sent over OTLP.

    python trainer.py MODE ENDPOINT OUT.json --project P --experiment E --run-id R [--steps N]

MODE:
  http       otel-rl's `otlp` exporter, HTTP/protobuf (the SDK's OTLPSpanExporter / OTLPMetricExporter)
  grpc       otel-rl's `otlp` exporter, gRPC (the SDK's gRPC exporters)
  json       OTLP/HTTP JSON: bodies from the official JSON encoder (opentelemetry-exporter-otlp-json-common)
             when installed, else spec JSON built from the protobuf; gzip
  both       `otlp` (HTTP/protobuf) to the bridge AND mlflow+wandb+swanlab in this process (their stores
             come from this process's environment): one execution, two delivery paths

What the core recorded (a `CaptureExporter`) is written to OUT.json for the test to compare with.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import otel_rl  # noqa: E402
from otel_rl.exporters.base import Exporter  # noqa: E402
from otel_rl.records import Generations, RunStart, StepMetrics, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402

CONFIG = {
    "trainer": {"total_epochs": 2, "logger": ["mlflow", "wandb", "swanlab"], "nested": {"empty": {}, "lr": 1e-6}},
    "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16}},
    "data": {"files": ["a.parquet", "b.parquet"], "seed": None},
}


@otel_rl.op
def plan(question: str) -> dict:
    return {"question": question, "plan": ["think", "compute"]}


@otel_rl.generate(model="policy-7b")
def generate(prompt_ids: list, temperature: float = 1.0) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9], "text": "x = 4"}


@otel_rl.tool(name="calculator")
def calculator(expression: str, tool_call_id: str) -> float:
    if "/0" in expression:
        raise ZeroDivisionError(f"cannot evaluate {expression}")
    return 4.0


@otel_rl.op(kind="REWARD")
def score(answer: float) -> float:
    return 1.0 if answer == 4.0 else 0.0


def workload(steps: int, samples: int, step_pause_s: float = 0.0) -> None:
    for n in range(1, steps + 1):
        if n > 1 and step_pause_s:
            time.sleep(step_pause_s)
        with otel_rl.step(n):
            with otel_rl.timer("gen"):
                for i in range(samples):
                    with otel_rl.trajectory(sample_index=i, rollout_n=n % 2) as t:
                        plan(f"q{n}-{i}")
                        generate(list(range(5 + i)), temperature=0.5)
                        try:
                            answer = calculator("8/0" if (n, i) == (2, 0) else "2+2", tool_call_id=f"call-{n}-{i}")
                        except ZeroDivisionError:
                            answer = float("nan")
                        t.set_reward(score(answer))
            otel_rl.log({"actor/pg_loss": 0.5 / n, "critic/score/mean": float(n), "perf/tokens": 1000 * n,
                         "flag/done": n == steps, "val-core/acc@5": 0.25 * n, "nan/metric": math.nan,
                         "inf/pos": math.inf if n != 2 else 1.0, "int/big": 2**53 + n, "指标/损失": 0.1 * n}, step=n)
            otel_rl.log({"actor/entropy": 1.0 / n}, step=n)
        if n >= 2:
            otel_rl.log_generations([(f"prompt {n}-{j}", f"answer {n}-{j}", j / 2) for j in range(3)]
                                    + [("no score", "", None)], step=n)


# ----------------------------------------------------------------------------- OTLP/HTTP JSON


class _Post:
    def __init__(self, url: str):
        import requests

        self.url = url
        self.session = requests.Session()
        self.session.trust_env = False

    def __call__(self, body: bytes) -> None:
        r = self.session.post(self.url, data=gzip.compress(body), timeout=30,
                              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        if r.status_code != 200:
            raise ConnectionError(f"HTTP {r.status_code}: {r.text[:200]}")


def _encoders() -> tuple[Any, Any, str]:
    from helpers import official_json_encoder, spec_json

    enc = official_json_encoder()
    if enc is not None:
        return (lambda spans: enc[0](spans).to_json().encode()), (lambda data: enc[1](data).to_json().encode()), \
            "official"
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return (lambda spans: spec_json(encode_spans(spans))), (lambda data: spec_json(encode_metrics(data))), "spec"


class JsonOtlpExporter(Exporter):
    wants_spans = True
    wants_records = False

    def __init__(self, base: str):
        from opentelemetry.sdk.metrics.export import (MetricExporter, MetricExportResult,
                                                      PeriodicExportingMetricReader)

        self.name = "otlp-json"
        self.encode_spans, encode_metrics, self.encoder = _encoders()
        self.post_spans = _Post(base.rstrip("/") + "/v1/traces")
        post_metrics = _Post(base.rstrip("/") + "/v1/metrics")

        class _Metrics(MetricExporter):
            def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
                try:
                    post_metrics(encode_metrics(metrics_data))
                except Exception:
                    return MetricExportResult.FAILURE
                return MetricExportResult.SUCCESS

            def force_flush(self, timeout_millis: float = 10_000) -> bool:
                return True

            def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
                return None

        self._reader = PeriodicExportingMetricReader(_Metrics())

    def export_spans(self, spans: Any) -> None:
        self.post_spans(self.encode_spans(list(spans)))

    def metric_readers(self) -> list[Any]:
        return [self._reader]


# ----------------------------------------------------------------------------- capture output


def _value(v: Any) -> Any:
    if isinstance(v, bool):
        return {"b": v}
    if isinstance(v, int):
        return {"i": str(v)}
    return {"f": repr(float(v))}


def _capture(cap: CaptureExporter) -> dict[str, Any]:
    out: dict[str, Any] = {"metrics": [], "generations": [], "trajectories": [], "config": None}
    for r in cap.records:
        if isinstance(r, StepMetrics):
            out["metrics"].append([r.step, [[k, _value(v)] for k, v in r.values.items()], r.time_ns])
        elif isinstance(r, Generations):
            out["generations"].append([r.step, [[i, o, repr(s)] for i, o, s in r.rows]])
        elif isinstance(r, RunStart):
            out["config"] = r.config
        elif isinstance(r, Trajectory):
            out["trajectories"].append({
                "trace_id": f"{r.trace_id:032x}", "step": r.step, "sample_index": r.sample_index, "name": r.name,
                "status": r.status, "complete": r.complete,
                "spans": [[f"{n.span_id:016x}", f"{n.parent_id:016x}" if n.parent_id else None, n.name, n.start_ns,
                           n.end_ns, n.status] for n in r.root.walk()],
            })
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["http", "grpc", "json", "both"])
    p.add_argument("endpoint")
    p.add_argument("out")
    p.add_argument("--project", required=True)
    p.add_argument("--experiment", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--step-pause", type=float, default=0.0, help="seconds between steps (a run that lasts)")
    a = p.parse_args()
    cap = CaptureExporter()
    kw: dict[str, Any] = dict(project=a.project, experiment=a.experiment, run_id=a.run_id, batch_delay_s=0.05,
                              tracing=True)
    encoder = "protobuf"
    if a.mode in ("http", "both"):
        names: list[Any] = ["otlp"] + (["mlflow", "wandb", "swanlab"] if a.mode == "both" else [])
        h = otel_rl.init(CONFIG, exporters=names + [cap], otlp_protocol="http/protobuf", otlp_endpoint=a.endpoint,
                         trace_backend="mlflow" if a.mode == "both" else None, **kw)
    elif a.mode == "grpc":
        h = otel_rl.init(CONFIG, exporters=["otlp", cap], otlp_protocol="grpc", otlp_endpoint=a.endpoint, **kw)
    else:
        js = JsonOtlpExporter(a.endpoint)
        encoder = js.encoder
        h = otel_rl.init(CONFIG, exporters=[js, cap], **kw)
    cap.handle = h
    workload(a.steps, a.samples, a.step_pause)
    assert h.flush(120), "flush timed out"
    stats = h.stats()
    h.shutdown(120)
    for name, st in stats["exporters"].items():
        if st["dropped"] or st["queued"]:
            print(f"trainer: exporter {name} did not deliver everything: {st}", file=sys.stderr)
            return 3
    out = _capture(cap)
    out.update(run_id=h.run_id, encoder=encoder, stats=stats)
    Path(a.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
