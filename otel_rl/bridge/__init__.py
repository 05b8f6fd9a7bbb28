"""OTLP bridge: ``otel-rl bridge`` receives OTLP from trainers (directly or through an
OpenTelemetry Collector) and delivers it to the same tracker exporters as the in-process path.

- `otel_rl.bridge.decode`: OTLP (protobuf and JSON) -> `opentelemetry.sdk.trace.ReadableSpan`
- `otel_rl.bridge.core`: `Bridge` (pipeline, exporters, forwarding, its own metrics), `Settings`
- `otel_rl.bridge.sinks`: the bridge's exporter wrapper (`Delivered`), `DiscardExporter`, `ForwardExporter`
- `otel_rl.bridge.cli`: the command (flags, signals)

See docs/bridge.md.
"""

from __future__ import annotations

from .core import Bridge, Settings  # noqa: F401

__all__ = ["Bridge", "Settings"]
