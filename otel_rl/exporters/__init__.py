"""Core exporters (console, jsonl/file, otlp, prometheus) and the plug-in contract."""

from .base import Exporter

__all__ = ["Exporter"]
