"""`otel-rl bridge` as a real subprocess: OTLP/HTTP encodings, errors, auth, TLS, limits, forwarding,
health, its own Prometheus metrics, and SIGTERM with deliveries still pending.

Delivery is checked through the `file` exporter (one JSON line per `log()` call) and, for SIGTERM,
through a real MLflow sqlite store.
"""

from __future__ import annotations

import datetime
import gzip
import http.client
import json
import socket
import ssl
import threading
import time
import urllib.request
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)
from opentelemetry.sdk.trace.export import SpanExportResult

from .helpers import BridgeProcess, clean_env, log_spans, spec_json, tracker_env

TOKEN = "s3cret-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACE_SERVICE = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
def proto_body(run_id: str, steps) -> bytes:
    return encode_spans(log_spans(run_id, steps)).SerializeToString()


def jsonl_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def wait_for(fn, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Collector:
    """The forward target: an OTLP/HTTP endpoint keeping what it receives (decompressed)."""

    def __init__(self):
        self.got: list[tuple[str, str, bytes]] = []
        store = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                store.got.append((self.path, self.headers.get("Content-Type"), body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bridge-http")


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def bridge(env_dir, collector):
    jsonl = env_dir / "records.jsonl"
    env = clean_env(BRIDGE_TOKEN=TOKEN, OTEL_RL_JSONL_PATH=str(jsonl))
    b = BridgeProcess(["--exporters", "file,discard", "--auth-token-env", "BRIDGE_TOKEN", "--batch-delay", "0.05",
                       "--forward-endpoint", collector.url, "--prometheus-port", "0", "--max-body-mib", "1",
                       "--max-decompressed-mib", "4", "--max-decompression-ratio", "50"], env, env_dir)
    b.jsonl = jsonl
    yield b
    code = b.terminate()
    assert code == 0, b.log()[-3000:]
    assert "Traceback" not in b.log(), b.log()[-3000:]


def post(addr: str, path: str, body: bytes, headers: dict | None = None, method: str = "POST"):
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


PB = {"Content-Type": "application/x-protobuf", **AUTH}
JS = {"Content-Type": "application/json", **AUTH}

# ----------------------------------------------------------------------------- health / encodings


def test_health_and_readiness_need_no_token(bridge):
    status, _, body = post(bridge.http, "/healthz", b"", method="GET")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = post(bridge.http, "/readyz", b"", method="GET")
    assert status == 200 and json.loads(body)["status"] == "ready"


@pytest.mark.parametrize("encoding", ["identity", "gzip", "deflate", "raw-deflate"])
@pytest.mark.parametrize("media", ["protobuf", "json"])
def test_encodings_are_accepted_and_delivered(bridge, media, encoding):
    step = 1000 + 10 * ["identity", "gzip", "deflate", "raw-deflate"].index(encoding) + (media == "json")
    req = encode_spans(log_spans("enc", [step]))
    body = spec_json(req) if media == "json" else req.SerializeToString()
    headers = dict(JS if media == "json" else PB)
    if encoding == "gzip":
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    elif encoding == "deflate":
        body, headers["Content-Encoding"] = zlib.compress(body), "deflate"
    elif encoding == "raw-deflate":
        c = zlib.compressobj(wbits=-15)
        body, headers["Content-Encoding"] = c.compress(body) + c.flush(), "deflate"
    status, h, resp = post(bridge.http, "/v1/traces", body, headers)
    assert status == 200, resp
    if media == "json":
        assert h["Content-Type"] == "application/json" and json.loads(resp) == {}
    else:
        assert h["Content-Type"] == "application/x-protobuf"
        assert not ExportTraceServiceResponse.FromString(resp).HasField("partial_success")
    wait_for(lambda: step in jsonl_steps(bridge.jsonl), what=f"step {step} in the file exporter")


def test_official_http_exporter_with_gzip(bridge):
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exp = OTLPSpanExporter(endpoint=f"http://{bridge.http}/v1/traces", headers=AUTH, compression=Compression.Gzip)
    assert exp.export(log_spans("official", [2000, 2001])) == SpanExportResult.SUCCESS
    exp.shutdown()
    wait_for(lambda: {2000, 2001} <= set(jsonl_steps(bridge.jsonl)), what="steps 2000-2001")
    bad = OTLPSpanExporter(endpoint=f"http://{bridge.http}/v1/traces", headers={"Authorization": "Bearer nope"},
                           timeout=5)
    assert bad.export(log_spans("official", [2002])) == SpanExportResult.FAILURE  # 401 is not retried
    bad.shutdown()


def test_partial_success_for_invalid_span_ids(bridge):
    req = encode_spans(log_spans("partial", [3000]))
    bad = req.resource_spans[0].scope_spans[0].spans.add()
    bad.CopyFrom(req.resource_spans[0].scope_spans[0].spans[0])
    bad.trace_id = b"\x01\x02"
    status, _, resp = post(bridge.http, "/v1/traces", req.SerializeToString(), PB)
    assert status == 200
    ps = ExportTraceServiceResponse.FromString(resp).partial_success
    assert ps.rejected_spans == 1 and "trace_id" in ps.error_message
    status, _, resp = post(bridge.http, "/v1/traces", spec_json(req), JS)
    assert status == 200
    assert json.loads(resp)["partialSuccess"]["rejectedSpans"] == "1"
    wait_for(lambda: jsonl_steps(bridge.jsonl).count(3000) == 2, what="the valid spans")


# ----------------------------------------------------------------------------- refusals


def gzip_bomb(size: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (1 << 20)
    return b"".join([c.compress(chunk) for _ in range(size >> 20)] + [c.flush()])


@pytest.mark.parametrize("path, body, headers, code, reason", [
    ("/v1/traces", b"x", {"Content-Type": "application/x-protobuf"}, 401, "bearer"),
    ("/v1/traces", b"x", {"Content-Type": "application/x-protobuf", "Authorization": "Bearer wrong"}, 401, "bearer"),
    ("/v1/traces", b"x", {"Content-Type": "application/x-protobuf", "Authorization": f"Basic {TOKEN}"}, 401, "bearer"),
    ("/v1/traces", b"x", {"Content-Type": "application/x-protobuf", "Authorization": f"Bearer {TOKEN}x"}, 401, ""),
    ("/v1/logs", b"x", PB, 404, "paths"),
    ("/v1/traces", b"\xff\xff\xff", PB, 400, "not an OTLP protobuf request"),
    ("/v1/traces", b"{nope", JS, 400, "invalid JSON"),
    ("/v1/metrics", b'{"resourceMetrics": 3}', JS, 400, "not an OTLP JSON request"),
    ("/v1/traces", b"hello", {"Content-Type": "text/plain", **AUTH}, 415, "Content-Type"),
    ("/v1/traces", b"hello", {**PB, "Content-Encoding": "br"}, 415, "Content-Encoding"),
    ("/v1/traces", gzip.compress(b"\x0a" * 1000)[:-9], {**PB, "Content-Encoding": "gzip"}, 400, "truncated gzip"),
    ("/v1/traces", b"\x1f\x8bnot gzip at all", {**PB, "Content-Encoding": "gzip"}, 400, "corrupt gzip"),
    ("/v1/traces", gzip_bomb(64 << 20), {**PB, "Content-Encoding": "gzip"}, 413, "inflates beyond"),
    ("/v1/traces", b"\0" * (2 << 20), PB, 413, "larger than"),
])
def test_refusals_are_short_4xx(bridge, path, body, headers, code, reason):
    status, h, resp = post(bridge.http, path, body, headers)
    assert status == code, resp[:300]
    text = resp.decode("utf-8", "replace")
    if h.get("Content-Type") == "application/x-protobuf":
        text = status_pb2.Status.FromString(resp).message
    elif h.get("Content-Type") == "application/json":
        text = json.loads(resp)["message"]
    assert reason in text and len(text) < 300 and "Traceback" not in text
    if code == 401:
        assert h.get("WWW-Authenticate") == "Bearer"


def test_wrong_methods(bridge):
    status, h, _ = post(bridge.http, "/v1/traces", b"", AUTH, method="GET")
    assert status == 405 and h["Allow"] == "POST"
    assert post(bridge.http, "/v1/traces", b"", AUTH, method="PUT")[0] == 405
    assert post(bridge.http, "/v1/traces", b"", AUTH, method="FROB")[0] == 405


def test_keep_alive_survives_refusals(bridge):
    """An authenticated request refused with a body that fits is read and dropped: the connection stays usable."""
    host, port = bridge.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for i, (body, headers, code) in enumerate([(b"garbage", PB, 400), (b"hi", {**AUTH, "Content-Type": "a/b"}, 415),
                                                   (proto_body("ka", [4000]), PB, 200)]):
            conn.request("POST", "/v1/traces", body=body, headers=headers)
            r = conn.getresponse()
            r.read()
            assert r.status == code, i
            assert r.getheader("Connection") != "close"
        assert conn.sock is not None  # the same socket all along
    finally:
        conn.close()


def test_without_the_token_the_body_is_never_read(bridge):
    """401 comes as soon as the headers are in, before any byte of the announced body is sent, and the
    connection closes: an unauthenticated client cannot make the bridge read (or inflate) anything."""
    host, port = bridge.http.rsplit(":", 1)
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            head = {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip", "Content-Length": str(900 << 10),
                    **auth}
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n"
                      + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n")
            s.settimeout(5)  # far below the idle timeout: the answer does not wait for the body
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = s.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 401 "), answer[:80]
            assert b"\r\nConnection: close\r\n" in answer


# ----------------------------------------------------------------------------- gRPC


def grpc_call(addr: str, body: bytes, metadata=(), compression=None):
    with grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = ch.unary_unary(TRACE_SERVICE, request_serializer=None, response_deserializer=None)
        try:
            resp = call(body, metadata=metadata, timeout=30, compression=compression)
            return grpc.StatusCode.OK, resp
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


def test_grpc_auth_malformed_and_limits(bridge):
    good = proto_body("grpc", [5000])
    assert grpc_call(bridge.grpc, good)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_call(bridge.grpc, good, [("authorization", "Bearer nope")])[0] == grpc.StatusCode.UNAUTHENTICATED
    code, resp = grpc_call(bridge.grpc, good, [("authorization", f"Bearer {TOKEN}")])
    assert code == grpc.StatusCode.OK and ExportTraceServiceResponse.FromString(resp) == ExportTraceServiceResponse()
    wait_for(lambda: 5000 in jsonl_steps(bridge.jsonl), what="step 5000 over gRPC")
    md = [("authorization", f"Bearer {TOKEN}")]
    code, details = grpc_call(bridge.grpc, b"\xff\xfe\xfd", md)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details
    # 5 MiB > the 4 MiB decompressed limit, sent plain and gzip-compressed (a bomb of zeros)
    big = b"\x0a" + b"\x80\x80\x80\x03" + b"\0" * (5 << 20)
    assert grpc_call(bridge.grpc, big, md)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_call(bridge.grpc, big, md, grpc.Compression.Gzip)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_without_the_token_the_message_is_never_read(bridge):
    """A gRPC call without the token is refused from its metadata: its message, here 64 MiB of zeros
    gzip-compressed (16 times the bridge's 4 MiB decompressed limit), is neither read nor inflated, so
    the answer is UNAUTHENTICATED, not the RESOURCE_EXHAUSTED of a message that was inflated first."""
    bomb = bytes(64 << 20)
    for md in ([], [("authorization", "Bearer nope")]):
        assert grpc_call(bridge.grpc, bomb, md, grpc.Compression.Gzip)[0] == grpc.StatusCode.UNAUTHENTICATED
    md = [("authorization", f"Bearer {TOKEN}")]
    assert grpc_call(bridge.grpc, bomb, md, grpc.Compression.Gzip)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_call_without_the_token_is_refused_before_its_client_sends_anything(bridge):
    """A client that opens a call and trickles (here: sends nothing for 15 s) without the token holds no
    call slot: it is refused as soon as its headers are in (it waited for the message before)."""
    def never():
        time.sleep(15)
        yield b""

    with grpc.insecure_channel(bridge.grpc) as ch:
        call = ch.stream_unary(TRACE_SERVICE, request_serializer=None, response_deserializer=None)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            call(never(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("compression, step", [("Gzip", 5100), ("Deflate", 5101), ("NoCompression", 5102)])
def test_official_grpc_exporter_with_token(bridge, compression, step):
    """Each compression the official gRPC exporter offers: the bridge inflates gzip and deflate itself."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exp = OTLPSpanExporter(endpoint=f"http://{bridge.grpc}", insecure=True, headers={"authorization": f"Bearer {TOKEN}"},
                           compression=getattr(grpc.Compression, compression), timeout=10)
    assert exp.export(log_spans("grpc-official", [step])) == SpanExportResult.SUCCESS
    exp.shutdown()
    wait_for(lambda: step in jsonl_steps(bridge.jsonl), what=f"step {step}")


# ----------------------------------------------------------------------------- forwarding / metrics


def test_forwarding_sends_what_was_received(bridge, collector):
    body = proto_body("fwd", [6000])
    assert post(bridge.http, "/v1/traces", gzip.compress(body), {**PB, "Content-Encoding": "gzip"})[0] == 200
    metrics = ExportMetricsServiceRequest()
    m = metrics.resource_metrics.add().scope_metrics.add().metrics.add()
    m.name = "g"
    m.gauge.data_points.add().as_double = 1.5
    assert post(bridge.http, "/v1/metrics", metrics.SerializeToString(), PB)[0] == 200
    assert post(bridge.http, "/v1/traces", b"junk", PB)[0] == 400  # refused requests are not forwarded

    def forwarded():
        return [g for g in collector.got if g[2] in (body, metrics.SerializeToString())]

    got = wait_for(lambda: len(forwarded()) == 2 and forwarded(), what="forwarded bodies")
    assert sorted((p, t) for p, t, _ in got) == [("/v1/metrics", "application/x-protobuf"),
                                                 ("/v1/traces", "application/x-protobuf")]
    assert not any(b == b"junk" for _, _, b in collector.got)
    ExportTraceServiceRequest.FromString(got[0][2] if got[0][0] == "/v1/traces" else got[1][2])


def test_prometheus_endpoint_shows_the_bridge(bridge):
    from prometheus_client.parser import text_string_to_metric_families

    post(bridge.http, "/v1/traces", b"x", {"Content-Type": "application/x-protobuf"})  # one 401 at least
    assert post(bridge.http, "/v1/traces", proto_body("prom", [7000]), PB)[0] == 200
    wait_for(lambda: 7000 in jsonl_steps(bridge.jsonl), what="step 7000")
    with urllib.request.urlopen(f"http://{bridge.prometheus}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def total(name, **labels):
        return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

    assert total("otel_rl_bridge_requests_total", outcome="rejected", reason="unauthorized") >= 1
    assert total("otel_rl_bridge_requests_total", outcome="accepted", transport="http", signal="traces") >= 1
    assert total("otel_rl_bridge_spans_total", outcome="accepted") >= 1
    assert total("otel_rl_bridge_received_bytes_total") > 0
    assert total("otel_rl_exporter_items_total", exporter="file", outcome="exported") >= 1
    assert total("otel_rl_exporter_items_total", exporter="forward", outcome="exported") >= 1
    assert ("otel_rl_exporter_queued" in samples or "otel_rl_exporter_queued_items" in samples)
    assert total("otel_rl_bridge_delivery_latency_seconds_count", exporter="file") >= 1
    assert total("otel_rl_bridge_runs") >= 1


# ----------------------------------------------------------------------------- TLS


def self_signed(dirpath: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = dirpath / "cert.pem", dirpath / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_http_and_grpc(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    # requests lets these override the exporter's certificate_file (a session's `verify`)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    cert, key = self_signed(tmp_path)
    jsonl = tmp_path / "tls.jsonl"
    b = BridgeProcess(["--exporters", "file", "--tls-cert", str(cert), "--tls-key", str(key), "--batch-delay", "0.05"],
                      clean_env(OTEL_RL_JSONL_PATH=str(jsonl)), tmp_path)
    try:
        assert b.ready["tls"] is True
        http_exp = HttpExporter(endpoint=f"https://{b.http}/v1/traces", certificate_file=str(cert), timeout=10)
        assert http_exp.export(log_spans("tls", [1])) == SpanExportResult.SUCCESS
        http_exp.shutdown()
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        grpc_exp = GrpcExporter(endpoint=f"https://{b.grpc}", credentials=creds, timeout=10)
        assert grpc_exp.export(log_spans("tls", [2])) == SpanExportResult.SUCCESS
        grpc_exp.shutdown()
        # plain HTTP to the TLS port gets no OTLP answer; a client that does not trust the cert fails
        with pytest.raises((http.client.HTTPException, OSError)):
            post(b.http, "/v1/traces", proto_body("tls", [3]), PB)
        host, port = b.http.rsplit(":", 1)
        with pytest.raises(ssl.SSLError):
            c = http.client.HTTPSConnection(host, int(port), timeout=10, context=ssl.create_default_context())
            c.request("GET", "/healthz")
        ctx = ssl.create_default_context(cafile=str(cert))
        c = http.client.HTTPSConnection(host, int(port), timeout=10, context=ctx)
        c.request("GET", "/healthz")
        assert c.getresponse().status == 200
        c.close()
        wait_for(lambda: {1, 2} <= set(jsonl_steps(jsonl)), what="steps over TLS")
    finally:
        assert b.terminate() == 0
    assert jsonl_steps(jsonl) == [1, 2]


# ----------------------------------------------------------------------------- SIGTERM


@pytest.mark.slow
def test_sigterm_delivers_what_was_acknowledged(tmp_path):
    """The pipeline holds acknowledged spans (a long batch delay); SIGTERM must deliver them all."""
    from mlflow import MlflowClient

    store = tmp_path / "store"
    store.mkdir()
    b = BridgeProcess(["--exporters", "mlflow", "--batch-delay", "60", "--prometheus-port", "0"],
                      clean_env(**tracker_env(store)), tmp_path)
    project = f"sigterm-{uuid.uuid4().hex[:6]}"
    steps = list(range(500))  # < 512: the pipeline worker is not woken by the amount either
    try:
        for i in range(0, len(steps), 100):
            req = encode_spans(log_spans("sig-1", steps[i:i + 100], project=project))
            assert post(b.http, "/v1/traces", req.SerializeToString(), {"Content-Type": "application/x-protobuf"})[0] \
                == 200
        with urllib.request.urlopen(f"http://{b.prometheus}/metrics", timeout=10) as r:
            text = r.read().decode()
        backlog = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("otel_rl_bridge_pipeline_backlog")]
        assert backlog == [500.0], text  # acknowledged, none of it delivered yet
        code = b.terminate()
    except BaseException:
        b.kill()
        raise
    assert code == 0, b.log()[-3000:]
    st = b.stopped["exporters"]["mlflow"]
    assert st["dropped"] == 0 and st["queued"] == 0 and st["exported"] == 500  # one StepMetrics per span
    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    exp = client.get_experiment_by_name(project)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in hist) == steps
