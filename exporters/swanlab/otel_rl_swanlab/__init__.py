"""otel-rl exporter for SwanLab: ``trainer.logger=["swanlab"]``.

Step metrics (one SwanLab row per step), the run config and validation
generations (an ``echarts.Table`` with verl's columns) go to SwanLab the way
verl's ``Tracking`` logs them.  See README.md.
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from ._exporter import SwanlabExporter, swanlab_project_name
from ._keys import KeyMap, sanitize_key

#: ``OTEL_TRACES_EXPORTER=swanlab opentelemetry-instrument ...`` (entry point group
#: ``opentelemetry_traces_exporter``)
SwanlabSpanExporter = span_exporter_class("swanlab")
SwanlabSpanExporter.__module__ = __name__

__all__ = ["KeyMap", "SwanlabExporter", "SwanlabSpanExporter", "sanitize_key", "swanlab_project_name"]
