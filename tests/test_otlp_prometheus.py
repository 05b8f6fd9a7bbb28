"""OTLP (HTTP and gRPC) received by real endpoints started here, and the Prometheus pull endpoint
(scraped with urllib and, when installed, by a real Prometheus server)."""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

import otel_rl
from otel_rl import semconv as sc
from otel_rl.records import metrics_from_attributes

LOGGED = {"a": 1.5, "n": 3, "flag": True, "x": float("nan")}


# ----------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "VERL_FILE_LOGGER")) or k.lower() in ("http_proxy", "https_proxy", "all_proxy",
                                                                         "grpc_proxy"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.chdir(tmp_path)
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _any(v):
    """An OTLP AnyValue as a Python value (arrays as tuples, as the SDK keeps them)."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_any(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _any(kv.value) for kv in v.kvlist_value.values}
    if which is None:
        return None
    return getattr(v, which)


def _attrs(kvs) -> dict:
    return {kv.key: _any(kv.value) for kv in kvs}


def _same_metrics(got: dict, want: dict) -> bool:
    if list(got) != list(want):
        return False
    for k, w in want.items():
        g = got[k]
        if type(g) is not type(w):
            return False
        if isinstance(w, float) and math.isnan(w):
            if not math.isnan(g):
                return False
        elif g != w:
            return False
    return True


class HttpCollector:
    """A minimal OTLP/HTTP receiver: stores request bodies per path, answers 200 + empty response."""

    def __init__(self):
        self.bodies: dict[str, list[bytes]] = {"/v1/traces": [], "/v1/metrics": []}
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with collector.lock:
                    collector.bodies.setdefault(self.path, []).append(body)
                if self.path == "/v1/metrics":
                    resp = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    resp = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(resp)))
                self.end_headers()
                self.wfile.write(resp)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trace_requests(self):
        with self.lock:
            return [trace_service_pb2.ExportTraceServiceRequest.FromString(b) for b in self.bodies["/v1/traces"]]

    def metric_requests(self):
        with self.lock:
            return [metrics_service_pb2.ExportMetricsServiceRequest.FromString(b) for b in self.bodies["/v1/metrics"]]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def http_collector():
    c = HttpCollector()
    try:
        yield c
    finally:
        c.close()


class GrpcCollector:
    def __init__(self):
        self.traces: list = []
        self.metrics: list = []
        store = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                store.traces.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                store.metrics.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        import grpc

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self):
        self.server.stop(0)


@pytest.fixture
def grpc_collector():
    c = GrpcCollector()
    try:
        yield c
    finally:
        c.close()


def _spans(requests):
    """[(resource attributes, span)] from ExportTraceServiceRequests."""
    out = []
    for req in requests:
        for rs in req.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    out.append((res, span))
    return out


def _logged_dicts(requests) -> list[dict]:
    return [metrics_from_attributes(_attrs(s.attributes)) for _, s in _spans(requests) if s.name == sc.SPAN_LOG]


# ----------------------------------------------------------------------------- OTLP/HTTP


def test_otlp_http_reaches_a_real_endpoint(http_collector):
    h = otel_rl.init(exporters=["otlp"], otlp_endpoint=http_collector.url, otlp_protocol="http/protobuf",
                     project="proj-x", experiment="exp-y", tracing=True, batch_delay_s=0.05)
    try:
        assert h.exporters[0].protocol == "http/protobuf"

        @otel_rl.op
        def plan(question):
            return question.upper()

        @otel_rl.tool
        def calculator(x, tool_call_id=None):
            return x * 2

        with otel_rl.step(2):
            with otel_rl.timer("gen"):
                with otel_rl.trajectory(sample_index=0, rollout_n=1, name="agent") as t:
                    assert t.sampled
                    plan("hi")
                    calculator(21, tool_call_id="call-1")
                    t.set_reward(1.0)
            otel_rl.log(dict(LOGGED), step=2)
        assert h.flush(30)
        run_id = h.run_id
    finally:
        h.shutdown()

    spans = _spans(http_collector.trace_requests())
    assert spans, "no span reached the endpoint"
    # resource: the run identity, on every resource
    for res, _ in spans:
        assert res[sc.RL_PROJECT_NAME] == "proj-x"
        assert res[sc.RL_EXPERIMENT_NAME] == "exp-y"
        assert res[sc.RL_RUN_ID] == run_id
        assert res[sc.RL_WORKER_RANK] == 0
        assert res[sc.SERVICE_NAME] == "otel-rl"

    by_name: dict = {}
    for _, s in spans:
        by_name.setdefault(s.name, []).append(s)

    # the logged dict comes back exactly (keys in order, int stays int, bool stays bool, NaN kept)
    logs = [s for s in by_name[sc.SPAN_LOG] if "a" in _attrs(s.attributes)[sc.RL_METRICS_KEYS]]
    assert len(logs) == 1
    log_attrs = _attrs(logs[0].attributes)
    assert log_attrs[sc.RL_STEP] == 2
    got = metrics_from_attributes(log_attrs)
    assert _same_metrics(got, LOGGED), got

    # the step span and its children
    (step_span,) = by_name[sc.SPAN_STEP]
    assert step_span.parent_span_id == b""
    assert _attrs(step_span.attributes)[sc.RL_STEP] == 2
    assert _attrs(step_span.attributes)[sc.RL_SPAN_KIND] == sc.KIND_STEP
    assert logs[0].trace_id == step_span.trace_id and logs[0].parent_span_id == step_span.span_id
    (timer_span,) = by_name["gen"]
    assert timer_span.trace_id == step_span.trace_id and timer_span.parent_span_id == step_span.span_id
    # the step's timings are logged too
    timings = [metrics_from_attributes(_attrs(s.attributes)) for s in by_name[sc.SPAN_LOG]]
    assert any(list(d) == ["timing_s/gen"] and d["timing_s/gen"] > 0 for d in timings)

    # the trajectory: its own trace, linked to the step
    (root,) = by_name["agent"]
    ra = _attrs(root.attributes)
    assert root.parent_span_id == b""
    assert root.trace_id != step_span.trace_id
    assert ra[sc.RL_SPAN_KIND] == sc.KIND_AGENT
    assert ra[sc.RL_STEP] == 2 and ra[sc.RL_SAMPLE_INDEX] == 0 and ra[sc.RL_ROLLOUT_N] == 1
    assert ra[sc.RL_VALIDATE] is False and ra[sc.RL_REWARD] == 1.0
    assert ra[sc.RL_EXPERIMENT_NAME] == "exp-y" and ra[sc.RL_TRAJECTORY_NAME] == "agent"
    assert len(root.links) == 1
    assert root.links[0].trace_id == step_span.trace_id and root.links[0].span_id == step_span.span_id

    ops = [s for _, s in spans if s.trace_id == root.trace_id and s.span_id != root.span_id]
    assert sorted(s.name for s in ops) == sorted([plan.__qualname__, "execute_tool calculator"])
    for s in ops:
        assert s.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= root.end_time_unix_nano
    (plan_span,) = [s for s in ops if s.name == plan.__qualname__]
    pa = _attrs(plan_span.attributes)
    assert json.loads(pa[sc.RL_OP_INPUTS]) == {"question": "hi"}
    assert json.loads(pa[sc.RL_OP_OUTPUT]) == "HI"
    (tool_span,) = [s for s in ops if s.name == "execute_tool calculator"]
    ta = _attrs(tool_span.attributes)
    assert ta[sc.RL_SPAN_KIND] == sc.KIND_TOOL and ta[sc.GEN_AI_TOOL_CALL_ID] == "call-1"
    assert json.loads(ta[sc.RL_OP_OUTPUT]) == 42

    # run start carries the config
    (run_span,) = by_name[sc.SPAN_RUN]
    assert sc.RL_RUN_CONFIG in _attrs(run_span.attributes)

    # metrics: gauge rl.train.a = 1.5 with the run identity; NaN is not a gauge value
    points: dict = {}
    for req in http_collector.metric_requests():
        for rm in req.resource_metrics:
            assert _attrs(rm.resource.attributes)[sc.RL_RUN_ID] == run_id
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.WhichOneof("data") == "gauge":
                        for dp in m.gauge.data_points:
                            points.setdefault(m.name, []).append((dp.as_double, _attrs(dp.attributes)))
    assert "rl.train.a" in points, sorted(points)
    value, attrs = points["rl.train.a"][-1]
    assert value == 1.5
    assert attrs == {sc.RL_PROJECT_NAME: "proj-x", sc.RL_EXPERIMENT_NAME: "exp-y", sc.RL_RUN_ID: run_id}
    assert points["rl.train.n"][-1][0] == 3.0
    assert points["rl.train.flag"][-1][0] == 1.0
    assert "rl.train.x" not in points


def test_otlp_http_from_standard_env(http_collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_collector.url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    h = otel_rl.init(exporters=["otlp"], project="p", experiment="e", batch_delay_s=0.05)
    try:
        otel_rl.log(dict(LOGGED), step=5)
        assert h.flush(30)
    finally:
        h.shutdown()
    dicts = _logged_dicts(http_collector.trace_requests())
    assert len(dicts) == 1 and _same_metrics(dicts[0], LOGGED)


# ----------------------------------------------------------------------------- OTLP/gRPC


def test_otlp_grpc_reaches_a_real_server(grpc_collector):
    h = otel_rl.init(exporters=["otlp"], otlp_protocol="grpc", otlp_endpoint=f"http://127.0.0.1:{grpc_collector.port}",
                     project="p", experiment="e", batch_delay_s=0.05)
    try:
        assert h.exporters[0].protocol == "grpc"
        otel_rl.log(dict(LOGGED), step=2)
        assert h.flush(30)
        run_id = h.run_id
    finally:
        h.shutdown()
    dicts = _logged_dicts(grpc_collector.traces)
    assert len(dicts) == 1 and _same_metrics(dicts[0], LOGGED), dicts
    for res, _ in _spans(grpc_collector.traces):
        assert res[sc.RL_RUN_ID] == run_id and res[sc.RL_PROJECT_NAME] == "p"
    names = {m.name for req in grpc_collector.metrics for rm in req.resource_metrics
             for sm in rm.scope_metrics for m in sm.metrics}
    assert "rl.train.a" in names


def test_otlp_grpc_from_standard_env(grpc_collector, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{grpc_collector.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    h = otel_rl.init(exporters=["otlp"], project="p", experiment="e", batch_delay_s=0.05)
    try:
        assert h.exporters[0].protocol == "grpc"
        otel_rl.log(dict(LOGGED), step=9)
        assert h.flush(30)
    finally:
        h.shutdown()
    dicts = _logged_dicts(grpc_collector.traces)
    assert len(dicts) == 1 and _same_metrics(dicts[0], LOGGED), dicts


# ----------------------------------------------------------------------------- OTLP endpoint down


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_otlp_endpoint_down_does_not_affect_training(protocol, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    port = _free_port()  # nothing listens there
    h = otel_rl.init(exporters=["otlp"], otlp_protocol=protocol, otlp_endpoint=f"http://127.0.0.1:{port}",
                     project="p", experiment="e", batch_delay_s=0.05)
    t0 = time.monotonic()
    for i in range(20):
        assert otel_rl.log({"loss": 1.0 / (i + 1)}, step=i) is None
    with otel_rl.step(20):
        with otel_rl.timer("gen"):
            pass
    assert time.monotonic() - t0 < 1.0  # the caller never waits for the network
    deadline = time.monotonic() + 20
    while h.stats()["exporters"]["otlp"]["failed_attempts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = h.stats()["exporters"]["otlp"]
    assert stats["failed_attempts"] >= 1 and stats["exported"] == 0 and stats["queued"] > 0
    t0 = time.monotonic()
    h.shutdown(timeout_s=3)
    took = time.monotonic() - t0
    assert took < 3 + 1.5, f"shutdown(timeout_s=3) took {took:.1f}s"  # one budget, not one per stage
    deadline = time.monotonic() + 5
    while h.stats()["exporters"]["otlp"]["dropped"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = h.stats()["exporters"]["otlp"]
    assert stats["dropped"] > 0 and stats["exported"] == 0
    assert otel_rl.current() is None


# ----------------------------------------------------------------------------- Prometheus


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def _samples(text: str, name: str) -> list[tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out.append((s.labels, s.value))
    return out


def _assert_well_formed(text: str) -> None:
    """Each metric family once (Prometheus rejects a repeated HELP/TYPE), each series once."""
    types = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]
    assert len(types) == len(set(types)), "repeated metric families"
    series = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(series) == len(set(series)), "repeated series"


def _prometheus_exporter(h):
    (p,) = [e for e in h.exporters if e.name == "prometheus"]
    return p


def test_prometheus_endpoint_serves_logged_values():
    h = otel_rl.init(exporters=["prometheus"], prometheus_port=0, project="proj", experiment="exp",
                     batch_delay_s=0.05)
    try:
        p = _prometheus_exporter(h)
        assert p.port > 0 and p.url == f"http://127.0.0.1:{p.port}/metrics"
        otel_rl.log({"actor/pg_loss": 0.25, "n": 3, "x": float("nan")}, step=1)
        assert h.flush(10)
        text = _scrape(p.url)
        _assert_well_formed(text)
        (labels, value), = _samples(text, "rl_train_actor_pg_loss")
        assert value == 0.25
        assert labels["rl_project_name"] == "proj"
        assert labels["rl_experiment_name"] == "exp"
        assert labels["rl_run_id"] == h.run_id
        assert _samples(text, "rl_train_n")[0][1] == 3.0
        assert _samples(text, "rl_train_x") == []
        assert "# TYPE rl_train_actor_pg_loss gauge" in text
        # last value wins, and repeated flushes between scrapes do not duplicate families
        otel_rl.log({"actor/pg_loss": 0.125}, step=2)
        for _ in range(3):
            assert h.flush(10)
        text = _scrape(p.url)
        _assert_well_formed(text)
        assert [v for _, v in _samples(text, "rl_train_actor_pg_loss")] == [0.125]
        text = _scrape(p.url)  # a second scrape without anything new
        _assert_well_formed(text)
        assert [v for _, v in _samples(text, "rl_train_actor_pg_loss")] == [0.125]
    finally:
        h.shutdown()


def test_prometheus_two_successive_inits_both_serve():
    urls = []
    for i, value in enumerate((1.0, 2.0)):
        h = otel_rl.init(exporters=["prometheus"], prometheus_port=0, project="proj", experiment=f"exp{i}",
                         batch_delay_s=0.05)
        try:
            p = _prometheus_exporter(h)
            otel_rl.log({"actor/pg_loss": value}, step=i)
            assert h.flush(10)
            text = _scrape(p.url)
            _assert_well_formed(text)
            got = _samples(text, "rl_train_actor_pg_loss")
            # only this run's series: pipelines do not share a registry
            assert [(lab["rl_experiment_name"], lab["rl_run_id"], v) for lab, v in got] == \
                [(f"exp{i}", h.run_id, value)]
            urls.append(p.url)
        finally:
            h.shutdown()
    for url in urls:  # shut down: nothing served any more
        with pytest.raises(OSError):
            _scrape(url)


@pytest.mark.slow
def test_real_prometheus_scrapes_our_endpoint(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("the prometheus binary is required in CI (apt-get install prometheus)")
        pytest.skip("no prometheus binary on PATH (apt-get install prometheus)")
    h = otel_rl.init(exporters=["prometheus"], prometheus_port=0, project="proj", experiment="exp",
                     batch_delay_s=0.05)
    proc = None
    try:
        p = _prometheus_exporter(h)
        otel_rl.log({"actor/pg_loss": 0.375}, step=1)
        assert h.flush(10)
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: otel_rl\n    scrape_interval: 1s\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{p.port}']\n"
        )
        web_port = _free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web_port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        query = f'rl_train_actor_pg_loss{{rl_run_id="{h.run_id}",rl_project_name="proj",rl_experiment_name="exp"}}'
        api = f"http://127.0.0.1:{web_port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        result = None
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text(errors="replace")
            h.flush(5)  # a training loop flushing between scrapes
            try:
                with urllib.request.urlopen(api, timeout=5) as r:
                    body = json.loads(r.read())
                if body.get("status") == "success" and body["data"]["result"]:
                    result = body["data"]["result"]
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        assert result, "Prometheus never had the series; log:\n" + (tmp_path / "prometheus.log").read_text(
            errors="replace")[-3000:]
        assert len(result) == 1
        assert float(result[0]["value"][1]) == 0.375
        assert result[0]["metric"]["job"] == "otel_rl"
        # the target is healthy (a malformed exposition would make the scrape fail)
        with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/api/v1/targets", timeout=5) as r:
            targets = json.loads(r.read())["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        h.shutdown()
