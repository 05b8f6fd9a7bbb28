"""`otlp`: the official OpenTelemetry OTLP exporters (gRPC or HTTP/protobuf).

Protocol: config ``otlp_protocol`` > ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` >
``OTEL_EXPORTER_OTLP_PROTOCOL`` > ``http/protobuf``.  Endpoint: config
``otlp_endpoint`` (a base URL for HTTP, ``host:port`` for gRPC) or the
exporters' own ``OTEL_EXPORTER_OTLP_*`` variables, which they read themselves.
Spans go through our delivery queue (batched, retried); metrics through a
periodic reader (``OTEL_METRIC_EXPORT_INTERVAL``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .base import Exporter

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter
    from opentelemetry.sdk.trace.export import SpanExporter

PROTOCOLS = ("grpc", "http/protobuf")


def _protocol(config: Any) -> str:
    p = (
        (
            getattr(config, "otlp_protocol", None)
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        .strip()
        .lower()
    )
    if p == "http":
        p = "http/protobuf"
    if p not in PROTOCOLS:
        raise ValueError(f"unsupported OTLP protocol {p!r}; use one of {', '.join(PROTOCOLS)}")
    return p


def _headers(config: Any) -> dict[str, str] | None:
    raw = getattr(config, "otlp_headers", None)
    if not raw:
        return None
    out = {}
    for part in raw.split(","):
        k, _, v = part.partition("=")
        if k.strip():
            out[k.strip()] = v.strip()
    return out


class OtlpExporter(Exporter):
    wants_spans = True
    wants_records = False

    def __init__(self, config: Any = None):
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        self.protocol = _protocol(config)
        endpoint = getattr(config, "otlp_endpoint", None)
        headers = _headers(config)
        if self.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

            insecure = None
            if endpoint and endpoint.startswith("http://"):
                insecure = True
            self._spans: SpanExporter = GrpcSpans(endpoint=endpoint, headers=headers, insecure=insecure)
            self._metrics: MetricExporter = GrpcMetrics(endpoint=endpoint, headers=headers, insecure=insecure)
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

            base = endpoint.rstrip("/") if endpoint else None
            self._spans = HttpSpans(endpoint=f"{base}/v1/traces" if base else None, headers=headers)
            self._metrics = HttpMetrics(endpoint=f"{base}/v1/metrics" if base else None, headers=headers)
        self._reader = PeriodicExportingMetricReader(self._metrics)

    def export_spans(self, spans: Sequence[Any]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        result = self._spans.export(list(spans))
        if result != SpanExportResult.SUCCESS:
            raise ConnectionError(f"OTLP span export failed ({self.protocol})")

    def metric_readers(self) -> list[Any]:
        return [self._reader]

    def flush(self, timeout_s: float = 10.0) -> None:
        self._spans.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._spans.shutdown()
