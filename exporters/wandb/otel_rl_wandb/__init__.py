"""otel-rl exporter for Weights & Biases.

``trainer.logger=["console","wandb"]`` (or verl's deprecated ``tracking``) with this
distribution installed sends otel-rl's run config, step metrics and validation
generations to wandb, one wandb run per otel-rl run.  ``OTEL_TRACES_EXPORTER=wandb``
serves the same through the OpenTelemetry SDK (`WandbSpanExporter`).

`otel_rl_wandb.reader.read_run` reads an offline run file back (tests, checks).
"""

from __future__ import annotations

from otel_rl.exporters.adapter import span_exporter_class

from .exporter import EMPTY_KEY, STEP_METRIC, WandbExporter, WandbRun, wandb_run_id

WandbSpanExporter = span_exporter_class("wandb")

__version__ = "0.1.0"
__all__ = ["EMPTY_KEY", "STEP_METRIC", "WandbExporter", "WandbRun", "WandbSpanExporter", "wandb_run_id"]
