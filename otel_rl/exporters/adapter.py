"""Use an otel-rl exporter as a plain OpenTelemetry `SpanExporter`.

For ``OTEL_TRACES_EXPORTER=mlflow opentelemetry-instrument python train.py``:
the OpenTelemetry distro loads the class registered under the
``opentelemetry_traces_exporter`` entry-point group and calls it with no
arguments.  `span_exporter_class("mlflow")` builds such a class: it resolves its
settings from the environment (``OTEL_RL_*``), turns spans into records with the
same `RecordBuilder` as the in-process pipeline, and hands them to the exporter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ..records import RecordBuilder

_log = logging.getLogger("otel_rl")


def span_exporter_class(name: str) -> type[SpanExporter]:
    class _RecordsSpanExporter(SpanExporter):
        exporter_name = name

        def __init__(self, **settings: Any):
            from ..config import resolve
            from . import registry

            self._config = resolve(**settings)
            self._exporter = registry.create(name, self._config)
            self._exporter.wants_trajectories = True  # the trace pipeline is what this adapter serves
            self._builder = RecordBuilder()
            self._lock = threading.Lock()

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            with self._lock:
                try:
                    records = self._builder.build(spans)
                    if records:
                        self._exporter.export_records(records)
                    if self._exporter.wants_spans:
                        self._exporter.export_spans(spans)
                    return SpanExportResult.SUCCESS
                except Exception as exc:
                    _log.warning("otel-rl: %s span exporter failed: %s", name, exc)
                    return SpanExportResult.FAILURE

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            self._exporter.flush(timeout_millis / 1000)
            return True

        def shutdown(self) -> None:
            with self._lock:
                try:
                    rest = self._builder.flush_partial()
                    if rest:
                        self._exporter.export_records(rest)
                finally:
                    self._exporter.shutdown()

    _RecordsSpanExporter.__name__ = f"{name.capitalize()}SpanExporter"
    _RecordsSpanExporter.__qualname__ = _RecordsSpanExporter.__name__
    return _RecordsSpanExporter
