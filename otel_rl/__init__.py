"""otel-rl: OpenTelemetry observability for RL / RLHF training of LLMs.

Instrument a trainer once::

    import otel_rl

    with otel_rl.init(project="gsm8k", experiment="grpo-0", logger=["console", "file"]) as h:
        for n in range(steps):
            with otel_rl.step(n):
                with otel_rl.timer("gen"):
                    ...
                otel_rl.log({"actor/pg_loss": loss}, step=n)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import SupportsInt

from ._handle import Handle, __version__
from ._init import current, init
from .config import Config, ConfigError
from .exporters.base import Exporter
from .exporters.registry import UnknownExporterError
from .instrument import annotate, current_step, current_trajectory, generate, op, step, timer, tool, trajectory


def log(data: Mapping[str, object], step: SupportsInt | str | bytes | None = None) -> None:
    """`Handle.log` on the current pipeline (a warning, once, when there is none)."""
    h = current()
    if h is None:
        from . import _init
        from ._values import warn_once

        if _init.forked_from is not None:
            warn_once(
                "log-forked-child",
                "otel-rl: log() in a forked child process (pid %d, forked from %d, whose "
                "otel-rl pipeline does not run in a child): nothing recorded here. Call otel_rl.init() in "
                "the child (with the parent's Handle.worker_env() in its environment to join the same run), or "
                "log from the parent",
                os.getpid(),
                _init.forked_from,
            )
        else:
            warn_once("log-no-init", "otel-rl: log() called before otel_rl.init(); nothing recorded")
        return
    h.log(data, step)


def log_generations(
    samples: Iterable[Sequence[object]], step: SupportsInt | str | bytes | None = None, limit: int | None = None
) -> None:
    h = current()
    if h is not None:
        h.log_generations(samples, step, limit)


def select_samples(step: int | None, sample_indices: Iterable[int], validate: bool = False) -> set[int]:
    h = current()
    return set(sample_indices) if h is None else h.select_samples(step, sample_indices, validate)


def flush(timeout_s: float = 30.0) -> bool:
    h = current()
    return True if h is None else h.flush(timeout_s)


def shutdown() -> None:
    h = current()
    if h is not None:
        h.shutdown()


__all__ = [
    "Config",
    "ConfigError",
    "Exporter",
    "Handle",
    "UnknownExporterError",
    "__version__",
    "annotate",
    "current",
    "current_step",
    "current_trajectory",
    "flush",
    "generate",
    "init",
    "log",
    "log_generations",
    "op",
    "select_samples",
    "shutdown",
    "step",
    "timer",
    "tool",
    "trajectory",
]
