"""OTLP/HTTP receiver on the standard library's `ThreadingHTTPServer`.

``POST /v1/traces`` and ``POST /v1/metrics`` with ``application/x-protobuf`` or
``application/json`` bodies, ``Content-Encoding`` gzip / deflate / identity; ``GET /healthz``
and ``GET /readyz``.  HTTP/1.1 with keep-alive (the OTLP exporters keep their connection).

Hostile input never gets further than a 4xx with a short reason: a wrong token (401, answered
before the body is read, and the connection closed), a body larger than ``max_body_bytes`` (413,
refused from its Content-Length before it is read), a body that inflates beyond
``max_decompressed_bytes`` or ``max_decompression_ratio`` (413, inflated in bounded steps under
one budget shared by all requests, `otel_rl.bridge._inflate`), a truncated or corrupt compressed
body (400), a body that is not OTLP (400), a wrong content type (415).  Connections are capped
(``max_connections``); an idle one is closed after ``idle_timeout_s`` and a request (its line,
headers and body) must arrive whole within ``request_timeout_s`` of its first byte (408 and
close beyond), so a client that trickles bytes cannot hold a connection; TLS handshakes happen on
the connection's own thread, within the same time.  Errors are logged at debug level; the client
never sees a traceback.
"""

from __future__ import annotations

import io
import json
import logging
import select
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ._inflate import HttpError, decompress
from .core import Busy
from .decode import DecodeError
from .sinks import Raw

__all__ = ["HttpError", "HttpReceiver", "decompress", "tls_context"]

_log = logging.getLogger("otel_rl.bridge")

PATHS = {"/v1/traces": "traces", "/v1/metrics": "metrics"}
_PROTOBUF = ("application/x-protobuf", "application/protobuf", "application/vnd.google.protobuf")
_JSON = ("application/json",)
# google.rpc.Code for the Status body of an error (OTLP/HTTP: the body of an error is a Status)
_RPC_CODE = {400: 3, 401: 16, 404: 5, 405: 12, 408: 4, 411: 3, 413: 8, 415: 3, 429: 8, 431: 3, 500: 13, 503: 14}
_MAX_LINE = 65536


def _media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def _error_body(code: int, message: str, media: str) -> tuple[bytes, str]:
    rpc = _RPC_CODE.get(code, 2)
    if media in _PROTOBUF:
        try:
            from google.rpc import status_pb2

            return status_pb2.Status(code=rpc, message=message).SerializeToString(), "application/x-protobuf"
        except Exception:  # pragma: no cover - googleapis-common-protos comes with the OTLP exporters
            pass
    if media in _JSON:
        return json.dumps({"code": rpc, "message": message}).encode(), "application/json"
    return (message + "\n").encode("utf-8", "replace"), "text/plain; charset=utf-8"


def _success_body(signal: str, media: str, rejected: int, error_message: str) -> tuple[bytes, str]:
    if media in _JSON:
        body: dict[str, Any] = {}
        if rejected or error_message:
            field = "rejectedSpans" if signal == "traces" else "rejectedDataPoints"
            body["partialSuccess"] = {field: str(rejected), "errorMessage": error_message}
        return json.dumps(body).encode(), "application/json"
    if signal == "traces":
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        resp = ExportTraceServiceResponse()
        if rejected or error_message:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = error_message
    else:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

        resp = ExportMetricsServiceResponse()
    return resp.SerializeToString(), "application/x-protobuf"


class _Late(TimeoutError):
    """The request did not arrive whole within its time."""


class _DeadlineSocketReader(io.RawIOBase):
    """The connection's socket as the handler reads it: while a request arrives, no read waits
    past the request's deadline, however the client spaces its bytes; between requests a read
    waits for the idle timeout."""

    def __init__(self, sock: Any, idle_s: float):
        super().__init__()
        self.sock = sock
        self.idle_s = idle_s
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self.deadline is None:
            return self.sock.recv_into(buf)
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Late("request not received in time")
        self.sock.settimeout(min(self.idle_s, left))
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise _Late("request not received in time") from None
            raise

    def arm(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline = None
            self.sock.settimeout(self.idle_s)


def _handshake(sock: ssl.SSLSocket, seconds: float) -> None:
    """The TLS handshake, whole within `seconds` (a blocking handshake waits per read, not in all)."""
    deadline = time.monotonic() + seconds
    timeout = sock.gettimeout()
    sock.setblocking(False)
    want: tuple[list[socket.socket], list[socket.socket]]
    try:
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                want = ([sock], [])
            except ssl.SSLWantWriteError:
                want = ([], [sock])
            left = deadline - time.monotonic()
            if left <= 0 or not any(select.select(want[0], want[1], [], left)[:2]):
                raise _Late("TLS handshake not done in time")
    finally:
        sock.settimeout(timeout)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "otel-rl-bridge"
    sys_version = ""
    disable_nagle_algorithm = True
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s\n"
    server: _Server
    rfile: io.BufferedReader  # (ours, made in setup)

    # -- connection ----------------------------------------------------------------------
    def setup(self) -> None:
        settings = self.server.settings
        self.timeout = settings.idle_timeout_s  # type: ignore[misc]  # typeshed: a ClassVar; socketserver reads it per instance
        self.request.settimeout(self.timeout)
        if isinstance(self.request, ssl.SSLSocket):
            _handshake(self.request, min(settings.idle_timeout_s, settings.request_timeout_s))
        super().setup()
        self.rfile.close()  # the stdlib's reader waits per read; ours also in all (a request's deadline)
        self._reader = _DeadlineSocketReader(self.request, settings.idle_timeout_s)
        self.rfile = io.BufferedReader(self._reader, 65536)
        self.server.track(self.request, idle=True)

    def finish(self) -> None:
        self.server.untrack(self.request)
        try:
            super().finish()
        except OSError:
            pass
        if getattr(self, "_linger", False):
            self._lingering_close()

    def _lingering_close(self) -> None:
        """After refusing a body unread: let the client finish sending so it reads our answer."""
        import time

        sock = self.request
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.5)
            deadline = time.monotonic() + 2.0
            left = self.server.settings.max_decompressed_bytes
            while left > 0 and time.monotonic() < deadline:
                data = sock.recv(65536)
                if not data:
                    break
                left -= len(data)
        except (OSError, ValueError):
            pass

    def handle_one_request(self) -> None:
        # BaseHTTPRequestHandler.handle_one_request, plus: idle/busy tracking for shutdown,
        # unknown methods -> 405 (not 501), and every socket error ends the connection quietly
        self._body_read = False
        self._linger = False
        self._answered = False
        self._media = ""
        try:
            self.server.track(self.request, idle=True)
            self._reader.disarm()
            if not self.rfile.peek(1):  # waits for the next request's first byte (idle timeout)
                self.close_connection = True
                return
            self._reader.arm(self.server.settings.request_timeout_s)
            self.server.track(self.request, idle=False)
            self.raw_requestline = self.rfile.readline(_MAX_LINE + 1)
            if not self.raw_requestline:
                self.close_connection = True
                return
            if len(self.raw_requestline) > _MAX_LINE:
                self.requestline = ""
                self.request_version = ""
                self.command = ""
                self.send_error(414)
                return
            if not self.parse_request():
                return
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self._fail(405, "method_not_allowed", f"method {self.command[:20]!r} not allowed")
                return
            method()
            self.wfile.flush()
        except _Late:
            self.close_connection = True
            self._too_late()
        except TimeoutError:
            self.close_connection = True
        except (OSError, ssl.SSLError, ValueError):
            self.close_connection = True

    def _too_late(self) -> None:
        """A request that did not arrive whole in time: 408 (when nothing was answered yet), then close."""
        self.counted("request_timeout")
        _log.debug(
            "otel-rl bridge http %s: request not received within %ss; closing",
            self.client_address[0],
            self.server.settings.request_timeout_s,
        )
        if getattr(self, "_answered", False):
            return
        try:
            self.request.settimeout(1.0)
            self.request.sendall(
                b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
                b"Content-Length: 28\r\nConnection: close\r\n\r\nrequest not received in time\n"
            )
        except (OSError, ValueError):
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # the stdlib parser's errors (bad request line, too many/long headers, bad version):
        # always a short 4xx and the connection closed
        if code >= 500:
            code = 400
        self._reader.disarm()
        self.counted(f"http_{code}")
        if getattr(self, "request_version", "HTTP/0.9") in ("HTTP/0.9", ""):
            self.request_version = "HTTP/1.1"  # answer with a status line even to a garbage request line
        try:
            from http import HTTPStatus

            super().send_error(code, HTTPStatus(code).phrase, None)  # never echo the request back
        except OSError:
            pass
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        _log.debug("otel-rl bridge http %s: " + format, self.client_address[0], *args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002
        _log.debug("otel-rl bridge http %s: " + format, self.client_address[0], *args)

    # -- responses -------------------------------------------------------------------------
    def counted(self, reason: str, outcome: str = "rejected") -> None:
        signal = PATHS.get(self.path.split("?", 1)[0], "other") if getattr(self, "path", None) else "other"
        self.server.bridge.counters.request("http", signal, outcome, reason)

    def _send(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None, close: bool = False
    ) -> None:
        self._reader.disarm()  # what is left to read of a refused body is not read under the deadline
        self._answered = True
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close or self.server.bridge._draining:
            self.send_header("Connection", "close")
            self.close_connection = True
            if not self._body_read:
                self._linger = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _fail(
        self, code: int, reason: str, message: str, headers: dict[str, str] | None = None, close: bool = False
    ) -> None:
        self.counted(reason)
        if not self._body_read and not close:
            close = not self._discard_body()
        body, ctype = _error_body(code, message, self._media)
        self._send(code, body, ctype, headers, close)

    # -- bodies ------------------------------------------------------------------------------
    def _content_length(self) -> int | None:
        te = self.headers.get("Transfer-Encoding")
        cl = self.headers.get_all("Content-Length") or []
        if te is not None:
            if cl:
                raise HttpError(400, "bad_framing", "both Content-Length and Transfer-Encoding", close=True)
            if te.strip().lower() != "chunked":
                raise HttpError(400, "bad_framing", "unsupported Transfer-Encoding", close=True)
            return None
        if not cl:
            raise HttpError(411, "length_required", "Content-Length required", close=True)
        first = cl[0].strip()
        if len(set(v.strip() for v in cl)) != 1 or not (first.isascii() and first.isdigit() and len(first) <= 20):
            raise HttpError(400, "bad_framing", "invalid Content-Length", close=True)
        return int(first)

    def _read_body(self) -> bytes:
        limit = self.server.settings.max_body_bytes
        n = self._content_length()
        if n is not None:
            if n > limit:
                raise HttpError(413, "too_large", f"body larger than {limit} bytes", close=True)
            body = self.rfile.read(n)
            if len(body) != n:
                raise HttpError(400, "truncated", "body shorter than Content-Length", close=True)
            self._body_read = True
            return body
        chunks = []
        total = 0
        while True:
            line = self.rfile.readline(_MAX_LINE + 1)
            if not line.endswith(b"\n"):
                raise HttpError(400, "bad_framing", "bad chunk header", close=True)
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpError(400, "bad_framing", "bad chunk size", close=True) from None
            if size < 0:
                raise HttpError(400, "bad_framing", "bad chunk size", close=True)
            if size == 0:
                break
            total += size
            if total > limit:
                raise HttpError(413, "too_large", f"body larger than {limit} bytes", close=True)
            data = self.rfile.read(size)
            if len(data) != size or self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise HttpError(400, "bad_framing", "truncated chunk", close=True)
            chunks.append(data)
        for _ in range(100):  # trailers
            line = self.rfile.readline(_MAX_LINE + 1)
            if line in (b"\r\n", b"\n", b""):
                break
        else:
            raise HttpError(400, "bad_framing", "too many trailers", close=True)
        self._body_read = True
        return b"".join(chunks)

    def _discard_body(self) -> bool:
        """Read and drop the body of a refused request, to keep the connection; False: close it."""
        try:
            n = self._content_length()
        except HttpError:
            return False
        if n is None or n > self.server.settings.max_body_bytes:
            return False
        try:
            got = self.rfile.read(n) if n else b""
        except OSError:
            return False
        self._body_read = True
        return len(got) == n

    # -- methods -----------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        bridge = self.server.bridge
        if self.headers.get("Content-Length") is None and self.headers.get("Transfer-Encoding") is None:
            self._body_read = True  # no body
        elif not self._discard_body():  # a GET with a body: read it, or close after answering
            self.close_connection = True
            self._body_read = True
        if path == "/healthz":
            self._send(200, b'{"status":"ok"}\n', "application/json")
        elif path == "/readyz":
            ok, why = bridge.ready()
            body = json.dumps({"status": "ready" if ok else "not ready", "reason": why}).encode() + b"\n"
            self._send(200 if ok else 503, body, "application/json")
        elif path in PATHS:
            self._fail(405, "method_not_allowed", "use POST", {"Allow": "POST"})
        else:
            self._fail(404, "not_found", "not found")

    do_HEAD = do_GET

    def do_POST(self) -> None:
        bridge = self.server.bridge
        settings = self.server.settings
        path = self.path.split("?", 1)[0]
        signal = PATHS.get(path)
        self._media = _media_type(self.headers.get("Content-Type"))
        if signal is None:
            self._fail(404, "not_found", "unknown path; OTLP/HTTP paths are /v1/traces and /v1/metrics")
            return
        if not bridge.authorized(self.headers.get("Authorization")):
            # answered before the body, which is never read (the connection closes after the answer)
            self._fail(401, "unauthorized", "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}, close=True)
            return
        if not bridge.enter():
            self._fail(503, "shutting_down", "shutting down", {"Retry-After": "5"}, close=True)
            return
        lease = bridge.inflate_budget.lease()
        try:
            try:
                raw = self._read_body()
                bridge.counters.add(bridge.counters.bytes, ("http", signal), len(raw))
                media = self._media
                if media in _PROTOBUF:
                    json_body = False
                elif media in _JSON:
                    json_body = True
                else:
                    raise HttpError(
                        415, "unsupported_media_type", "Content-Type must be application/x-protobuf or application/json"
                    )
                encoding = self.headers.get("Content-Encoding") or ""
                body = decompress(
                    raw, encoding, settings.max_decompressed_bytes, settings.max_decompression_ratio, lease
                )
                result = bridge.ingest(
                    signal,
                    body,
                    json_body=json_body,
                    transport="http",
                    raw=Raw(path, raw, self.headers.get("Content-Type") or "", encoding),
                )
            except HttpError as exc:
                lease.close()  # (what a refused body inflated to is already freed: see decompress)
                self._fail(exc.code, exc.reason, exc.message, exc.headers, close=exc.close)
                return
            except DecodeError as exc:
                self._fail(400, "malformed", str(exc))
                return
            except Busy as exc:
                self._fail(503, "busy", str(exc), {"Retry-After": "1"})
                return
            except (OSError, ssl.SSLError):
                raise
            except Exception:  # a bug of ours: logged here, a short 500 there
                _log.exception("otel-rl bridge: error while handling %s", path)
                self._fail(500, "internal", "internal error", close=True)
                return
            self.counted("", outcome="accepted")
            body_out, ctype = _success_body(signal, self._media, result.rejected, result.error_message)
            self._send(200, body_out, ctype)
        finally:
            lease.close()
            bridge.leave()

    def _method_not_allowed(self) -> None:
        self._fail(405, "method_not_allowed", "method not allowed", {"Allow": "POST, GET"})

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], bridge: Any, ssl_ctx: ssl.SSLContext | None):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.bridge = bridge
        self.settings = bridge.settings
        self.ssl_ctx = ssl_ctx
        self._lock = threading.Lock()
        self._conns: dict[Any, bool] = {}  # socket -> idle
        self._nconn = 0
        self._closing = False
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # not HTTPServer.server_bind: it resolves our own name (getfqdn), which can stall
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = port

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = self.socket.accept()
        if self.ssl_ctx is not None:
            sock = self.ssl_ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._lock:
            if self._nconn < self.settings.max_connections and not self._closing:
                self._nconn += 1
                return True
        try:  # over the limit: a short answer, then close (this runs on the accept thread: no waiting)
            request.setblocking(False)
            if not isinstance(request, ssl.SSLSocket):
                request.send(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
                    b"Connection: close\r\n\r\n"
                )
        except OSError:
            pass
        self.bridge.counters.request("http", "other", "rejected", "too_many_connections")
        return False

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._nconn -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("otel-rl bridge http: connection from %s ended with an error", client_address, exc_info=True)

    def track(self, sock: Any, idle: bool) -> None:
        with self._lock:
            self._conns[sock] = idle
            closing = self._closing
        if closing and idle:
            raise ConnectionAbortedError("shutting down")

    def untrack(self, sock: Any) -> None:
        with self._lock:
            self._conns.pop(sock, None)

    def close_idle(self) -> None:
        """Shutting down: end keep-alive connections that wait for a next request."""
        with self._lock:
            self._closing = True
            idle = [s for s, is_idle in self._conns.items() if is_idle]
        for s in idle:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class HttpReceiver:
    def __init__(self, bridge: Any, address: tuple[str, int]):
        s = bridge.settings
        ctx = tls_context(s.tls_cert, s.tls_key) if s.tls_cert else None
        self.server = _Server(address, bridge, ctx)
        self.host, self.port = self.server.server_address[:2]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, name="otel-rl-bridge-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.server.shutdown()  # the accept loop ends; handler threads finish their request
            self._thread = None
        self.server.close_idle()
        self.server.server_close()
