"""A small instrumented trainer for the global-OpenTelemetry tests, run as a subprocess.

    python trainer.py MODE OUT_JSON

MODE: ``plain`` (whatever global provider the process has: opentelemetry-instrument's, or none),
``sdk`` (the script sets a global SDK TracerProvider and MeterProvider of its own before init, with
in-memory exporters, and writes what they got to OUT_JSON), ``private`` (the same with
feed_global_provider=false), ``logfire`` (logfire.configure() with its test exporter).
"""

from __future__ import annotations

import json
import math
import sys

MODE, OUT = sys.argv[1], sys.argv[2]
STEPS = 3
SAMPLES = 2

span_mem = metric_reader = logfire_exporter = None
if MODE in ("sdk", "private"):
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    span_mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_mem))
    trace.set_tracer_provider(provider)
    metric_reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[metric_reader]))
elif MODE == "logfire":
    import logfire
    from logfire.testing import SimpleSpanProcessor, TestExporter

    logfire_exporter = TestExporter()
    logfire.configure(send_to_logfire=False, console=False, metrics=False,
                      additional_span_processors=[SimpleSpanProcessor(logfire_exporter)])

import otel_rl  # noqa: E402


@otel_rl.tool(name="calculator")
def calculator(expression: str) -> int:
    return eval(expression, {"__builtins__": {}})  # a toy tool on fixed input


@otel_rl.op
def policy(prompt: str) -> str:
    return prompt + "=" + str(calculator(prompt))


def values(n: int) -> dict:
    return {"actor/loss": 1.0 / n, "critic/score/mean": n * 0.25, "count": n, "nan": math.nan, "inf": -math.inf}


h = otel_rl.init(exporters=[], project="glob", experiment="exp", run_id="glob-run",
                 feed_global_provider=MODE != "private", batch_delay_s=0.05)
for n in range(1, STEPS + 1):
    with otel_rl.step(n):
        with otel_rl.timer("gen"):
            for i in range(SAMPLES):
                with otel_rl.trajectory(sample_index=i, rollout_n=0) as t:
                    policy(f"{n}+{i}")
                    t.set_reward(float(n + i))
        otel_rl.log(values(n), step=n)
h.shutdown()


def spans_out(spans) -> list:
    out = []
    for s in spans:
        attrs = {}
        for k, v in (s.attributes or {}).items():
            attrs[k] = list(v) if isinstance(v, tuple) else v
        out.append({"name": s.name, "attributes": attrs,
                    "resource": dict(s.resource.attributes) if s.resource is not None else {}})
    return out


report: dict = {}
if span_mem is not None:
    report["spans"] = spans_out(span_mem.get_finished_spans())
    data = metric_reader.get_metrics_data()
    gauges: dict = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    gauges[m.name] = getattr(p, "value", None)
    report["metrics"] = gauges
if logfire_exporter is not None:
    report["spans"] = spans_out(logfire_exporter.exported_spans)
with open(OUT, "w") as f:
    json.dump(report, f, default=str)
