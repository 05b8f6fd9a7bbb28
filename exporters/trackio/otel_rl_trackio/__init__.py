"""otel-rl exporter for Trackio: ``trainer.logger=["trackio"]``.

Step metrics (one Trackio row per ``log()`` call), the run config and validation
generations (Trackio traces, as verl logs them) go to Trackio's local store the
way verl's ``Tracking`` logs them.  See README.md.
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from ._exporter import TrackioExporter

#: ``OTEL_TRACES_EXPORTER=trackio opentelemetry-instrument ...`` (entry point group
#: ``opentelemetry_traces_exporter``)
TrackioSpanExporter = span_exporter_class("trackio")
TrackioSpanExporter.__module__ = __name__

__all__ = ["TrackioExporter", "TrackioSpanExporter"]
