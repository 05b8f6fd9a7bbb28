"""otel-rl exporter for ClearML: ``trainer.logger=["clearml"]``.

Scalars (``report_scalar`` with the key split at its first ``/`` into title and
series), the run config (``connect_configuration(..., name="Hyperparameters")``)
and validation generations (``report_table``) go to a ClearML task the way
verl's ``Tracking`` reports them; without a ClearML server configured, the task
is an offline session on disk.  See README.md.
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from ._exporter import ClearmlExporter, offline_mode, split_key

#: ``OTEL_TRACES_EXPORTER=clearml opentelemetry-instrument ...`` (entry point group
#: ``opentelemetry_traces_exporter``)
ClearmlSpanExporter = span_exporter_class("clearml")
ClearmlSpanExporter.__module__ = __name__

__all__ = ["ClearmlExporter", "ClearmlSpanExporter", "offline_mode", "split_key"]
