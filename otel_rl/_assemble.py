"""The exporters a configuration names, built in the order it names them: in this process, or as
``("remote", ...)`` entries for the export process."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._values import warn_once
from .config import Config
from .export_process.protocol import IN_EXPORT_PROCESS as _IN_EXPORT_PROCESS
from .exporters import registry
from .exporters.base import Exporter


def end_exporter(e: Any, deadline: float) -> None:
    try:
        e.flush(max(0.1, deadline - time.monotonic()))
    except Exception:
        pass
    try:
        e.shutdown()
    except Exception as exc:
        warn_once(f"shutdown:{e.name}", "otel-rl: exporter %r shutdown failed: %s", e.name, exc)


def build_exporters(cfg: Config, given: Sequence[Exporter]) -> list[Any]:
    """The exporters in order: instances, and ``("remote", name, class, wants_trajectories)`` for the
    ones that run in the export process (``export_process``)."""
    if cfg.disabled:
        return []
    out: list[Any] = []
    mode = "false" if os.environ.get(_IN_EXPORT_PROCESS) == "1" else str(cfg.export_process).lower()
    seen = set()
    for name in cfg.exporter_names():
        canonical = "wandb" if name == "tracking" else name
        if name == "tracking":
            warn_once("tracking-deprecated", "otel-rl: the 'tracking' logger is deprecated; use 'wandb'")
        if canonical in seen:
            continue
        seen.add(canonical)
        if name == cfg.trace_backend and name not in cfg.exporters:
            # a rollout-trace backend otel-rl cannot serve (verl's trackio, a typo, a library not
            # installed) must not stop the metrics: warned, and rollouts are not traced
            try:
                registry.out_of_process_class(canonical)
            except registry.UnknownExporterError as exc:
                warn_once(
                    f"trace-backend:{name}",
                    "otel-rl: rollout trace backend %r cannot be used (%s); training goes on without rollout traces",
                    name,
                    exc,
                )
                cfg.trace_backend = None
                continue
        cls = registry.out_of_process_class(canonical) if mode != "false" else None
        if cls is not None and mode == "auto":
            # auto: out of process unless the training process already uses the tracker's library
            # itself (wandb.log on the run, mlflow.set_tracking_uri, weave.init ...): then its run
            # and settings live here, and so does the exporter
            module = registry.REQUIRES.get(canonical)
            if module is None or module in sys.modules or not cls.export_process_auto:
                cls = None
        if cls is not None:
            out.append(("remote", canonical, cls, cls.routing(cfg)))
        else:
            out.append(registry.create(canonical, cfg))
    for e in given:
        if not e.name:
            e.name = type(e).__name__
        out.append(e)
    return out
