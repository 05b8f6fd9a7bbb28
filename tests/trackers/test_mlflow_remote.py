"""Trajectories into a real `mlflow server` through its OTLP endpoint (otel_rl_mlflow/_remote.py): the
request bytes are MLflow's own, the server stores exactly what MLflow's client path stored, a server that
dies mid-delivery loses and duplicates nothing, and a server without span ingestion gets one trace at a
time."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

from _mlflow_server import VENV_BIN, MlflowServer  # noqa: E402  (tests/ is on sys.path)
from mlflow import MlflowClient  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from otel_rl_mlflow import (  # noqa: E402
    MlflowExporter,
    _otlp,  # noqa: E402
    mlflow_trace_id,
)
from otel_rl_mlflow._traces import SpanBuilder, trace_tags  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv(_otlp_env(), raising=False)


def _otlp_env() -> str:
    from otel_rl_mlflow._remote import ENV_OTLP

    return ENV_OTLP


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (VENV_BIN / "mlflow").exists():
        pytest.skip("the mlflow CLI is not installed")
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-remote"), workers=2)
    s.start()
    try:
        yield s
    finally:
        s.kill()


# ----------------------------------------------------------------------------- workload


@otel_rl.op
def plan(question: str) -> dict:
    return {"question": question, "steps": ["read", "compute"], "empty": {}, "none": None, "nested": [[1, 2.5], []]}


@otel_rl.generate(model="policy-7b")
def chat(messages: list) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": "x = 4 — ünïcødé ✓"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 5}}


@otel_rl.tool(name="calculator")
def calculator(expression: str, tool_call_id: str) -> float:
    if "/0" in expression:
        raise ZeroDivisionError(f"cannot evaluate {expression}")
    return 4.0


@otel_rl.op(kind="REWARD")
def score(answer: float) -> float:
    return 1.0 if answer == 4.0 else 0.0


def trajectories(n: int, project: str = "remote") -> list[Trajectory]:
    """n trajectories of 5 spans: CHAIN with nested/empty/null values, LLM with Unicode and token usage, a
    TOOL that fails for every 7th (an exception event, ERROR status), a REWARD."""
    cap = CaptureExporter()
    h = otel_rl.init(project=project, experiment="e", run_id=f"r-{uuid.uuid4().hex[:6]}", exporters=[cap],
                     tracing=True, batch_delay_s=0.05)
    try:
        for i in range(n):
            with otel_rl.trajectory(step=i // 8, sample_index=i % 8, rollout_n=0) as t:
                plan(f"q{i} 🔥")
                chat([{"role": "system", "content": "be exact"}, {"role": "user", "content": f"2+2? #{i}"}])
                try:
                    answer = calculator("8/0" if i % 7 == 3 else "2+2", tool_call_id=f"call-{i}")
                except ZeroDivisionError:
                    answer = float("nan")
                t.set_reward(score(answer))
        h.flush(60)
    finally:
        h.shutdown()
    out = cap.of_type(Trajectory)
    assert len(out) == n
    return out


def _mlflow_request(spans: list) -> bytes:
    """What MLflow's own client (`RestStore.log_spans`) sends for these rows."""
    from mlflow.tracing.utils.otlp import resource_to_otel_proto

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.CopyFrom(resource_to_otel_proto(spans[0].mlflow()._span.resource))
    rs.scope_spans.add().spans.extend(s.mlflow().to_otel_proto() for s in spans)
    return req.SerializeToString()


def test_otlp_request_is_byte_for_byte_what_mlflows_client_sends():
    builder = SpanBuilder()
    trajs = trajectories(14)
    rows = [s for t in trajs for s in builder.spans(t)]
    assert any(s.events for s in rows) and any(s.status_code == "ERROR" for s in rows)
    assert _otlp.export_request(rows) == _mlflow_request(rows)


def test_otlp_values_are_encoded_as_mlflow_encodes_them():
    builder = SpanBuilder()
    row = builder.spans(trajectories(1)[0])[1]
    odd = {"big": 2**70, "neg": -5, "lone": "a\ud800b", "f": -0.0, "t": True, "l": [None, "x", {"k": None}],
           "e": [], "d": {}, "s": ""}
    for key, value in odd.items():
        row.attributes = {key: json.dumps(value)}
        row._mlflow = None
        mine = _otlp.export_request([row])
        if key == "big":  # beyond int64: MLflow's client raises; we send a double
            with pytest.raises(ValueError):
                _mlflow_request([row])
            parsed = ExportTraceServiceRequest.FromString(mine)
            assert parsed.resource_spans[0].scope_spans[0].spans[0].attributes[0].value.double_value == 2.0**70
            continue
        assert mine == _mlflow_request([row]), key


# ----------------------------------------------------------------------------- against a real server


def _exporter(url: str, project: str, otlp: bool, monkeypatch) -> tuple[MlflowExporter, RunIdentity]:
    monkeypatch.setenv(_otlp_env(), "true" if otlp else "false")
    cfg = resolve(project=project, experiment="e", trace_backend="mlflow")
    ident = RunIdentity(cfg.project, cfg.experiment, cfg.run_id)
    e = MlflowExporter(cfg, tracking_uri=url)
    e.export_records([RunStart(ident, {}, 0, time.time_ns())])
    return e, ident


def _search(client: MlflowClient, exp_id: str, **kw) -> list:
    out, token = [], None
    while True:
        page = client.search_traces(locations=[exp_id], max_results=500, page_token=token, **kw)
        out.extend(page)
        token = page.token
        if not token:
            return out


def _stored(client: MlflowClient, exp_id: str, run_id: str) -> tuple[dict, set]:
    infos = {t.info.trace_id: t for t in _search(client, exp_id)}
    linked = {t.info.trace_id for t in _search(client, exp_id, run_id=run_id, include_spans=False)}
    return infos, linked


def _normal(value, ids: dict[str, str]):
    """`value` (JSON-able) with trace ids, experiment and run ids replaced by placeholders."""
    text = json.dumps(value, sort_keys=True, default=str)
    for old, new in ids.items():
        text = text.replace(old, new)
    return json.loads(text)


def _spans(trace) -> list[dict]:
    """A stored trace's spans as dicts, in order, without their trace id (the two paths' traces differ in it)."""
    out = []
    for s in sorted(trace.data.spans, key=lambda s: (s.start_time_ns, s.span_id)):
        d = s.to_dict()
        d.pop("trace_id")
        out.append(d)
    return out


@pytest.mark.slow
def test_otlp_path_stores_what_the_mlflow_client_path_stored(server, monkeypatch):
    client = MlflowClient(server.url)
    trajs = trajectories(40, "compare")
    # the same trajectories under other trace ids for the other path (a trace id is unique in a store)
    others = [dataclasses.replace(t, trace_id=t.trace_id ^ (0xFF << 100)) for t in trajs]
    new, new_ident = _exporter(server.url, f"otlp-{uuid.uuid4().hex[:6]}", True, monkeypatch)
    new.export_records([dataclasses.replace(t, run=new_ident) for t in trajs])
    old, old_ident = _exporter(server.url, f"client-{uuid.uuid4().hex[:6]}", False, monkeypatch)
    old.export_records([dataclasses.replace(t, run=old_ident) for t in others])
    assert new._remote and not old._remote
    hn, ho = new.runs[new_ident], old.runs[old_ident]
    got_new, linked_new = _stored(client, hn.experiment_id, hn.run_id)
    got_old, linked_old = _stored(client, ho.experiment_id, ho.run_id)
    assert set(got_new) == linked_new == {mlflow_trace_id(t.trace_id) for t in trajs}
    assert set(got_old) == linked_old == {mlflow_trace_id(t.trace_id) for t in others}
    for t, o in zip(trajs, others):
        a, b = got_new[mlflow_trace_id(t.trace_id)], got_old[mlflow_trace_id(o.trace_id)]
        ids_a = {a.info.trace_id: "TRACE", a.info.trace_id[3:]: "HEX", hn.run_id: "RUN",
                 f"/{hn.experiment_id}/": "/EXP/"}
        ids_b = {b.info.trace_id: "TRACE", b.info.trace_id[3:]: "HEX", ho.run_id: "RUN",
                 f"/{ho.experiment_id}/": "/EXP/"}
        info_a, info_b = a.info.to_dict(), b.info.to_dict()
        for d in (info_a, info_b):
            d.pop("trace_location")  # the two experiments
        assert _normal(info_a, ids_a) == _normal(info_b, ids_b)
        assert info_a["request_preview"] and info_a["response_preview"]
        assert all(a.info.tags[k] == v for k, v in trace_tags(t).items())
        assert _normal(_spans(a), ids_a) == _normal(_spans(b), ids_b)
    new.shutdown()
    old.shutdown()


@pytest.mark.slow
def test_server_killed_mid_delivery_retry_loses_and_duplicates_nothing(server, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    client = MlflowClient(server.url)
    e, ident = _exporter(server.url, f"kill-{uuid.uuid4().hex[:6]}", True, monkeypatch)
    trajs = [dataclasses.replace(t, run=ident) for t in trajectories(700, "kill")]
    first, rest = trajs[:100], trajs[100:]
    e.export_records(first)
    killer = threading.Timer(1.0, server.kill)  # while the 600 of the second delivery go in
    killer.start()
    with pytest.raises((MlflowException, OSError)):  # the server went away mid-delivery
        e.export_records(rest)
    killer.join()
    server.start()
    e.export_records(rest)  # the core retries the same batch
    h = e.runs[ident]
    got, linked = _stored(client, h.experiment_id, h.run_id)
    want = {mlflow_trace_id(t.trace_id) for t in trajs}
    assert set(got) == linked == want
    assert len(_search(client, h.experiment_id, include_spans=False)) == 700
    for tid in list(want)[::50]:  # no span twice
        spans = client.get_trace(tid).data.spans
        assert len(spans) == len({s.span_id for s in spans}) == 5
    e.shutdown()


def test_a_failed_link_fails_the_delivery_and_its_retry_links_every_trace(server, monkeypatch):
    """Links go out on their own thread while the next spans are sent: a link call that fails fails the
    delivery once everything on its way ended; the retry sends again only what was not stored and
    linked, and in the end every trace is stored once and linked to the run."""
    client = MlflowClient(server.url)
    e, ident = _exporter(server.url, f"link-{uuid.uuid4().hex[:6]}", True, monkeypatch)
    trajs = [dataclasses.replace(t, run=ident) for t in trajectories(300, "link")]
    e.export_records(trajs[:1])  # the run is open, the writer made
    store = e._remote._store
    real = store.link_traces_to_run
    bad = mlflow_trace_id(trajs[200].trace_id)  # in the second of the delivery's two requests
    calls: list[list[str]] = []

    def link(ids, run_id):
        calls.append(list(ids))
        if bad in ids and sum(bad in c for c in calls) == 1:
            raise MlflowException("link refused (once)")
        return real(ids, run_id)

    monkeypatch.setattr(store, "link_traces_to_run", link)
    rest = trajs[1:]
    with pytest.raises(MlflowException, match="link refused"):
        e.export_records(rest)
    assert e._remote.done == 1  # the first request: stored and linked
    e.export_records(rest)  # the core retries the same batch
    h = e.runs[ident]
    got, linked = _stored(client, h.experiment_id, h.run_id)
    want = {mlflow_trace_id(t.trace_id) for t in trajs}
    assert set(got) == linked == want
    first = {mlflow_trace_id(t.trace_id) for t in trajs[1:150]}
    assert sum(len(first & set(c)) for c in calls) == len(first)  # the first request was not linked again
    e.shutdown()


@pytest.mark.slow
def test_server_without_span_ingestion_gets_one_trace_at_a_time(tmp_path, monkeypatch, caplog):
    """A server on a file store answers /v1/traces with 501: the exporter warns once and logs each trace
    with its info and span data, linked to the run by its `mlflow.sourceRun` metadata."""
    s = MlflowServer(tmp_path, backend=str(tmp_path / "mlruns"), env={"MLFLOW_ALLOW_FILE_STORE": "true"})
    s.start()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", s.url)  # where MLflow uploads the span data artifacts
    monkeypatch.chdir(tmp_path)
    try:
        client = MlflowClient(s.url)
        e, ident = _exporter(s.url, "filestore", True, monkeypatch)
        trajs = [dataclasses.replace(t, run=ident) for t in trajectories(6, "filestore")]
        e.export_records(trajs)
        assert e._remote is False
        assert "does not ingest OTLP spans" in caplog.text
        h = e.runs[ident]
        got = {t.info.trace_id: t for t in client.search_traces(locations=[h.experiment_id], max_results=50)}
        assert set(got) == {mlflow_trace_id(t.trace_id) for t in trajs}
        for t in trajs:
            info = got[mlflow_trace_id(t.trace_id)].info
            assert info.trace_metadata["mlflow.sourceRun"] == h.run_id
            assert all(info.tags[k] == v for k, v in trace_tags(t).items())
            assert len(got[info.trace_id].data.spans) == 5
        e.shutdown()
    finally:
        s.kill()
