"""otel-rl exporter for MLflow.

Registered as ``mlflow`` in the entry-point group ``otel_rl.exporters``
(``trainer.logger=[console,mlflow]``, ``actor_rollout_ref.rollout.trace.backend=mlflow``)
and in ``opentelemetry_traces_exporter``
(``OTEL_TRACES_EXPORTER=mlflow opentelemetry-instrument python train.py``).
MLflow itself is imported on first use, on the exporter's delivery thread.
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from ._exporter import GENERATIONS_TABLE, RUN_ID_TAG, MlflowExporter
from ._keys import KeyMapper, is_valid_key, verl_sanitize
from ._run import DEFAULT_TRACKING_URI, INF_METRICS_TAG, resolve_tracking_uri
from ._traces import SPAN_TYPES, mlflow_trace_id

#: an OpenTelemetry `SpanExporter` class (no-argument constructor) feeding `MlflowExporter`
MlflowSpanExporter = span_exporter_class("mlflow")

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TRACKING_URI",
    "GENERATIONS_TABLE",
    "INF_METRICS_TAG",
    "KeyMapper",
    "MlflowExporter",
    "MlflowSpanExporter",
    "RUN_ID_TAG",
    "SPAN_TYPES",
    "is_valid_key",
    "mlflow_trace_id",
    "resolve_tracking_uri",
    "verl_sanitize",
]
