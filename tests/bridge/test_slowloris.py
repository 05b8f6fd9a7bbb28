"""Clients that trickle a request (one header line, or one body byte, at a time, each well inside
the idle timeout) against a real `otel-rl bridge` process: each is answered 408 and closed once its
request has taken ``--request-timeout``, so while they fill ``--max-connections`` an authenticated
sender (the official OTLP/HTTP exporter) is only delayed, and its data reaches MLflow.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

mlflow = pytest.importorskip("mlflow")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402

from .helpers import BridgeProcess, clean_env, log_spans, tracker_env  # noqa: E402

pytestmark = pytest.mark.slow
TOKEN = "tok-" + uuid.uuid4().hex
REQUEST_TIMEOUT_S = 3.0
SLOTS = 8
GIVE_UP_S = 25.0  # an attacker stops trickling after this long (the bridge should have closed it long before)


class Trickler(threading.Thread):
    """One slow client: its request's first bytes, then one more piece every `every_s` seconds."""

    def __init__(self, addr: str, head: bytes, pieces: list[bytes], every_s: float = 1.0):
        super().__init__(daemon=True)
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.head, self.pieces, self.every_s = head, pieces, every_s
        self.started_at = 0.0
        self.closed_after: float | None = None  # seconds from its first byte to the bridge closing it
        self.answer = b""
        self.sent_first = threading.Event()

    def run(self) -> None:
        s = self.sock
        self.started_at = time.monotonic()
        s.sendall(self.head)
        self.sent_first.set()
        s.settimeout(self.every_s)
        i = 0
        try:
            while time.monotonic() - self.started_at < GIVE_UP_S:
                try:
                    data = s.recv(4096)
                except socket.timeout:
                    s.sendall(self.pieces[i % len(self.pieces)])  # inside the idle timeout: never idle
                    i += 1
                    continue
                self.answer += data
                if not data:
                    break
        except OSError:
            pass
        if time.monotonic() - self.started_at < GIVE_UP_S:
            self.closed_after = time.monotonic() - self.started_at
        s.close()


def _connection_refused_busy(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        return s.recv(100).startswith(b"HTTP/1.1 503")


def test_trickling_clients_are_closed_in_time_and_cannot_lock_senders_out(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    b = BridgeProcess(["--exporters", "mlflow", "--auth-token-env", "BRIDGE_TOKEN", "--max-connections", str(SLOTS),
                       "--request-timeout", str(REQUEST_TIMEOUT_S), "--idle-timeout", "30", "--batch-delay", "0.1"],
                      clean_env(BRIDGE_TOKEN=TOKEN, **tracker_env(store)), tmp_path)
    project = f"slow-{uuid.uuid4().hex[:6]}"
    try:
        # headers one line a second, no token needed to hold the connection
        attackers = [Trickler(b.http, b"POST /v1/traces HTTP/1.1\r\n", [b"X-Slow-%d: 1\r\n" % i for i in range(99)])
                     for _ in range(SLOTS - 2)]
        # whole headers with the token, then the body one byte a second
        attackers += [Trickler(b.http, b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf"
                               b"\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 1000\r\n\r\n",
                               [b"\n"]) for _ in range(2)]
        for a in attackers:
            a.start()
        for a in attackers:
            assert a.sent_first.wait(10)
        time.sleep(0.3)
        assert _connection_refused_busy(b.http)  # every slot is held by a trickler
        sender = OTLPSpanExporter(endpoint=f"http://{b.http}/v1/traces", headers={"Authorization": f"Bearer {TOKEN}"},
                                  timeout=20)
        t0 = time.monotonic()
        assert sender.export(log_spans("sender", range(10), project=project)) == SpanExportResult.SUCCESS
        waited = time.monotonic() - t0
        sender.shutdown()
        for a in attackers:
            a.join(GIVE_UP_S + 5)
        code = b.terminate()
    except BaseException:
        b.kill()
        raise
    assert code == 0, b.log()[-3000:]
    for a in attackers:
        assert a.closed_after is not None, "a trickling client was never closed"
        assert REQUEST_TIMEOUT_S - 0.5 <= a.closed_after <= REQUEST_TIMEOUT_S + 2.5, a.closed_after
        assert a.answer.startswith(b"HTTP/1.1 408 "), a.answer[:80]
    assert waited < REQUEST_TIMEOUT_S + 8  # delayed by the 503s (retried), not locked out
    assert b.stopped["rejected_by_reason"].get("request_timeout") == SLOTS
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(10))
