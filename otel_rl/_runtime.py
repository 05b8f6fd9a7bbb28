"""What the decorators see of the running pipeline: one narrow object, read on every call.

`active` is the current handle's `Runtime` (`otel_rl.init` installs it, shutdown puts `NULL` back); with
nothing initialised it is `NULL`, whose `tracing` is False, so a decorated call only pays for that test.
The runtime is the handle's own (`Handle.runtime`), not a copy of it: `tracing` lives here, and what the
decorators do to the pipeline (an untraced trajectory's statistics, a token2text job, a rollout's start
and end) goes through its methods, never through the pipeline's fields.
"""

from __future__ import annotations

import copyreg
import time
from contextvars import ContextVar
from typing import Any

from ._items import TrajectoryStat
from .serialize import DEFAULT_MAX_CHARS


def _same_in_this_process(name: str) -> Any:
    return globals()[name]


class Runtime:
    __slots__ = ("handle", "config", "tracing", "tracer", "light", "sampler", "tokenizer", "_pipeline", "_rollouts")

    def __init__(self, handle: Any, pipeline: Any, tracing: bool) -> None:
        self.handle = handle  # otel_rl.Handle: `otel_rl.current()`
        self.config = handle.config  # max_value_chars, token2text, experiment (as `update` leaves them)
        self.tracing = tracing
        self.tracer = handle.tracer
        self.light = handle.light  # otel_rl._lightspan.LightTracer: step, timer, trajectory and op spans
        self.sampler = handle.sampler
        self.tokenizer = handle.tokenizer
        self._pipeline = pipeline
        rollouts = pipeline.rollouts
        self._rollouts = rollouts if rollouts.defer_s > 0 else None

    def untraced_trajectory(self, t0_ns: int, validate: bool, error: bool) -> None:
        """A trajectory that was not traced, started at `t0_ns` and ending now: its duration and outcome,
        for the metrics (if read)."""
        p = self._pipeline
        if p.instruments is not None:
            p.submit(TrajectoryStat((time.time_ns() - t0_ns) / 1e9, validate, error))

    def decode_later(self, span: Any, entry: tuple) -> None:
        """token2text: `span`'s output has ids to decode off this thread (the job stays in the span)."""
        span._decode = entry

    def rollout_started(self) -> None:
        r = self._rollouts
        if r is not None:
            r.started()

    def rollout_ended(self) -> None:
        r = self._rollouts
        if r is not None:
            r.ended()

    def __reduce__(self) -> Any:
        # shipped by value (Ray, cloudpickle): the receiving process's own runtime
        return (_current, ())


class _NullConfig:
    """What the decorators read of the config while nothing is initialised (a call in flight at shutdown)."""

    __slots__ = ()
    max_value_chars = DEFAULT_MAX_CHARS
    token2text = False
    experiment = ""


class NullRuntime(Runtime):
    """Nothing initialised (or shut down, or a forked child): nothing is traced, nothing is kept."""

    def __init__(self) -> None:
        self.handle = None
        self.config = _NullConfig()
        self.tracing = False
        self.tracer = self.light = self.sampler = self.tokenizer = None
        self._pipeline = self._rollouts = None

    def untraced_trajectory(self, t0_ns: int, validate: bool, error: bool) -> None:
        pass

    def decode_later(self, span: Any, entry: tuple) -> None:
        pass


NULL = NullRuntime()
#: the current handle's runtime (NULL when there is none); read as `_runtime.active`, never imported by name
active: Runtime = NULL


def _current() -> Runtime:
    return active


def install(rt: Runtime) -> None:
    global active
    active = rt


def uninstall() -> None:
    global active
    active = NULL


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
