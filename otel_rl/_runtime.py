"""Process-wide state the decorators read on every call (kept tiny for speed)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any


class Runtime:
    __slots__ = ("handle", "tracer", "tracing", "pipeline", "sampler", "max_chars", "token2text", "tokenizer",
                 "experiment")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.handle: Any = None
        self.tracer: Any = None
        self.tracing = False
        self.pipeline: Any = None
        self.sampler: Any = None
        self.max_chars = 256 * 1024
        self.token2text = False
        self.tokenizer: Any = None
        self.experiment = ""


RT = Runtime()

# The trajectory and step the current task/thread is in (None outside).
TRAJECTORY: ContextVar[Any] = ContextVar("otel_rl_trajectory", default=None)
STEP: ContextVar[Any] = ContextVar("otel_rl_step", default=None)
