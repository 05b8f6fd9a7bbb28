"""otel-rl exporter for Weave: ``actor_rollout_ref.rollout.trace.backend=weave``.

Each sampled trajectory becomes a tree of Weave calls (op name, inputs,
outputs, exception, start/end times, verl's attributes step / sample_index /
rollout_n / experiment_name / validate).  See README.md.
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from ._exporter import META_KEY, WeaveExporter, call_id, call_inputs, call_output, exception_info

#: ``OTEL_TRACES_EXPORTER=weave opentelemetry-instrument ...`` (entry point group
#: ``opentelemetry_traces_exporter``)
WeaveSpanExporter = span_exporter_class("weave")
WeaveSpanExporter.__module__ = __name__

__all__ = ["META_KEY", "WeaveExporter", "WeaveSpanExporter", "call_id", "call_inputs", "call_output", "exception_info"]
