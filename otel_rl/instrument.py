"""Decorators and context managers: `step`, `timer`, `trajectory`, `op`, `generate`, `tool`.

Cost model.  With tracing off (no exporter consumes spans, `trace=False`, or an
unsampled trajectory) an `op` is one attribute read and one context-variable
read before calling through; an unsampled trajectory additionally wraps the call
in try/except so that an error is never lost (a trajectory that ends in an error
is always kept).  With tracing on, an op costs one light span (`_lightspan`)
plus a copy of its arguments and result (`serialize.snapshot`: their JSON, or
a cheaper copy turned into JSON where the span is read).  Everything else
happens in the export thread or the export process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import Token
from types import TracebackType
from typing import Any, Literal, SupportsFloat, TypeVar, overload

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.trace import Link, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from . import _runtime
from . import semconv as sc
from ._ops import OFF, SAMPLED, UNSAMPLED, OpMeta, decorator, record_exception
from ._runtime import STEP, TRAJECTORY

#: a decorated function (or method, staticmethod, classmethod): the decorators give it back with its signature
F = TypeVar("F", bound=Callable[..., object])

_time_ns = time.time_ns
_perf = time.perf_counter
_EMPTY_CONTEXT = otel_context.Context()


# ----------------------------------------------------------------------------- helpers


#: the last link made ((span context, [Link to it])): every trajectory of a step links to the same step span
_last_link: tuple[Any, list[Link]] | None = None


def _links_to(ctx: Any) -> list[Link] | None:
    """A one-link list to `ctx` (None for None); the Link object is reused while the target stays the
    same (links are read, never changed; each span copies the list)."""
    global _last_link
    if ctx is None:
        return None
    last = _last_link
    if last is None or last[0] is not ctx:
        last = _last_link = (ctx, [Link(ctx)])
    return last[1]


def _link_target() -> Any:
    st = STEP.get()
    if st is not None and st.span_context is not None:
        return st.span_context
    ctx = trace_api.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


def current_step() -> int | None:
    """The step number of the innermost `step()` block, or None."""
    st = STEP.get()
    return st.n if st is not None else None


# ----------------------------------------------------------------------------- step / timer


class _StepState:
    __slots__ = ("n", "span", "span_context", "timings", "var_token", "ctx_token")
    var_token: Token[Any]
    ctx_token: Token[otel_context.Context]

    def __init__(self, n: int):
        self.n = n
        self.span: Any = None
        self.span_context: Any = None
        self.timings: dict[str, float] = {}


class step:
    """Root span of one training step: ``with otel_rl.step(n): ...``.

    `timer()` blocks inside add ``timing_s/<name>`` to this step's metrics,
    which are logged when the block exits; not when it is interrupted (an exception
    that is not an `Exception` leaves it: Ctrl-C, `sys.exit`, a cancelled task),
    whose timings would be those of a part of a step.
    """

    __slots__ = ("_n", "_st")

    def __init__(self, n: int):
        self._n = int(n)

    def __enter__(self) -> _StepState:
        st = self._st = _StepState(self._n)
        if _runtime.active.tracing:
            st.span = _runtime.active.light.start(sc.SPAN_STEP, None, {sc.RL_STEP: st.n, sc.RL_SPAN_KIND: sc.KIND_STEP})
            st.span_context = st.span.get_span_context()
            st.ctx_token = otel_context.attach(trace_api.set_span_in_context(st.span))
        st.var_token = STEP.set(st)
        return st

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        st = self._st
        if st.timings and _runtime.active.handle is not None and (ev is None or isinstance(ev, Exception)):
            _runtime.active.handle.log(dict(st.timings), step=st.n)  # while the step is current: parented to its span
        STEP.reset(st.var_token)
        if st.span is not None:
            otel_context.detach(st.ctx_token)
            if ev is not None:
                record_exception(st.span, ev)
            st.span.end()
        return False

    async def __aenter__(self) -> _StepState:
        return self.__enter__()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return self.__exit__(et, ev, tb)


class timer:
    """Child span of the current step and a ``timing_s/<name>`` value for that step.

    Repeated timers of one name in a step add up.  When `timing_raw` (verl's
    dict) is given, the seconds are also added to ``timing_raw[name]``.
    """

    __slots__ = ("name", "timing_raw", "_t0", "_span", "_token", "last")

    def __init__(self, name: str, timing_raw: dict[str, float] | None = None):
        self.name = str(name)
        self.timing_raw = timing_raw
        self.last = 0.0

    def __enter__(self) -> timer:
        self._span = None
        if _runtime.active.tracing:
            self._span = _runtime.active.light.start_in_current(
                self.name, {sc.RL_TIMER_NAME: self.name, sc.RL_SPAN_KIND: sc.KIND_TIMER}
            )
            self._token = otel_context.attach(trace_api.set_span_in_context(self._span))
        self._t0 = _perf()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        dt = self.last = _perf() - self._t0
        if self._span is not None:
            otel_context.detach(self._token)
            if ev is not None:
                record_exception(self._span, ev)
            self._span.end()
        st = STEP.get()
        if st is not None:
            key = sc.TIMING_PREFIX + self.name
            st.timings[key] = st.timings.get(key, 0.0) + dt
        if self.timing_raw is not None:
            self.timing_raw[self.name] = self.timing_raw.get(self.name, 0.0) + dt
        return False

    async def __aenter__(self) -> timer:
        return self.__enter__()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return self.__exit__(et, ev, tb)


# ----------------------------------------------------------------------------- trajectory


class TrajectoryState:
    """What `with trajectory(...) as t` gives: `t.sampled`, `t.set_reward(x)`, `t.span`."""

    __slots__ = (
        "mode",
        "step",
        "sample_index",
        "rollout_n",
        "validate",
        "name",
        "span",
        "errors",
        "t0",
        "var_token",
        "ctx_token",
        "link",
        "reward",
        "runtime",
    )
    t0: int
    var_token: Token[Any]
    ctx_token: Token[otel_context.Context]
    runtime: _runtime.Runtime

    def __init__(
        self,
        mode: int,
        step: int | None,
        sample_index: int | None,
        rollout_n: int | None,
        validate: bool,
        name: str | None,
    ):
        self.mode = mode
        self.step = step
        self.sample_index = sample_index
        self.rollout_n = rollout_n
        self.validate = validate
        self.name = name
        self.span: Any = None
        self.errors: list | None = None
        self.link: Any = None
        self.reward: float | None = None

    @property
    def sampled(self) -> bool:
        return self.mode == SAMPLED

    def set_reward(self, value: SupportsFloat | str) -> None:
        try:
            self.reward = float(value)
        except (TypeError, ValueError):
            return
        if self.span is not None:
            self.span.set_attribute(sc.RL_REWARD, self.reward)

    def note_error(self, name: str, kind: str, t0: int, t1: int, exc: BaseException) -> None:
        if self.errors is None:
            self.errors = []
        if len(self.errors) < 32:
            self.errors.append((name, kind, t0, t1, exc))

    def attributes(self) -> dict[str, Any]:
        a: dict[str, Any] = {
            sc.RL_SPAN_KIND: sc.KIND_AGENT,
            sc.RL_VALIDATE: self.validate,
            sc.RL_EXPERIMENT_NAME: _runtime.active.config.experiment,
        }
        if self.step is not None:
            a[sc.RL_STEP] = self.step
        if self.sample_index is not None:
            a[sc.RL_SAMPLE_INDEX] = self.sample_index
        if self.rollout_n is not None:
            a[sc.RL_ROLLOUT_N] = self.rollout_n
        if self.name:
            a[sc.RL_TRAJECTORY_NAME] = self.name
        if self.reward is not None:
            a[sc.RL_REWARD] = self.reward
        return a


#: the sampled trajectories whose block has not exited (id -> state): ended as interrupted at shutdown
_open_traced: dict[int, TrajectoryState] = {}


def end_open_trajectories(reason: str = "interrupted") -> int:
    """End the root span of every traced trajectory still open (the process is ending while rollouts run
    in other threads or tasks), with status ERROR `reason`: each is stored as a whole trace, root and tags
    with it, instead of as the spans that happened to end.  Their ops still running are not waited for.
    Returns how many were ended."""
    n = 0
    for key in list(_open_traced):
        st = _open_traced.pop(key, None)  # (the block may be exiting meanwhile on its own thread)
        if st is None:
            continue
        try:
            st.span.set_status(Status(StatusCode.ERROR, reason))
            st.span.end()
            n += 1
        except Exception:  # pragma: no cover - never let telemetry raise
            pass
    return n


class trajectory:
    """One rollout of one sample as its own trace, linked to the current step span.

    ``trace=False`` turns off every op nested inside (even nested trajectories)
    until the block exits, whatever escapes it.  Safe across asyncio tasks and
    threads: the state lives in context variables.
    """

    __slots__ = ("_args", "_st")

    def __init__(
        self,
        step: int | None = None,
        sample_index: int | None = None,
        rollout_n: int | None = None,
        validate: bool = False,
        name: str | None = None,
        trace: bool = True,
    ):
        self._args = (step, sample_index, rollout_n, bool(validate), name, trace)

    def __enter__(self) -> TrajectoryState:
        step_n, sample_index, rollout_n, validate, name, trace = self._args
        if step_n is None:
            step_n = current_step()
        parent = TRAJECTORY.get()
        if not trace or not _runtime.active.tracing or (parent is not None and parent.mode == OFF):
            mode = OFF
        elif _runtime.active.sampler.decide(step_n, sample_index, validate):
            mode = SAMPLED
        else:
            mode = UNSAMPLED
        st = self._st = TrajectoryState(mode, step_n, sample_index, rollout_n, validate, name)
        rt = st.runtime = _runtime.active
        rt.rollout_started()
        st.t0 = _time_ns()
        if mode == SAMPLED:
            st.link = _link_target()
            st.span = _runtime.active.light.start(name or sc.SPAN_TRAJECTORY, None, st.attributes(), _links_to(st.link))
            st.ctx_token = otel_context.attach(trace_api.set_span_in_context(st.span, _EMPTY_CONTEXT))
            _open_traced[id(st)] = st
        st.var_token = TRAJECTORY.set(st)
        return st

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        st = self._st
        TRAJECTORY.reset(st.var_token)
        if st.mode == SAMPLED:
            otel_context.detach(st.ctx_token)
            if _open_traced.pop(id(st), None) is not None:  # (else ended at shutdown, as interrupted)
                if ev is not None:
                    record_exception(st.span, ev)
                st.span.end()
        elif st.mode == UNSAMPLED and (ev is not None or st.errors):
            st.link = _link_target()  # the same step and span are current as at __enter__
            _emit_kept_error(st, ev)
        else:  # untraced: only its duration and outcome, for the metrics (when something reads them)
            st.runtime.untraced_trajectory(st.t0, st.validate, ev is not None)
        st.runtime.rollout_ended()
        return False

    async def __aenter__(self) -> TrajectoryState:
        return self.__enter__()

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        return self.__exit__(et, ev, tb)


def _emit_kept_error(st: TrajectoryState, ev: BaseException | None) -> None:
    """An unsampled trajectory failed: emit its root span and the failing ops after the fact."""
    tracer = _runtime.active.tracer
    if tracer is None:
        return
    attrs = st.attributes()
    attrs[sc.RL_SAMPLED] = False
    root = tracer.start_span(
        st.name or sc.SPAN_TRAJECTORY,
        context=_EMPTY_CONTEXT,
        links=[Link(st.link)] if st.link is not None else None,
        attributes=attrs,
        start_time=st.t0,
    )
    parent_ctx = trace_api.set_span_in_context(root, _EMPTY_CONTEXT)
    for name, kind, t0, t1, exc in st.errors or ():
        child = tracer.start_span(name, context=parent_ctx, attributes={sc.RL_SPAN_KIND: kind}, start_time=t0)
        record_exception(child, exc, timestamp=t1)
        child.end(end_time=t1)
    if ev is not None:
        record_exception(root, ev)
    elif st.errors:
        root.set_status(Status(StatusCode.ERROR, "an op in this trajectory failed"))
    root.end()


# ----------------------------------------------------------------------------- op


def _check_kind(kind: str) -> str:
    k = str(kind).upper()
    if k not in sc.SPAN_KINDS:
        raise ValueError(f"unknown op kind {kind!r}; use one of {', '.join(sc.SPAN_KINDS)}")
    return k


@overload
def op(fn: F, *, name: str | None = None, kind: str = sc.KIND_CHAIN) -> F: ...
@overload
def op(fn: None = None, *, name: str | None = None, kind: str = sc.KIND_CHAIN) -> Callable[[F], F]: ...
def op(fn: F | None = None, *, name: str | None = None, kind: str = sc.KIND_CHAIN) -> F | Callable[[F], F]:
    """Trace a function or method (sync, async, generator, async generator).

    The span is named by the function's qualname (or `name`); bound arguments
    (without ``self``) become its inputs, the return value its output;
    exceptions are recorded and re-raised unchanged.
    """
    k = _check_kind(kind)
    if k == sc.KIND_LLM:
        return generate(fn, name=name)
    if k == sc.KIND_TOOL:
        return tool(fn, name=name)
    # CHAIN is the default kind: leaving the attribute out keeps the common op span one attribute lighter
    return decorator(fn, lambda f: OpMeta(f, name, k, {sc.RL_SPAN_KIND: k} if k != sc.KIND_CHAIN else {}))


@overload
def generate(
    fn: F,
    *,
    name: str | None = None,
    model: str | None = None,
    operation: str = sc.GEN_AI_OP_CHAT,
    provider: str | None = None,
) -> F: ...
@overload
def generate(
    fn: None = None,
    *,
    name: str | None = None,
    model: str | None = None,
    operation: str = sc.GEN_AI_OP_CHAT,
    provider: str | None = None,
) -> Callable[[F], F]: ...
def generate(
    fn: F | None = None,
    *,
    name: str | None = None,
    model: str | None = None,
    operation: str = sc.GEN_AI_OP_CHAT,
    provider: str | None = None,
) -> F | Callable[[F], F]:
    """An LLM generation: GenAI-convention span with model and token usage.

    Token counts come from the result's ``prompt_ids``/``response_ids`` (keys or
    attributes) or its ``usage`` (``input_tokens``/``output_tokens`` or
    ``prompt_tokens``/``completion_tokens``).
    """

    def build(f: Callable) -> OpMeta:
        attrs: dict[str, Any] = {sc.RL_SPAN_KIND: sc.KIND_LLM, sc.GEN_AI_OPERATION_NAME: operation}
        if model:
            attrs[sc.GEN_AI_REQUEST_MODEL] = model
        if provider:
            attrs[sc.GEN_AI_PROVIDER_NAME] = provider
        span_name = name or (f"{operation} {model}" if model else None)
        return OpMeta(f, span_name, sc.KIND_LLM, attrs, model=model)

    return decorator(fn, build)


@overload
def tool(
    fn: F,
    *,
    name: str | None = None,
    call_id_arg: str | tuple[str, ...] = ("tool_call_id", "call_id"),
    tool_type: str = "function",
) -> F: ...
@overload
def tool(
    fn: None = None,
    *,
    name: str | None = None,
    call_id_arg: str | tuple[str, ...] = ("tool_call_id", "call_id"),
    tool_type: str = "function",
) -> Callable[[F], F]: ...
def tool(
    fn: F | None = None,
    *,
    name: str | None = None,
    call_id_arg: str | tuple[str, ...] = ("tool_call_id", "call_id"),
    tool_type: str = "function",
) -> F | Callable[[F], F]:
    """A tool call: GenAI-convention ``execute_tool <name>`` span with tool name and call id.

    The call id is read from the first bound argument named in `call_id_arg`.
    """

    def build(f: Callable) -> OpMeta:
        tool_name = name or getattr(f, "__name__", "tool")
        attrs = {
            sc.RL_SPAN_KIND: sc.KIND_TOOL,
            sc.GEN_AI_OPERATION_NAME: sc.GEN_AI_OP_EXECUTE_TOOL,
            sc.GEN_AI_TOOL_NAME: tool_name,
            sc.GEN_AI_TOOL_TYPE: tool_type,
        }
        ids = (call_id_arg,) if isinstance(call_id_arg, str) else tuple(call_id_arg)
        return OpMeta(f, f"{sc.GEN_AI_OP_EXECUTE_TOOL} {tool_name}", sc.KIND_TOOL, attrs, tool_call_arg=ids)

    return decorator(fn, build)


def annotate(**attributes: AttributeValue) -> None:
    """Set attributes on the current span (an op, a trajectory), if one is recording."""
    span = trace_api.get_current_span()
    if span.is_recording():
        for k, v in attributes.items():
            try:
                span.set_attribute(k, v)
            except Exception:
                pass


def current_trajectory() -> TrajectoryState | None:
    return TRAJECTORY.get()
