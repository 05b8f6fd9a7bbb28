"""Light recording spans for steps, timers, trajectories and ops.

A sampled trajectory makes a root span and one span per op; with many rollouts traced
per step that is hundreds of spans per step on the training thread (and a step and its
timers a few more).  The SDK's `Span`
pays for what otel-rl does not use there (its sampler — every span under a sampled
trajectory is kept —, locks, bounded attribute containers and a copy into a
`ReadableSpan` at the end).  `LightSpan` implements the `opentelemetry.trace.Span` API
(attributes, events, links, status, exceptions recorded as the SDK records them,
`is_recording`) and, when it ends, hands itself to otel-rl's pipeline, whose thread makes it
the SDK's `ReadableSpan` (`readable`) for the exporters and for any span processor outside
otel-rl (`otel_rl._processors`), which see its start on the caller's thread.

Attributes set by user code (`annotate`, ``get_current_span().set_attribute``) are
validated by OpenTelemetry's own rules and kept to its span limits; otel-rl's own
attributes are built valid and never cut.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import attributes as _otel_attributes
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, get_current_span

from ._values import warn_once
from .serialize import DEFAULT_MAX_CHARS, materialize

# OpenTelemetry's own attribute check (drops invalid values with a warning); its later versions have one check
# for the value (the key checked here), the earlier ones the first
_clean_attribute = getattr(_otel_attributes, "_clean_attribute", None)
_clean_attribute_value = getattr(_otel_attributes, "_clean_attribute_value", None)

_log = logging.getLogger("otel_rl")
_time_ns = time.time_ns
_bits = random.getrandbits
_FLAGS = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)
_INTERNAL = SpanKind.INTERNAL


def new_span_id() -> int:
    sid = _bits(64)
    while not sid:  # pragma: no cover - 1 in 2**64
        sid = _bits(64)
    return sid


def new_trace_id(now_ns: int | None = None) -> int:
    """A new trace's id: the milliseconds since the epoch in its first 48 bits (at `now_ns`, else now),
    80 random bits after them -- the layout of a UUIDv7.  The trace ids of a run then sort by time, and
    stores that index them (MLflow's trace tables) add each new trace at the end of their indexes
    rather than at a random place (fewer pages touched per insert).  W3C Trace Context asks for the
    right-most 7 bytes to be random; samplers that read a trace id read its low 64 bits."""
    ms = (_time_ns() if now_ns is None else now_ns) // 1_000_000
    return ((ms & 0xFFFF_FFFF_FFFF) << 80) | (_bits(80) or 1)


class TimeOrderedIds(IdGenerator):
    """The SDK provider's ids, laid out as the light spans' (`new_trace_id`)."""

    def generate_span_id(self) -> int:
        return new_span_id()

    def generate_trace_id(self) -> int:
        return new_trace_id()


def _clean(key: str, value: Any, max_length: int | None = None) -> Any:
    if _clean_attribute is not None:
        return _clean_attribute(key, value, max_length)
    if not key or not isinstance(key, str):
        _log.warning("otel-rl: invalid attribute key %r (must be a non-empty string); dropped", key)
        return None
    return value if _clean_attribute_value is None else _clean_attribute_value(value, max_length)


def _make_context_factory() -> tuple[Callable[[int, int], SpanContext], bool]:
    """`SpanContext(trace_id, span_id, False, sampled)` for ids known to be valid (non-zero, in range),
    without its constructor's checks: the tuple it would build, made directly.  Checked once here
    against the constructor; should a later API lay its tuple out otherwise, the constructor is used.
    Returns the factory and whether it is the direct one."""
    from opentelemetry.trace.span import DEFAULT_TRACE_STATE

    make = tuple.__new__

    def fast(trace_id: int, span_id: int) -> SpanContext:
        return make(SpanContext, (trace_id, span_id, False, _FLAGS, DEFAULT_TRACE_STATE, True))

    def slow(trace_id: int, span_id: int) -> SpanContext:
        return SpanContext(trace_id, span_id, False, _FLAGS)

    try:
        a, b = fast(0xABC, 0xDEF), slow(0xABC, 0xDEF)
        same = a == b and (a.trace_id, a.span_id, a.is_remote, a.trace_flags, a.trace_state, a.is_valid) == (
            b.trace_id,
            b.span_id,
            b.is_remote,
            b.trace_flags,
            b.trace_state,
            b.is_valid,
        )
    except Exception:  # pragma: no cover
        same = False
    return (fast, True) if same else (slow, False)


#: CONTEXT_IS_TUPLE: a SpanContext is the tuple (trace_id, span_id, ...), so `ctx[0]`, `ctx[1]` read its
#: ids without the API's properties (checked by the factory)
_new_context, CONTEXT_IS_TUPLE = _make_context_factory()


class LightSpan(trace_api.Span):
    """A recording span that becomes a `ReadableSpan` when it ends (see module doc)."""

    __slots__ = (
        "_name",
        "_context",
        "_parent",
        "_attributes",
        "_events",
        "_links",
        "_status",
        "_start",
        "_end",
        "_tracer",
    )

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, Any],
        links: Sequence[Link] | None,
        start: int,
        tracer: LightTracer,
    ):
        self._name = name
        self._context = context
        self._parent = parent
        self._attributes = attributes  # otel-rl's own: valid by construction (not copied)
        self._events: list[Event] | None = None
        self._links = list(links) if links else None
        self._status = _UNSET
        self._start = start
        self._end: int | None = None
        self._tracer = tracer

    # -- the Span API -------------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end is None

    def set_attribute(self, key: str, value: Any) -> None:
        # set by user code: OpenTelemetry's span limits apply (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT, ...), as to
        # the SDK's spans; otel-rl's own attributes are set at the start and never cut
        if self._end is not None:
            return
        tracer = self._tracer
        v = _clean(key, value, tracer.max_length)
        if v is None:
            return
        attrs = self._attributes
        if key not in attrs and tracer.max_attributes is not None and len(attrs) >= tracer.max_attributes:
            warn_once(
                "span-attribute-limit",
                "otel-rl: span attribute %r dropped: the span holds %d attributes (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT)",
                key,
                len(attrs),
            )
            return
        attrs[key] = v

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for k, v in attributes.items():
            self.set_attribute(k, v)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        if self._end is not None:
            return
        clean = {}
        max_length = self._tracer.max_length
        for k, v in (attributes or {}).items():
            v = _clean(k, v, max_length)
            if v is not None:
                clean[k] = v
        if self._events is None:
            self._events = []
        self._events.append(Event(name, clean, timestamp if timestamp is not None else _time_ns()))

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end is not None or context is None or not context.is_valid:
            return
        if self._links is None:
            self._links = []
        self._links.append(Link(context, dict(attributes) if attributes else None))

    def update_name(self, name: str) -> None:
        if self._end is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # as the SDK: OK is final, UNSET is ignored
        if self._end is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, Status):
            if status.status_code is not StatusCode.UNSET:
                self._status = status
        elif isinstance(status, StatusCode) and status is not StatusCode.UNSET:
            self._status = Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        # the event the SDK records (OpenTelemetry's exception semantic conventions)
        module = type(exception).__module__
        qualname = type(exception).__qualname__
        attrs = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            attrs.update(attributes)
        self.add_event("exception", attrs, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self._end is not None:
            return
        self._end = end_time if end_time is not None else _time_ns()
        try:
            self._tracer.submit(self)
        except Exception:  # pragma: no cover - the pipeline failing must not reach the caller
            _log.exception("otel-rl: span processor failed")

    def end_as_record(self) -> None:
        """End a span that carries a record (the run start): it reaches the pipeline as the `ReadableSpan`
        it reads at once, rather than as a light span waiting to be materialised."""
        if self._end is None:
            self._end = _time_ns()
            self._tracer.submit(self.readable(self._tracer.max_chars))

    def readable(self, max_chars: int = DEFAULT_MAX_CHARS) -> ReadableSpan:
        """This (ended) span as the SDK's `ReadableSpan` (an op's deferred inputs and output made into
        JSON text of at most `max_chars`, `serialize.materialize`)."""
        return ReadableSpan(
            name=self._name,
            context=self._context,
            parent=self._parent,
            resource=self._tracer.resource,
            attributes=materialize(self._attributes, max_chars),
            events=tuple(self._events) if self._events else (),
            links=tuple(self._links) if self._links else (),
            kind=_INTERNAL,
            status=self._status,
            start_time=self._start,
            end_time=self._end,
            instrumentation_scope=self._tracer.scope,
        )

    def __repr__(self) -> str:
        return f"LightSpan({self._name!r}, span_id={self._context.span_id:016x})"


class LightTracer:
    """Starts `LightSpan`s for one handle: its resource and scope.  An ended span goes to `submit`
    (the pipeline, which materialises it off the training thread); the span processors outside otel-rl
    (`others`, otel_rl._processors) see each span start here, on the caller's thread, while they exist.
    User-set attributes keep to OpenTelemetry's span limits, read from the environment as the SDK does."""

    __slots__ = ("submit", "resource", "scope", "others", "max_chars", "max_length", "max_attributes")

    def __init__(
        self,
        submit: Callable[[Any], None],
        resource: Any,
        scope: Any,
        others: Any = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        limits: SpanLimits | None = None,
    ):
        self.submit = submit
        self.resource = resource
        self.scope = scope
        self.others = others
        self.max_chars = max_chars  # of the JSON texts an op's inputs and output become (LightSpan.readable)
        limits = limits if limits is not None else SpanLimits()
        self.max_length = limits.max_span_attribute_length
        self.max_attributes = limits.max_span_attributes

    def start(
        self,
        name: str,
        parent: SpanContext | None,
        attributes: dict[str, Any],
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
    ) -> LightSpan:
        """A span under `parent` (same trace), or the root of a new trace when `parent` is None."""
        if start_time is None:
            start_time = _time_ns()
        if parent is not None and parent.is_valid:  # any SpanContext (a light span's children take the short path)
            ctx = _new_context(parent.trace_id, _bits(64) or new_span_id())
        else:
            parent = None
            ctx = _new_context(new_trace_id(start_time), _bits(64) or new_span_id())
        span = LightSpan(name, ctx, parent, attributes, links, start_time, self)
        others = self.others
        if others is not None and others.active:
            others.on_start(span)
        return span

    def start_in_current(self, name: str, attributes: dict[str, Any]) -> LightSpan:
        """A span under the current span (OpenTelemetry's context), or a new trace's root if there is none."""
        span = get_current_span()
        if type(span) is LightSpan:  # the common case (an op inside an op or a trajectory): its own context,
            parent = span._context  # made by `_new_context`, valid
            ctx = _new_context(parent[0] if CONTEXT_IS_TUPLE else parent.trace_id, _bits(64) or new_span_id())
            light = LightSpan(name, ctx, parent, attributes, None, _time_ns(), self)
            others = self.others
            if others is not None and others.active:
                others.on_start(light)
            return light
        return self.start(name, span.get_span_context(), attributes)
