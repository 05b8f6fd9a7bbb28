"""OTLP/gRPC receiver: ``TraceService/Export`` and ``MetricsService/Export`` on grpcio.

The methods are registered with a generic handler that takes the request as bytes, so gRPC and
HTTP share one decoder.  grpcio's own decompression is off (``grpc.per_message_decompression``):
a compressed message reaches the handler as sent and is inflated by the same code as an HTTP
body (`otel_rl.bridge._inflate`), in bounded steps, within ``max_decompressed_bytes`` and the
inflate ratio (RESOURCE_EXHAUSTED beyond) and under the decompression budget shared with HTTP
(UNAVAILABLE, retried, while it is taken).  The encoding is told by the message's first bytes
(grpcio does not pass ``grpc-encoding`` on): a gzip member starts with ``1f 8b 08``, a zlib stream
(gRPC's ``deflate``) with ``78`` and a valid header check; an OTLP request, whose first field is
field 1 (``0a``), starts with neither.  ``max_receive_message_length`` bounds a message as
received, and grpcio caps concurrent calls (``maximum_concurrent_rpcs``).  Status codes follow the
OTLP specification: INVALID_ARGUMENT for a malformed request (not retried), UNAVAILABLE while busy
or shutting down (retried), UNAUTHENTICATED for a wrong token.

The token is checked before the request message is read: an interceptor looks at the call's
metadata and answers a call without the token from a handler that never asks for the message, so
grpcio neither reads nor inflates what an unauthenticated client sends.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any

from ._inflate import HttpError, decompress
from .core import Busy
from .decode import DecodeError
from .sinks import Raw

_log = logging.getLogger("otel_rl.bridge")

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"


def encoding_of(message: bytes) -> str:
    """The compression of a gRPC message as received (grpcio's decompression off): gzip, deflate or ''."""
    if message[:3] == b"\x1f\x8b\x08":
        return "gzip"
    if len(message) >= 2 and message[0] == 0x78 and not message[1] & 0x20 and (0x7800 | message[1]) % 31 == 0:
        return "deflate"
    return ""


def _signal_of(method: str) -> str:
    return "traces" if method.startswith(f"/{TRACE_SERVICE}/") else "metrics" if METRICS_SERVICE in method else "other"


def _token_first(bridge: Any) -> Any:
    """A server interceptor refusing calls without the bearer token before their message is read."""
    import grpc

    def refuse(request_iterator: Any, context: Any) -> bytes:  # never iterates: the message stays unread
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return b""  # pragma: no cover - abort raises

    class TokenFirst(grpc.ServerInterceptor):
        def intercept_service(self, continuation: Any, details: Any) -> Any:
            auth = None
            for k, v in details.invocation_metadata or ():
                if k == "authorization":
                    auth = v
            if bridge.authorized(auth):
                return continuation(details)
            bridge.counters.request("grpc", _signal_of(details.method or ""), "rejected", "unauthorized")
            return grpc.stream_unary_rpc_method_handler(refuse)

    return TokenFirst()


class GrpcReceiver:
    def __init__(self, bridge: Any, address: tuple[str, int]):
        import grpc

        self._grpc = grpc
        self.bridge = bridge
        s = bridge.settings
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max(1, s.grpc_workers), thread_name_prefix="otel-rl-bridge-grpc"),
            options=[
                ("grpc.max_receive_message_length", int(s.max_decompressed_bytes)),
                ("grpc.per_message_decompression", 0),  # inflated by us, under the budget
                ("grpc.max_send_message_length", 1 << 20),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=max(1, s.max_connections),
            interceptors=[_token_first(bridge)] if bridge._token is not None else None,
        )
        handlers = [
            grpc.method_handlers_generic_handler(
                TRACE_SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(self._export("traces"))}
            ),
            grpc.method_handlers_generic_handler(
                METRICS_SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(self._export("metrics"))}
            ),
        ]
        self.server.add_generic_rpc_handlers(handlers)
        host, port = address
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if s.tls_cert:
            with open(s.tls_key, "rb") as f:
                key = f.read()
            with open(s.tls_cert, "rb") as f:
                cert = f.read()
            bound = self.server.add_secure_port(target, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = self.server.add_insecure_port(target)
        if not bound:
            raise OSError(f"cannot listen for gRPC on {target}")
        self.host, self.port = host, bound
        self.server.start()

    def _export(self, signal: str) -> Any:
        grpc = self._grpc
        bridge = self.bridge
        if signal == "traces":
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse as Resp
        else:
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
                ExportMetricsServiceResponse as Resp,
            )
        path = f"/v1/{signal}"

        def export(request: bytes, context: Any) -> bytes:
            counters = bridge.counters
            if bridge._token is not None:
                auth = None
                for k, v in context.invocation_metadata() or ():
                    if k == "authorization":
                        auth = v
                if not bridge.authorized(auth):
                    counters.request("grpc", signal, "rejected", "unauthorized")
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            if not bridge.enter():
                counters.request("grpc", signal, "rejected", "shutting_down")
                context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
            code = message = None
            settings = bridge.settings
            lease = bridge.inflate_budget.lease()
            try:
                counters.add(counters.bytes, ("grpc", signal), len(request))
                encoding = encoding_of(request)
                body = decompress(
                    request, encoding, settings.max_decompressed_bytes, settings.max_decompression_ratio, lease
                )
                result = bridge.ingest(
                    signal,
                    body,
                    json_body=False,
                    transport="grpc",
                    raw=Raw(path, request, "application/x-protobuf", encoding),
                )
            except HttpError as exc:
                lease.close()  # (what a refused message inflated to is already freed: see decompress)
                counters.request("grpc", signal, "rejected", exc.reason)
                code = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED
                    if exc.code == 413
                    else grpc.StatusCode.UNAVAILABLE
                    if exc.code == 503
                    else grpc.StatusCode.INVALID_ARGUMENT
                )
                message = exc.message
            except DecodeError as exc:
                counters.request("grpc", signal, "rejected", "malformed")
                code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
            except Busy as exc:
                counters.request("grpc", signal, "rejected", "busy")
                code, message = grpc.StatusCode.UNAVAILABLE, str(exc)
            except Exception:
                _log.exception("otel-rl bridge: error while handling gRPC %s", signal)
                counters.request("grpc", signal, "rejected", "internal")
                code, message = grpc.StatusCode.INTERNAL, "internal error"
            finally:
                lease.close()
                bridge.leave()
            if code is not None:
                context.abort(code, message)
            counters.request("grpc", signal, "accepted", "")
            resp = Resp()
            if signal == "traces" and (result.rejected or result.error_message):
                resp.partial_success.rejected_spans = result.rejected
                resp.partial_success.error_message = result.error_message
            return resp.SerializeToString()

        return export

    def stop(self, grace_s: float) -> None:
        self.server.stop(grace_s).wait(grace_s + 1.0)
