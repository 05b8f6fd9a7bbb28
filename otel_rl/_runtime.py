"""Process-wide state the decorators read on every call (kept tiny for speed)."""

from __future__ import annotations

import copyreg
from contextvars import ContextVar
from typing import Any


def _same_in_this_process(name: str) -> Any:
    return globals()[name]


class Runtime:
    __slots__ = ("handle", "tracer", "light", "tracing", "pipeline", "sampler", "max_chars", "token2text",
                 "tokenizer", "experiment")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.handle: Any = None
        self.tracer: Any = None
        self.light: Any = None  # otel_rl._lightspan.LightTracer: step, timer, trajectory and op spans
        self.tracing = False
        self.pipeline: Any = None
        self.sampler: Any = None
        self.max_chars = 256 * 1024
        self.token2text = False
        self.tokenizer: Any = None
        self.experiment = ""

    def __reduce__(self) -> Any:
        # decorated functions shipped by value (Ray, cloudpickle) refer to the process's own runtime
        return (_same_in_this_process, ("RT",))


RT = Runtime()

# The trajectory and step the current task/thread is in (None outside).
TRAJECTORY: ContextVar[Any] = ContextVar("otel_rl_trajectory", default=None)
STEP: ContextVar[Any] = ContextVar("otel_rl_step", default=None)


def _reduce_context_var(var: ContextVar) -> Any:
    """Pickle otel-rl's context variables by reference (any other one still cannot be pickled)."""
    for name in ("TRAJECTORY", "STEP"):
        if var is globals()[name]:
            return (_same_in_this_process, (name,))
    raise TypeError(f"cannot pickle 'ContextVar' object {var.name!r}")


copyreg.pickle(ContextVar, _reduce_context_var)
