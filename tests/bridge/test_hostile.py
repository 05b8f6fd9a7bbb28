"""Hostile input against a real `otel-rl bridge` process: > 10,000 malformed, truncated, oversized,
wrong-content-type, gzip-bomb, unauthenticated and broken-framing requests over persistent loopback
connections (plus raw-socket garbage and gRPC junk).  Every answer is a 4xx (gRPC: a client-error
status), the process never dies, its memory stays bounded, and a valid request afterwards is delivered.

Every request here is invalid by construction (a protobuf body cut inside its first field is always
truncated, a JSON body cut in the middle is never valid JSON, ...), so a 2xx would be a bug too.
"""

from __future__ import annotations

import gzip
import http.client
import json
import random
import socket
import threading
import time
import urllib.request
import zlib

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from .helpers import BridgeProcess, clean_env, log_spans, spec_json

pytestmark = pytest.mark.slow
TOKEN = "fuzz-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PB = {"Content-Type": "application/x-protobuf", **AUTH}
JS = {"Content-Type": "application/json", **AUTH}
N_HTTP = 10_400
N_RAW = 300
N_GRPC = 300
THREADS = 4
TIME_LIMIT_S = 400
MAX_BODY = 1 << 20


def _bomb(size: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (1 << 20)
    return b"".join([c.compress(chunk) for _ in range(size >> 20)] + [c.flush()])


def corpus(rng: random.Random) -> list[tuple[str, str, str, dict, bytes, set[int]]]:
    """(case, method, path, headers, body, allowed statuses)."""
    valid = encode_spans(log_spans("fuzz", range(20))).SerializeToString()
    valid_json = spec_json(encode_spans(log_spans("fuzz", range(5))))
    bomb = _bomb(32 << 20)  # 32 MiB of zeros in ~32 KiB: past the 4 MiB limit
    cases = []
    for i in range(40):
        cut = rng.randrange(4, len(valid) - 1)  # inside the one ResourceSpans field: always truncated
        cases.append(("truncated-protobuf", "POST", "/v1/traces", PB, valid[:cut], {400}))
        cases.append(("bad-wire-type", "POST", "/v1/traces", PB, b"\xff" + rng.randbytes(rng.randrange(0, 300)), {400}))
        cases.append(("truncated-json", "POST", "/v1/traces", JS, valid_json[:rng.randrange(1, len(valid_json) - 1)],
                      {400}))
        path, body = rng.choice([("/v1/traces", b"[]"), ("/v1/metrics", b"1"), ("/v1/traces", b'"x"'),
                                 ("/v1/metrics", b"null"), ("/v1/traces", b'{"resourceSpans": {"a": 1}}'),
                                 ("/v1/metrics", b'{"resourceMetrics": [1]}'),
                                 ("/v1/traces", b'{"resourceSpans": [{"scopeSpans": 7}]}')])
        cases.append(("json-wrong-shape", "POST", path, JS, body, {400}))
        cases.append(("unauthenticated", "POST", "/v1/traces", {"Content-Type": "application/x-protobuf"}, valid,
                      {401}))
        cases.append(("wrong-token", "POST", "/v1/metrics",
                      {"Content-Type": "application/x-protobuf", "Authorization": rng.choice(
                          ["Bearer " + TOKEN[:-1], "Bearer", "bearer  ", "Basic " + TOKEN, TOKEN, "Bearer \u00e9"])},
                      valid, {401}))
        cases.append(("wrong-content-type", "POST", "/v1/traces",
                      {**AUTH, "Content-Type": rng.choice(["text/plain", "application/xml", "", "multipart/form-data",
                                                           "application/x-protobufx", "json"])}, valid, {415}))
        cases.append(("gzip-bomb", "POST", "/v1/traces", {**PB, "Content-Encoding": "gzip"}, bomb, {413}))
        cases.append(("corrupt-gzip", "POST", "/v1/traces", {**PB, "Content-Encoding": "gzip"},
                      b"\x1f\x8b\x08\x00" + rng.randbytes(rng.randrange(0, 200)), {400}))
        cases.append(("truncated-gzip", "POST", "/v1/traces", {**PB, "Content-Encoding": "gzip"},
                      gzip.compress(valid)[:rng.randrange(10, 60)], {400}))
        cases.append(("unknown-encoding", "POST", "/v1/traces",
                      {**PB, "Content-Encoding": rng.choice(["br", "zstd", "gzip, gzip", "compress"])}, valid, {415}))
        cases.append(("bad-path", rng.choice(["POST", "GET"]),
                      rng.choice(["/", "/v1/logs", "/v1/traces/x", "/%00", "/../etc/passwd", "/v1/" + "a" * 3000]),
                      PB, b"x", {404, 405}))
        cases.append(("bad-method", rng.choice(["PUT", "DELETE", "PATCH", "OPTIONS", "FROB", "TRACE"]), "/v1/traces",
                      PB, b"x", {405}))
        cases.append(("too-many-headers", "POST", "/v1/traces", {**PB, **{f"X-H{j}": "v" for j in range(120)}}, valid,
                      {431}))
    cases.append(("oversized-body", "POST", "/v1/traces", PB, b"\x0a" * (MAX_BODY + 1), {413}))
    return cases


def _client(addr: str, jobs: list, results: dict, errors: list, deadline: float) -> None:
    host, port = addr.rsplit(":", 1)
    conn = None
    for case, method, path, headers, body, allowed in jobs:
        if time.monotonic() > deadline:
            errors.append("time limit")
            return
        for attempt in range(2):
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, int(port), timeout=30)
                conn.request(method, path, body=body, headers=headers)
                r = conn.getresponse()
                r.read()
                status = r.status
                if r.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
                break
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                if conn is not None:
                    conn.close()
                conn = None
                if attempt:  # a fresh connection failed too
                    errors.append(f"{case}: {type(exc).__name__}: {exc}")
                    status = None
        results.setdefault(case, []).append(status)
        if status not in allowed:
            errors.append(f"{case}: HTTP {status} (allowed {sorted(allowed)})")
    if conn is not None:
        conn.close()


RAW = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 40 + b"\r\n\r\n",  # a TLS hello to a plain port
    b"POST /v1/traces HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/traces HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcde",
    b"POST /v1/traces HTTP/1.1\r\nContent-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/traces HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Type: application/x-protobuf\r\n"
    b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"POST /v1/traces HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Type: application/x-protobuf\r\n"
    b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\nfffffff\r\n",
    b"POST /v1/traces HTTP/1.1\r\nContent-Type: application/x-protobuf\r\nAuthorization: Bearer " + TOKEN.encode()
    + b"\r\n\r\n",  # no length
    b"POST /v1/traces HTTP/1.1\r\nContent-Length: 1000\r\nContent-Type: application/x-protobuf\r\n"
    b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\nonly this",  # truncated, then half-closed
    b"POST /v1/traces HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    b"POST /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
]


def _raw(addr: str, n: int, errors: list, statuses: list) -> None:
    host, port = addr.rsplit(":", 1)
    for i in range(n):
        payload = RAW[i % len(RAW)]
        with socket.create_connection((host, int(port)), timeout=30) as s:
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                data = b""
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError as exc:
                errors.append(f"raw {i % len(RAW)}: {exc}")
                continue
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else None
        statuses.append(status)
        if status is None or not 400 <= status < 500:
            errors.append(f"raw {i % len(RAW)}: {data[:80]!r}")


def _grpc_junk(addr: str, n: int, rng: random.Random, errors: list) -> None:
    ok_codes = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    with grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        calls = [ch.unary_unary(f"/opentelemetry.proto.collector.{s}.v1.{S}Service/Export", request_serializer=None,
                                response_deserializer=None) for s, S in (("trace", "Trace"), ("metrics", "Metrics"))]
        for i in range(n):
            kind = i % 3
            md = [] if kind == 0 else [("authorization", f"Bearer {TOKEN}")]
            body = b"\xff" + rng.randbytes(rng.randrange(0, 500)) if kind != 2 else b"\x0a\x80\x80\x80\x03" + b"\0" * (
                5 << 20)
            try:
                calls[i % 2](body, metadata=md, timeout=30)
                errors.append(f"grpc {i}: accepted junk")
            except grpc.RpcError as exc:
                if exc.code() not in ok_codes:
                    errors.append(f"grpc {i}: {exc.code()} {exc.details()}")


def test_hostile_requests(tmp_path):
    rng = random.Random(1234)
    b = BridgeProcess(["--exporters", "discard", "--auth-token-env", "FUZZ_TOKEN", "--max-body-mib", "1",
                       "--max-decompressed-mib", "4", "--max-decompression-ratio", "50", "--idle-timeout", "10",
                       "--prometheus-port", "0", "--batch-delay", "0.05"], clean_env(FUZZ_TOKEN=TOKEN), tmp_path)
    try:
        cases = corpus(rng)
        jobs = [cases[i % len(cases)] for i in range(N_HTTP)]
        rng.shuffle(jobs)
        deadline = time.monotonic() + TIME_LIMIT_S
        results: dict[str, list] = {}
        errors: list[str] = []
        rss = [b.rss_kib()]
        t0 = time.monotonic()
        chunks = [jobs[i:i + 1000] for i in range(0, len(jobs), 1000)]
        for chunk in chunks:  # threads per chunk of 1000, sampling the bridge's RSS in between
            threads = [threading.Thread(target=_client, args=(b.http, chunk[t::THREADS], results, errors, deadline))
                       for t in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert b.proc.poll() is None, b.log()[-3000:]
            rss.append(b.rss_kib())
        raw_statuses: list = []
        _raw(b.http, N_RAW, errors, raw_statuses)
        _grpc_junk(b.grpc, N_GRPC, rng, errors)
        took = time.monotonic() - t0
        rss.append(b.rss_kib())
        total = sum(len(v) for v in results.values()) + len(raw_statuses) + N_GRPC
        print(f"\n{total} hostile requests in {took:.1f}s; bridge RSS KiB: {rss}")
        print({case: sorted(set(v)) for case, v in sorted(results.items())})
        assert not errors, errors[:20]
        assert sum(len(v) for v in results.values()) == N_HTTP and total >= 10_000
        assert b.proc.poll() is None, "the bridge died"
        # memory: bounded overall, and no growth once warmed up (gzip bombs inflate 4 MiB each, 4 at once)
        assert max(rss) < 400 * 1024, rss
        assert rss[-1] - rss[2] < 48 * 1024, rss

        # still serving: a valid request is accepted and delivered
        host, port = b.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/traces", body=encode_spans(log_spans("after", [1])).SerializeToString(), headers=PB)
        assert conn.getresponse().status == 200
        conn.close()
        with urllib.request.urlopen(f"http://{b.http}/readyz", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ready"
    except BaseException:
        b.kill()
        raise
    assert b.terminate() == 0
    summary = b.stopped
    assert summary["exporters"]["discard"]["exported"] == 1  # the one valid log span's record
    assert summary["spans_accepted"] == 1
    assert "internal" not in summary["rejected_by_reason"]
    assert sum(summary["rejected_by_reason"].values()) >= 10_000
    log = b.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
