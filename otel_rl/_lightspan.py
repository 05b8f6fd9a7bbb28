"""Light spans: the SDK's `ReadableSpan` for steps, timers, trajectories, ops, the run and the records.

A sampled trajectory makes a root span and one span per op; with many rollouts traced per step that is
hundreds of spans per step on the training thread (and a step and its timers a few more).  The SDK's
`Span` pays for what otel-rl does not use there (its sampler -- every span under a sampled trajectory
is kept --, a lock, bounded attribute containers).  `LightSpan` is a `ReadableSpan`, as the SDK's `Span`
is, with the same fields, so everything that reads a `ReadableSpan` (span processors, exporters,
`RecordBuilder`, `to_json`) reads it as it is; and it implements the `opentelemetry.trace.Span` API
(attributes, events, links, status, exceptions recorded as the SDK records them, `is_recording`).

Work the training thread leaves for later stays in the span's own slots until the span is seen outside
otel-rl: an op's inputs and output may be copies (bytes, `serialize.snapshot`) rather than JSON text
(`_deferred`), and an op output's token ids may wait for token2text (`_decode`).  `materialise` does that
work in place, in the pipeline's thread or in the export process, before anything else reads the span.
Span processors outside otel-rl see its start on the thread that starts it (`LightTracer.others`).

Attributes set by user code (`annotate`, ``get_current_span().set_attribute``) are validated by
OpenTelemetry's own rules and kept to its span limits; otel-rl's own attributes are built valid and
never cut.
"""

from __future__ import annotations

import logging
import random
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import attributes as _otel_attributes
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
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


class LightSpan(trace_api.Span, ReadableSpan):
    """A recording span that is the SDK's `ReadableSpan` once it ends (see module doc)."""

    # the SDK's `ReadableSpan` fields (its properties and `to_json` read them), then otel-rl's own
    __slots__ = (
        "_name",
        "_context",
        "_parent",
        "_attributes",
        "_events",
        "_links",
        "_status",
        "_start_time",
        "_end_time",
        "_resource",
        "_instrumentation_scope",
        "_tracer",
        "_deferred",
        "_decode",
    )
    _kind = _INTERNAL
    _instrumentation_info = None
    _context: SpanContext  # (narrower than ReadableSpan's: a light span always has its own)
    _attributes: dict[str, Any]

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        attributes: dict[str, Any],
        links: Sequence[Link] | None,
        start: int,
        tracer: LightTracer | None,
        resource: Resource,
        scope: InstrumentationScope | None,
    ):
        self._name = name
        self._context = context
        self._parent = parent
        self._attributes = attributes  # otel-rl's own: valid by construction (not copied)
        self._events: Sequence[Event] = ()
        self._links: Sequence[Link] = list(links) if links else ()
        self._status = _UNSET
        self._start_time = start
        self._end_time: int | None = None
        self._resource = resource
        self._instrumentation_scope = scope
        self._tracer = tracer  # None for a span made ended (`ended_span`)
        self._deferred = False  # the attributes may hold copies to make into JSON text (`materialise`)
        self._decode: tuple | None = None  # a token2text job (otel_rl._token2text.pending_entry)

    # -- the Span API -------------------------------------------------------------------------
    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        # set by user code: OpenTelemetry's span limits apply (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT, ...), as to
        # the SDK's spans; otel-rl's own attributes are set at the start and never cut
        tracer = self._tracer
        if self._end_time is not None or tracer is None:
            return
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
        tracer = self._tracer
        if self._end_time is not None or tracer is None:
            return
        clean = {}
        for k, v in (attributes or {}).items():
            v = _clean(k, v, tracer.max_length)
            if v is not None:
                clean[k] = v
        event = Event(name, clean, timestamp if timestamp is not None else _time_ns())
        events = self._events
        if type(events) is list:
            events.append(event)
        else:
            self._events = [event]

    def add_link(self, context: SpanContext, attributes: Mapping[str, Any] | None = None) -> None:
        if self._end_time is not None or context is None or not context.is_valid:
            return
        link = Link(context, dict(attributes) if attributes else None)
        links = self._links
        if type(links) is list:
            links.append(link)
        else:
            self._links = [link]

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # as the SDK: OK is final, UNSET is ignored
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
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
        tracer = self._tracer
        if self._end_time is not None or tracer is None:
            return
        self._end_time = end_time if end_time is not None else _time_ns()
        try:
            tracer.submit(self)
        except Exception:  # pragma: no cover - the pipeline failing must not reach the caller
            _log.exception("otel-rl: span processor failed")

    def __repr__(self) -> str:
        return f"LightSpan({self._name!r}, span_id={self._context.span_id:016x})"


def ended_span(
    name: str,
    context: SpanContext,
    parent: SpanContext | None,
    attributes: dict[str, Any],
    start: int,
    end: int,
    resource: Resource,
    scope: InstrumentationScope | None = None,
) -> LightSpan:
    """A span made ended, by otel-rl's own threads: a `log()` call's `rl.log` span, a generations table's,
    a span received by the export process (`attributes` taken as they are)."""
    span = LightSpan(name, context, parent, attributes, None, start, None, resource, scope)
    span._end_time = end
    return span


def materialise(spans: Iterable[Any], max_chars: int = DEFAULT_MAX_CHARS) -> None:
    """Do the work the training thread left in `spans` (light spans; any other span is final already), in
    place: token2text's texts decoded (one batch per tokenizer) into the ops' outputs, and the ops' copied
    inputs and outputs made into JSON text of at most `max_chars` (`serialize.materialize`)."""
    todo = [s for s in spans if type(s) is LightSpan and (s._deferred or s._decode is not None)]
    if not todo:
        return
    if any(s._decode is not None for s in todo):
        from ._token2text import decode

        decode(todo, max_chars)
    for s in todo:
        if s._deferred:
            materialize(s._attributes, max_chars)
            s._deferred = False


class LightTracer:
    """Starts `LightSpan`s for one handle: its resource and scope.  An ended span goes to `submit`
    (the pipeline, which materialises it off the training thread); the span processors outside otel-rl
    (`others`, otel_rl._processors) see each span start here, on the caller's thread, while they exist.
    User-set attributes keep to OpenTelemetry's span limits, read from the environment as the SDK does."""

    __slots__ = ("submit", "resource", "scope", "others", "max_length", "max_attributes")

    def __init__(
        self,
        submit: Callable[[Any], None],
        resource: Resource,
        scope: InstrumentationScope | None,
        others: Any = None,
        limits: SpanLimits | None = None,
    ):
        self.submit = submit
        self.resource = resource
        self.scope = scope
        self.others = others
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
        span = LightSpan(name, ctx, parent, attributes, links, start_time, self, self.resource, self.scope)
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
            light = LightSpan(name, ctx, parent, attributes, None, _time_ns(), self, self.resource, self.scope)
            others = self.others
            if others is not None and others.active:
                others.on_start(light)
            return light
        return self.start(name, span.get_span_context(), attributes)
