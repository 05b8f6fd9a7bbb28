"""Spans whose rl.* attributes have the wrong type or shape, sent to a real `otel-rl bridge` process in
the same requests and the same pipeline batch as other senders' good spans: each is refused alone
(partial_success, counted per reason, one warning per reason), and every good span reaches MLflow.

The senders are the official OTLP exporters (HTTP/protobuf and gRPC); the store is read back after
the bridge stopped.
"""

from __future__ import annotations

import http.client
import time
import urllib.request
import uuid
from typing import Any

import pytest

mlflow = pytest.importorskip("mlflow")
otel_rl_mlflow = pytest.importorskip("otel_rl_mlflow")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,  # noqa: E402
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,  # noqa: E402
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,  # noqa: E402
)
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402
from opentelemetry.trace import SpanContext, TraceFlags  # noqa: E402

from otel_rl import semconv as sc  # noqa: E402

from .helpers import BridgeProcess, clean_env, log_spans, tracker_env  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = range(20)
_ids = iter(range(1 << 40, 1 << 41))


def _resource(project: str, run_id: Any = "poison") -> Resource:
    return Resource({sc.RL_PROJECT_NAME: project, sc.RL_EXPERIMENT_NAME: "e", sc.RL_RUN_ID: run_id})


def _span(name: str, attrs: dict, resource: Resource, trace_id: int | None = None, parent: int | None = None):
    tid = trace_id or next(_ids) << 64 | 7
    now = time.time_ns()
    return ReadableSpan(name, context=SpanContext(tid, next(_ids), False, TraceFlags(1)), resource=resource,
                        parent=SpanContext(tid, parent, False, TraceFlags(1)) if parent else None,
                        attributes=attrs, start_time=now, end_time=now + 1000)


def _log_attrs(step, keys=("loss", "n"), values=(0.5, 3.0), **extra) -> dict:
    return {sc.RL_STEP: step, sc.RL_SPAN_KIND: sc.KIND_METRICS, sc.RL_METRICS_KEYS: keys,
            sc.RL_METRICS_VALUES: values, **extra}


def trajectory(project: str, run_id: str, step: int, tokens=12, sample_index=0) -> list[ReadableSpan]:
    """A root AGENT span and one LLM child, as `trajectory()` + `generate()` make them."""
    res = _resource(project, run_id)
    tid = next(_ids) << 64 | 9
    root_id = next(_ids)
    llm = _span("chat policy", {sc.RL_SPAN_KIND: sc.KIND_LLM, sc.GEN_AI_USAGE_INPUT_TOKENS: tokens,
                                sc.GEN_AI_USAGE_OUTPUT_TOKENS: 3}, res, tid, root_id)
    now = time.time_ns()
    root = ReadableSpan(sc.SPAN_TRAJECTORY, context=SpanContext(tid, root_id, False, TraceFlags(1)), resource=res,
                        attributes={sc.RL_SPAN_KIND: sc.KIND_AGENT, sc.RL_STEP: step, sc.RL_SAMPLE_INDEX: sample_index,
                                    sc.RL_ROLLOUT_N: 0, sc.RL_VALIDATE: False},
                        start_time=now - 10_000, end_time=now + 10_000)
    return [llm, root]


def poison(project: str) -> dict[str, list[ReadableSpan]]:
    """One bad span (or span tree) per reason it is refused for."""
    res = _resource(project)
    return {
        "rl.step must be an integer": [_span(sc.SPAN_LOG, _log_attrs("seven"), res)],
        "rl.metrics.keys and rl.metrics.values differ in length": [
            _span(sc.SPAN_LOG, _log_attrs(1, keys=("a", "b", "c"), values=(1.0, 2.0)), res)],
        "rl.metrics.values must hold numbers": [_span(sc.SPAN_LOG, _log_attrs(2, values=(1.0, "x")), res)],
        "rl.metrics.int_values must hold integers": [
            _span(sc.SPAN_LOG, _log_attrs(3, **{sc.RL_METRICS_INT_KEYS: ("n",), sc.RL_METRICS_INT_VALUES: (1.5,)}),
                  res)],
        "rl.generations.inputs, outputs and scores differ in length": [
            _span(sc.SPAN_GENERATIONS, {sc.RL_STEP: 1, sc.RL_GENERATIONS_INPUTS: ("q1", "q2"),
                                        sc.RL_GENERATIONS_OUTPUTS: ("a1", "a2"), sc.RL_GENERATIONS_SCORES: (1.0,)},
                  res)],
        "rl.sample_index must be an integer": trajectory(project, "poison", 1, sample_index="first")[1:],
        "gen_ai.usage.input_tokens must be an integer": trajectory(project, "poison", 1, tokens="many")[:1],
        "rl.run.config must be a JSON object": [_span(sc.SPAN_RUN, {sc.RL_RUN_CONFIG: "[1, 2]"}, res)],
        "resource attribute rl.run.id must be a string": [
            _span(sc.SPAN_LOG, _log_attrs(4), _resource(project, run_id=5))],
    }


def _post(addr: str, body: bytes) -> tuple[int, bytes]:
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _mlflow_runs(uri: str, project: str) -> dict[str, dict]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    mlflow.set_tracking_uri(uri)  # search_traces reads the current tracking URI
    exp = client.get_experiment_by_name(project)
    assert exp is not None, f"no experiment {project}"
    out = {}
    for run in client.search_runs([exp.experiment_id]):
        rid = run.data.tags[otel_rl_mlflow.RUN_ID_TAG]
        hist = client.get_metric_history(run.info.run_id, "loss")
        traces = mlflow.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, return_type="list",
                                      max_results=100)
        out[rid] = {"steps": sorted(m.step for m in hist), "traces": sorted(t.info.tags["step"] for t in traces)}
    return out


def _rejected_by_reason(text: str) -> dict[str, int]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "otel_rl_bridge_spans_total" and smp.labels.get("outcome") == "rejected":
                out[smp.labels["reason"]] = out.get(smp.labels["reason"], 0) + int(smp.value)
    return out


def test_a_malformed_span_is_refused_alone_and_other_senders_data_is_delivered(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    # a long batch delay: every request below lands in the same pipeline batch
    b = BridgeProcess(["--exporters", "mlflow", "--trace-backend", "mlflow", "--batch-delay", "3",
                       "--root-grace", "0.5", "--prometheus-port", "0"], clean_env(**tracker_env(store)), tmp_path)
    project = f"poison-{uuid.uuid4().hex[:6]}"
    bad = poison(project)
    n_bad = sum(len(v) for v in bad.values())
    try:
        http_a = HttpExporter(endpoint=f"http://{b.http}/v1/traces", timeout=10)
        http_b = HttpExporter(endpoint=f"http://{b.http}/v1/traces", timeout=10, compression=None)
        grpc_c = GrpcExporter(endpoint=f"http://{b.grpc}", insecure=True, timeout=10)
        bad_spans = [s for spans in bad.values() for s in spans]
        assert http_a.export(log_spans("good-a", STEPS, project=project)) == SpanExportResult.SUCCESS
        assert http_b.export(log_spans("good-b", STEPS, project=project) + bad_spans
                             + trajectory(project, "good-b", 1)) == SpanExportResult.SUCCESS
        assert grpc_c.export(bad_spans + log_spans("good-c", STEPS, project=project)
                             + trajectory(project, "good-c", 2)) == SpanExportResult.SUCCESS
        # the partial success a sender is told: which spans were refused and why
        status, body = _post(b.http, encode_spans(log_spans("good-d", STEPS, project=project) + bad_spans)
                             .SerializeToString())
        assert status == 200
        resp = ExportTraceServiceResponse.FromString(body)
        assert resp.partial_success.rejected_spans == n_bad
        for reason in bad:
            assert reason in resp.partial_success.error_message
        for e in (http_a, http_b, grpc_c):
            e.shutdown()
        with urllib.request.urlopen(f"http://{b.prometheus}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        code = b.terminate()
    except BaseException:
        b.kill()
        raise
    assert code == 0, b.log()[-3000:]
    log = b.log()
    assert "Traceback" not in log and "pipeline worker error" not in log, log[-3000:]
    # counted: three requests carried every bad span; each reason is a label of the span counter
    assert b.stopped["spans_rejected"] == 3 * n_bad
    assert b.stopped["spans_rejected_by_reason"] == {r: 3 * len(v) for r, v in bad.items()}
    counted = _rejected_by_reason(metrics)
    assert counted == b.stopped["spans_rejected_by_reason"], counted
    for reason in bad:
        assert log.count(f"rejected span(s): {reason};") == 1, reason  # logged once per reason
    assert b.stopped["exporters"]["mlflow"]["dropped"] == 0
    runs = _mlflow_runs(f"sqlite:///{store}/mlflow.db", project)
    assert set(runs) == {"good-a", "good-b", "good-c", "good-d"}  # nothing from the refused resource
    for rid in runs:
        assert runs[rid]["steps"] == list(STEPS), rid
    assert runs["good-b"]["traces"] == ["1"] and runs["good-c"]["traces"] == ["2"]
