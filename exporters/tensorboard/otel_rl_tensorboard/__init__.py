"""otel-rl exporter for TensorBoard: ``trainer.logger=["tensorboard"]``.

Step metrics (one scalar per key per ``log()`` call), the run config (text) and
validation generations (a text table per step) go to TensorBoard event files
the way verl's ``Tracking`` writes them, with the ``tensorboard`` package's own
event writer (no TensorFlow, no torch).  See README.md.
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from ._exporter import TensorboardExporter, log_dir

#: ``OTEL_TRACES_EXPORTER=tensorboard opentelemetry-instrument ...`` (entry point group
#: ``opentelemetry_traces_exporter``)
TensorboardSpanExporter = span_exporter_class("tensorboard")
TensorboardSpanExporter.__module__ = __name__

__all__ = ["TensorboardExporter", "TensorboardSpanExporter", "log_dir"]
