"""Faults on the Collector path, trainer -> agent (agent.yaml) -> gateway (gateway.yaml) -> `otel-rl bridge` ->
MLflow sqlite, all real processes on 127.0.0.1. In each case the store must end up holding exactly what the
trainer recorded: every metric point once, every trajectory as one trace with all its spans, every table.

- the gateway killed with SIGKILL mid-run and started again on the same persistent queue: nothing lost,
  nothing twice;
- the bridge stopped for 30 s mid-run: the gateway keeps what arrives in its queue on disk and its retry
  delivers all of it once the bridge is back;
- the Collector's queues deliver at least once (a request in flight when a gateway dies is sent again after
  the restart): the same OTLP requests posted to the bridge twice, the second time in another order, are
  stored once. MLflow keys metric points by (key, step, timestamp, value) and traces by trace id, and the
  bridge's MLflow exporter writes a trace that is already stored through MLflow, which merges it.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from types import SimpleNamespace

import pytest

from . import _stack as S
from ._collector import (COLLECTOR_DIR, Collector, mlflow_snapshot, otelcol_available, start_bridge, store_mismatch,
                         trainer, wait_ok, wait_until)

if not otelcol_available():
    pytest.skip("otelcol-rl is not built (bash scripts/build-collector.sh)", allow_module_level=True)

pytestmark = pytest.mark.slow

SENT = "otelcol_exporter_sent_spans"
QUEUED = "otelcol_exporter_queue_size"
BRIDGE_EXPORTER = "otlp_http/bridge"
# traces to the bridge only (no Tempo here), metrics to the debug exporter (no Prometheus here); the bridge
# exporter's backoff is capped at 5 s instead of 60 s so the delivery after an outage is seen within seconds
GATEWAY_EXTRA = {
    "exporters": {"debug": {"verbosity": "basic"},
                  BRIDGE_EXPORTER: {"retry_on_failure": {"max_interval": "5s"}}},
    "service": {"pipelines": {
        "traces": {"receivers": ["otlp"], "processors": ["memory_limiter"], "exporters": [BRIDGE_EXPORTER]},
        "metrics": {"receivers": ["otlp"], "processors": ["memory_limiter"], "exporters": ["debug"]}}},
}
OUTAGE_S = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("collector-faults")
    store = root / "store"
    store.mkdir()
    st = SimpleNamespace(root=root, store=store, token=uuid.uuid4().hex, port=S.free_port(), bridge=None,
                         gateway=None, agent=None)
    try:
        st.bridge = start_bridge(store, st.port, st.token)
        st.gateway = Collector(root, "gateway", [COLLECTOR_DIR / "gateway.yaml"], extra=GATEWAY_EXTRA, env={
            "OTEL_RL_BRIDGE_ENDPOINT": f"http://127.0.0.1:{st.port}", "OTEL_RL_BRIDGE_TOKEN": st.token})
        st.agent = Collector(root, "agent", [COLLECTOR_DIR / "agent.yaml"],
                             env={"OTEL_GATEWAY_ENDPOINT": st.gateway.grpc})
        yield st
    finally:
        for c in (st.agent, st.gateway):
            if c is not None:
                c.stop()
        if st.bridge is not None:
            st.bridge.kill()


def start_run(st, name: str, steps: int = 24, step_pause_s: float = 0.25):
    from bridge.helpers import clean_env

    run = SimpleNamespace(project=f"{name}-{uuid.uuid4().hex[:6]}", run_id=f"{name}-1", out=st.root / f"{name}.json")
    run.proc = trainer("http", f"http://{st.agent.http}", run.out, clean_env(), st.root, run.project, run.run_id,
                       steps=steps, samples=2, step_pause_s=step_pause_s)
    return run


def wait_for_delivery(gateway: Collector, what: str, timeout: float = 60) -> float:
    """Waits until the gateway has sent spans to the bridge; returns how many."""
    assert wait_until(lambda: None if gateway.metric(SENT, exporter=BRIDGE_EXPORTER) > 0 else what, timeout,
                      0.1) is None, what + "\n" + gateway.log()
    return gateway.metric(SENT, exporter=BRIDGE_EXPORTER)


def assert_stored_exactly(st, run, timeout: float = 90) -> None:
    cap = json.loads(run.out.read_text())
    mismatch = wait_until(lambda: store_mismatch(mlflow_snapshot(st.store, run.project).get(run.run_id), cap),
                          timeout)
    assert mismatch is None, f"{mismatch}\n--- gateway:\n{st.gateway.log()}"
    assert list(mlflow_snapshot(st.store, run.project)) == [run.run_id]  # one MLflow run, none split off


def post(url: str, body: bytes, token: str) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/x-protobuf", "Authorization": f"Bearer {token}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as r:
        return r.status


def rebatch(bodies: list[bytes], size: int) -> list[bytes]:
    """The spans of OTLP trace requests cut into requests of `size` spans, each with its resource and scope."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = []
    for body in bodies:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            for ss in rs.scope_spans:
                for i in range(0, len(ss.spans), size):
                    req = ExportTraceServiceRequest()
                    r = req.resource_spans.add(resource=rs.resource, schema_url=rs.schema_url)
                    r.scope_spans.add(scope=ss.scope, schema_url=ss.schema_url, spans=ss.spans[i:i + size])
                    out.append(req.SerializeToString())
    return out


def test_redelivered_otlp_requests_are_stored_once(stack):
    from bridge.helpers import clean_env

    sink = S.OtlpSink()
    try:
        run = SimpleNamespace(project=f"redeliver-{uuid.uuid4().hex[:6]}", run_id="redeliver-1",
                              out=stack.root / "redeliver.json")
        wait_ok(trainer("http", sink.url, run.out, clean_env(), stack.root, run.project, run.run_id, steps=4),
                "trainer to the recording sink")
        bodies = [b for path, b in sink.bodies if path.endswith("/v1/traces")]
    finally:
        sink.close()
    first, again = rebatch(bodies, 7), rebatch(bodies, 5)
    random.Random(0).shuffle(again)
    assert len(first) > 5
    url = f"http://{stack.bridge.http}/v1/traces"
    for body in first + again:  # everything once, then everything again cut otherwise and in another order
        assert post(url, body, stack.token) == 200
    assert_stored_exactly(stack, run)


def test_gateway_killed_mid_run_loses_and_duplicates_nothing(stack):
    run = start_run(stack, "kill")
    try:
        wait_for_delivery(stack.gateway, "nothing reached the bridge before the kill")
        stack.gateway.kill9()
        assert run.proc.poll() is None, "the run ended before the gateway was killed"
        time.sleep(1.0)  # the agent finds no gateway and keeps what it gets in its own queue
        stack.gateway.start()
        wait_ok(run.proc, "trainer")
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert_stored_exactly(stack, run)


def test_bridge_down_30s_mid_run_is_delivered_by_the_retry(stack):
    run = start_run(stack, "outage")
    try:
        wait_for_delivery(stack.gateway, "nothing reached the bridge before it was stopped")
        stack.bridge.terminate(60)
        down = time.monotonic()
        assert run.proc.poll() is None, "the run ended before the bridge was stopped"
        wait_ok(run.proc, "trainer")  # the run goes on and ends while the bridge is away
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    before = mlflow_snapshot(stack.store, run.project).get(run.run_id)
    assert store_mismatch(before, json.loads(run.out.read_text())) is not None  # not all there yet
    # the rest waits in the gateway's queue on disk (the agent forwarded it)
    assert wait_until(lambda: None if stack.gateway.metric(QUEUED, exporter=BRIDGE_EXPORTER) > 0 else "empty",
                      OUTAGE_S - (time.monotonic() - down)) is None, stack.gateway.log()
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
    assert "connection refused" in stack.gateway.log()
    stack.bridge = start_bridge(stack.store, stack.port, stack.token)
    assert_stored_exactly(stack, run)
