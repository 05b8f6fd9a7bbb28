"""OTLP -> `opentelemetry.sdk.trace.ReadableSpan`, the inverse of the SDK's OTLP encoder.

The bridge builds its records with the same `RecordBuilder` as the in-process path, so received
spans must look exactly like the spans the trainer's SDK ended: resource (attributes, schema URL),
instrumentation scope (name, version, schema URL, attributes), name, kind, trace/span/parent ids,
trace state and flags, parent ``is_remote``, start/end times, attributes (arrays as tuples, maps as
dicts, bytes as bytes), events, links, status and the dropped counts.

Two wire encodings:

- protobuf (``application/x-protobuf``): read by the C extension `otel_rl.bridge._otlp` where it is
  built (``NATIVE``), otherwise parsed by the official generated messages (`opentelemetry-proto`);
  both end in `span_from_fields`, and give the same spans (tests/bridge/test_decode_native.py);
- JSON (``application/json``) as the OTLP specification defines it, which differs from the
  canonical proto3 JSON mapping: trace and span ids are hex strings (not base64), enums are
  integers, 64-bit integers may be strings or numbers, field names are lowerCamelCase (the
  original snake_case is accepted too), unknown fields are ignored.  The ids are rewritten to the
  proto3 form and the rest is parsed by ``google.protobuf.json_format``.

A span that cannot be represented (a trace id that is not 16 bytes, a span id that is not 8,
an all-zero id) or whose ``rl.*`` attributes have the wrong type or shape for its records
(`otel_rl.bridge.validate`) is rejected on its own and counted, as OTLP's ``partial_success``
allows; a body that does not parse at all raises `DecodeError` with a short reason for the client.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from operator import attrgetter, methodcaller
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope as _ScopeProto
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as _ResourceProto
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from .. import semconv as sc
from ..records import RECORD_SPAN_NAMES as _RECORD_NAMES  # record spans: not parts or roots of trajectories
from .validate import TYPED, needs_check, resource_problem, span_problem

__all__ = [
    "DecodeError",
    "DecodedTraces",
    "MetricsSummary",
    "decode_traces",
    "decode_metrics",
    "parse_traces",
    "parse_metrics",
    "spans_from_request",
    "summarize_metrics",
    "any_value",
]

# OTLP SpanFlags (trace.proto): low 8 bits are the W3C trace flags; bits 8 and 9 say whether the
# parent (for a span) or the linked span (for a link) is remote.
FLAGS_TRACE_FLAGS_MASK = 0xFF
FLAGS_HAS_IS_REMOTE = 0x100
FLAGS_IS_REMOTE = 0x200

_KINDS = {
    0: SpanKind.INTERNAL,  # SPAN_KIND_UNSPECIFIED: the SDK has no such kind
    1: SpanKind.INTERNAL,
    2: SpanKind.SERVER,
    3: SpanKind.CLIENT,
    4: SpanKind.PRODUCER,
    5: SpanKind.CONSUMER,
}
_STATUS_CODES = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}
_UNSET = Status(StatusCode.UNSET)
_OK = Status(StatusCode.OK)
_EMPTY_STATE = TraceState()
_FLAGS = [TraceFlags(i) for i in range(256)]
# The OTLP encoders of the SDKs leave bits 0-7 at 0 (the Python SDK's does); an exported span was
# sampled (processors export sampled spans only), so 0 there is read as "sampled".
_FLAGS[0] = TraceFlags(TraceFlags.SAMPLED)
_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)


class DecodeError(ValueError):
    """The body is not an OTLP request; the message is a short reason fit for the client."""


# ----------------------------------------------------------------------------- values

_SCALARS = {
    "string_value": attrgetter("string_value"),
    "bool_value": attrgetter("bool_value"),
    "int_value": attrgetter("int_value"),
    "double_value": attrgetter("double_value"),
    "bytes_value": attrgetter("bytes_value"),
}


def any_value(v: Any) -> Any:
    """An OTLP AnyValue as the Python value the SDK keeps (arrays as tuples, maps as dicts)."""
    which = v.WhichOneof("value")
    get = _SCALARS.get(which)
    if get is not None:
        return get(v)
    if which == "array_value":
        return _array(v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return None  # an empty AnyValue


_WHICH = methodcaller("WhichOneof", "value")


def _array(values: Any) -> tuple:
    if not values:
        return ()
    # arrays are nearly always of one type (log() sends its metrics as arrays of doubles): read them with
    # C-level loops when every element holds the same scalar
    whiches = list(map(_WHICH, values))
    get = _SCALARS.get(whiches[0])
    if get is not None and whiches.count(whiches[0]) == len(whiches):
        return tuple(map(get, values))
    out: list[Any] = []
    append = out.append
    scalars = _SCALARS
    for x, which in zip(values, whiches):
        get = scalars.get(which)
        append(get(x) if get is not None else any_value(x))
    return tuple(out)


def attributes(kvs: Iterable[Any]) -> dict[str, Any]:
    """KeyValue list -> dict (a repeated key: the later value wins, as the SDK would keep it)."""
    out: dict[str, Any] = {}
    scalars = _SCALARS
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        get = scalars.get(which)
        out[kv.key] = get(v) if get is not None else any_value(v)
    return out


def _with_dropped(attrs: dict[str, Any], dropped: int) -> Any:
    """Attributes that report `dropped` like the SDK's own (`ReadableSpan.dropped_attributes`)."""
    if not dropped:
        return attrs
    try:
        from opentelemetry.attributes import BoundedAttributes

        bounded = BoundedAttributes(immutable=False)
        bounded._dict = attrs  # the values are already clean; do not re-validate them
        bounded.dropped = dropped
        bounded._immutable = True
        return bounded
    except Exception:  # pragma: no cover - SDK internals changed: lose only the count
        return attrs


def _bounded(items: list, dropped: int) -> Any:
    if not dropped:
        return items
    bl = BoundedList.from_seq(None, items)
    bl.dropped = dropped
    return bl


def _trace_state(text: str) -> TraceState:
    if not text:
        return _EMPTY_STATE
    try:
        return TraceState.from_header([text])
    except Exception:  # pragma: no cover - from_header tolerates junk (it drops invalid members)
        return _EMPTY_STATE


# ----------------------------------------------------------------------------- spans


class DecodedTraces:
    """The spans of one request, plus what had to be rejected."""

    __slots__ = ("spans", "roots", "rejected", "reasons", "resources")

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []
        # (`decode_traces(..., roots=True)`: the spans that begin trajectories, apart from `spans`)
        self.roots: list[ReadableSpan] = []
        self.resources: list[Resource] = []  # one per ResourceSpans (the run identities of the request)
        self.rejected = 0
        self.reasons: dict[str, int] = {}

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def error_message(self) -> str:
        return "; ".join(f"{n} span(s): {r}" for r, n in sorted(self.reasons.items()))


class _Cache:
    """Resources and scopes repeat in every request of a run: decode each once (bounded)."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.resources: dict[tuple[bytes, str], tuple[Resource, str | None]] = {}
        self.scopes: dict[tuple[bytes, str], InstrumentationScope | None] = {}

    def resource_bytes(self, raw: bytes, schema_url: str) -> tuple[Resource, str | None]:
        """A serialized `Resource` -> (its `Resource`, why its spans cannot make records or None)."""
        key = (raw, schema_url)
        got = self.resources.get(key)
        if got is None:
            if len(self.resources) >= self.limit:
                self.resources.clear()
            msg = _parse_protobuf(raw, _ResourceProto())
            res = Resource(_with_dropped(attributes(msg.attributes), msg.dropped_attributes_count), schema_url or None)
            # Resource() copies the attributes into its own BoundedAttributes (values as they are)
            got = self.resources[key] = (res, resource_problem(res.attributes))
        return got

    def scope(self, ss: Any) -> InstrumentationScope | None:
        return self.scope_bytes(ss.scope.SerializeToString(), ss.schema_url)

    def scope_bytes(self, raw: bytes, schema_url: str) -> InstrumentationScope | None:
        key = (raw, schema_url)
        try:
            return self.scopes[key]
        except KeyError:
            pass
        if len(self.scopes) >= self.limit:
            self.scopes.clear()
        sc = _parse_protobuf(raw, _ScopeProto())
        if not sc.name and not sc.version and not sc.attributes and not schema_url:
            scope = None  # the SDK encodes a span without a scope as an empty scope
        else:
            scope = InstrumentationScope(
                sc.name, sc.version or None, schema_url or None, attributes(sc.attributes) if sc.attributes else None
            )
        self.scopes[key] = scope
        return scope


_cache = _Cache()


def _context(trace_id: int, span_id: bytes, flags: int, state: str, remote: bool) -> SpanContext:
    return SpanContext(
        trace_id,
        int.from_bytes(span_id, "big"),
        is_remote=remote,
        trace_flags=_FLAGS[flags & FLAGS_TRACE_FLAGS_MASK],
        trace_state=_trace_state(state),
    )


def _is_remote(flags: int) -> bool:
    return bool(flags & FLAGS_HAS_IS_REMOTE and flags & FLAGS_IS_REMOTE)


def _span_attributes(kvs: Iterable[Any]) -> tuple[dict[str, Any], bool]:
    """A span's KeyValue list -> (dict, whether each attribute of `validate.TYPED` has its type)."""
    out: dict[str, Any] = {}
    typed_ok = True
    typed = TYPED
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        # the scalar cases inline: this loop runs for every attribute of every received span
        if which == "string_value":
            x = v.string_value
        elif which == "int_value":
            x = v.int_value
        elif which == "double_value":
            x = v.double_value
        elif which == "bool_value":
            x = v.bool_value
        elif which == "array_value":
            x = _array(v.array_value.values)
        else:
            x = any_value(v)
        key = kv.key
        out[key] = x
        t = typed.get(key)
        if t is not None and x is not None and type(x) is not t:
            typed_ok = False  # (`span_problem` then says why, from the final dict: a later value wins)
    return out, typed_ok


_new_tuple = tuple.__new__


def _valid_context(trace_id: int, span_id: int, remote: bool, flags: TraceFlags, state: TraceState) -> SpanContext:
    """A SpanContext whose ids are already checked (16 and 8 bytes, not all zero), so valid: built
    without SpanContext.__new__'s range checks (it is a tuple; this is the tuple that would make)."""
    return _new_tuple(SpanContext, (trace_id, span_id, remote, flags, state, True))


def span_from_fields(f: tuple, resource: Resource, scope: InstrumentationScope | None) -> ReadableSpan | str:
    """One span's decoded fields -> its `ReadableSpan`, or why it is refused.

    `f`: (trace_id, span_id, trace_state, parent_span_id, flags, name, kind, start, end, attributes,
    dropped attributes, events, dropped events, links, dropped links, status code, status message,
    whether each `validate.TYPED` attribute had its type), events as (time, name, attributes, dropped)
    and links as (trace_id, span_id, trace_state, attributes, dropped, flags).  Both decoders end here:
    the protobuf one in C (`otel_rl.bridge._otlp`) for every span that has more than the common fields,
    the one through the generated messages for every span."""
    (tid, sid, text, psid, flags, name, kind, start, end, attrs, dropped, events, d_events, links, d_links, code,
     message, typed_ok) = f  # fmt: skip
    if len(tid) != 16 or tid == _ZERO_TRACE:
        return "trace_id must be 16 bytes, not all zero"
    if len(sid) != 8 or sid == _ZERO_SPAN:
        return "span_id must be 8 bytes, not all zero"
    if psid and (len(psid) != 8 or psid == _ZERO_SPAN):
        return "parent_span_id must be empty or 8 bytes, not all zero"
    span_links: Any = ()
    if links:
        span_links = _links(links)
        if span_links is None:
            return "link ids must be 16 and 8 bytes"
        span_links = _bounded(span_links, d_links)
    elif d_links:
        span_links = _bounded([], d_links)
    span_events: Any = ()
    if events:
        span_events = _bounded([Event(n, _with_dropped(a, d), t) for t, n, a, d in events], d_events)
    elif d_events:
        span_events = _bounded([], d_events)
    if not typed_ok or needs_check(name, attrs, bool(psid)):
        why = span_problem(name, attrs, bool(psid))
        if why:
            return why
    trace_id = int.from_bytes(tid, "big")
    trace_flags = _FLAGS[flags & FLAGS_TRACE_FLAGS_MASK]
    state = _trace_state(text) if text else _EMPTY_STATE
    ctx = _valid_context(trace_id, int.from_bytes(sid, "big"), False, trace_flags, state)
    parent = (
        _valid_context(trace_id, int.from_bytes(psid, "big"), _is_remote(flags), trace_flags, state) if psid else None
    )
    if code == 2:
        status = Status(StatusCode.ERROR, message or None)
    elif code == 1:
        status = _OK  # the SDK keeps no description except for ERROR
    else:
        status = _UNSET
    return ReadableSpan(
        name,
        ctx,
        parent,
        resource,
        _with_dropped(attrs, dropped) if dropped else attrs,
        span_events,
        span_links,
        _KINDS.get(kind, SpanKind.INTERNAL),
        None,
        status,
        start,
        end,
        scope,
    )


def _fields(s: Any) -> tuple:
    """A generated `Span` message's fields, as `span_from_fields` takes them."""
    attrs, typed_ok = _span_attributes(s.attributes)
    st = s.status
    return (
        s.trace_id,
        s.span_id,
        s.trace_state,
        s.parent_span_id,
        s.flags,
        s.name,
        s.kind,
        s.start_time_unix_nano,
        s.end_time_unix_nano,
        attrs,
        s.dropped_attributes_count,
        [(e.time_unix_nano, e.name, attributes(e.attributes), e.dropped_attributes_count) for e in s.events],
        s.dropped_events_count,
        [
            (ln.trace_id, ln.span_id, ln.trace_state, attributes(ln.attributes), ln.dropped_attributes_count, ln.flags)
            for ln in s.links
        ],
        s.dropped_links_count,
        st.code,
        st.message,
        typed_ok,
    )


def spans_from_request(req: Any, out: DecodedTraces | None = None, cache: _Cache | None = None) -> DecodedTraces:
    """ExportTraceServiceRequest -> ReadableSpans (in request order)."""
    out = out if out is not None else DecodedTraces()
    cache = cache or _cache
    append = out.spans.append
    for rs in req.resource_spans:
        resource, bad_resource = cache.resource_bytes(rs.resource.SerializeToString(), rs.schema_url)
        out.resources.append(resource)
        for ss in rs.scope_spans:
            if bad_resource:
                for _ in ss.spans:
                    out.reject(bad_resource)
                continue
            scope = cache.scope(ss)
            for s in ss.spans:
                span = span_from_fields(_fields(s), resource, scope)
                if isinstance(span, str):
                    out.reject(span)
                else:
                    append(span)
    return out


def _links(received: Any) -> list[Link] | None:
    """A span's links, or None when one has ids that cannot be represented."""
    links = []
    for lt, ls, state, attrs, dropped, flags in received:
        if len(lt) != 16 or len(ls) != 8:
            return None
        links.append(
            Link(
                _context(int.from_bytes(lt, "big"), ls, flags, state, _is_remote(flags)),
                _with_dropped(attrs, dropped),
            )
        )
    return links


# ----------------------------------------------------------------------------- the C decoder

try:
    from . import _otlp  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: the generated messages decode everything
    _otlp = None


def _span_layout() -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The instance attributes `ReadableSpan.__init__` sets, in order, and for each the index of the
    argument it holds; None when one of them is not simply an argument (then C does not make spans)."""
    marks = [object() for _ in range(13)]
    try:
        probe = ReadableSpan(*marks)  # type: ignore[arg-type]
        slots = vars(probe)
    except Exception:  # pragma: no cover - an SDK whose spans have no instance dict
        return None
    ids = {id(m): i for i, m in enumerate(marks)}
    names, args = [], []
    for name, value in slots.items():
        if id(value) not in ids:
            return None
        names.append(name)
        args.append(ids[id(value)])
    if len(set(args)) != len(args):  # pragma: no cover - a different SDK
        return None
    return tuple(names), tuple(args)


def _configure_c() -> bool:
    layout = _span_layout() if _otlp is not None else None
    if layout is None:
        return False

    _otlp.configure(
        decode_error=DecodeError,
        span_type=ReadableSpan,
        attr_names=layout[0],
        attr_args=layout[1],
        context_type=SpanContext,
        flags=list(_FLAGS),
        empty_state=_EMPTY_STATE,
        status_unset=_UNSET,
        status_ok=_OK,
        kinds=[_KINDS[i] for i in range(len(_KINDS))],
        typed=dict(TYPED),
        checked_names=set(_RECORD_NAMES),
        finish=span_from_fields,
        resource=_cache.resource_bytes,
        scope=_cache.scope_bytes,
    )
    return True


def _configure_c_nodes() -> Any:
    """The record builder's node maker for the spans the C decoder makes (records._node for any other);
    None without the C decoder, or when SpanNode's fields are not the ones it fills."""
    if not NATIVE:
        return None
    import dataclasses

    from .. import records

    fields = tuple(f.name for f in dataclasses.fields(records.SpanNode))
    if fields != _NODE_FIELDS:  # pragma: no cover - SpanNode changed without the C side
        return None
    _otlp.configure_nodes(
        node_type=records.SpanNode,
        fields=fields,
        fallback=records._node,
        kind_key=sc.RL_SPAN_KIND,
        inputs_key=sc.RL_OP_INPUTS,
        output_key=sc.RL_OP_OUTPUT,
        kind_default=sc.KIND_CHAIN,
    )
    return _otlp.node


# the fields `_otlp.node` fills, in its order
_NODE_FIELDS = (
    "name",
    "kind",
    "span_id",
    "parent_id",
    "start_ns",
    "end_ns",
    "attributes",
    "inputs",
    "output",
    "status",
    "status_message",
    "events",
    "children",
)

NATIVE = _configure_c()  # whether protobuf bodies are decoded by `otel_rl.bridge._otlp`
#: `records._node` in C for the spans `_otlp` makes (the bridge's record builder uses it); None without it
node_maker = _configure_c_nodes()


def _decode_native(body: bytes, roots: bool) -> DecodedTraces:
    out = DecodedTraces()
    _otlp.decode(body, out.spans, out.resources, out.reject, out.roots if roots else None)
    return out


def _split_roots(out: DecodedTraces) -> DecodedTraces:
    """`out`'s parentless spans other than record spans moved to `out.roots` (order kept in each)."""
    spans: list[ReadableSpan] = []
    for span in out.spans:
        (out.roots if span.parent is None and span.name not in _RECORD_NAMES else spans).append(span)
    out.spans = spans
    return out


# ----------------------------------------------------------------------------- request bodies

_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})


def _hex_ids_to_base64(obj: Any) -> None:
    """OTLP/JSON ids are hex; proto3 JSON wants base64: rewrite them in place (iteratively)."""
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            for k, v in cur.items():
                if k in _ID_KEYS and isinstance(v, str):
                    if v:
                        try:
                            raw = bytes.fromhex(v)
                        except ValueError:
                            raise DecodeError(f"{k} is not a hex string") from None
                        cur[k] = base64.b64encode(raw).decode("ascii")
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(cur, list):
            stack.extend(x for x in cur if isinstance(x, (dict, list)))


def _parse_json(body: bytes, message: Any) -> Any:
    from google.protobuf import json_format

    try:
        obj = json.loads(body)
    except RecursionError:
        raise DecodeError("JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"invalid JSON: {str(exc)[:80]}") from None
    if not isinstance(obj, dict):
        raise DecodeError("the JSON body must be an object")
    _hex_ids_to_base64(obj)
    try:
        json_format.ParseDict(obj, message, ignore_unknown_fields=True)
    except RecursionError:
        raise DecodeError("JSON nested too deeply") from None
    except json_format.ParseError as exc:
        raise DecodeError(f"not an OTLP JSON request: {str(exc)[:120]}") from None
    except (ValueError, TypeError, AttributeError, KeyError, binascii.Error) as exc:
        raise DecodeError(f"not an OTLP JSON request: {type(exc).__name__}") from None
    return message


def _parse_protobuf(body: bytes, message: Any) -> Any:
    from google.protobuf.message import DecodeError as ProtoDecodeError

    try:
        message.ParseFromString(body)
    except ProtoDecodeError:
        raise DecodeError("not an OTLP protobuf request") from None
    except (RecursionError, ValueError, TypeError):
        raise DecodeError("not an OTLP protobuf request") from None
    return message


def parse_traces(body: bytes, json_body: bool = False) -> Any:
    """Body -> ExportTraceServiceRequest."""
    msg = ExportTraceServiceRequest()
    return _parse_json(body, msg) if json_body else _parse_protobuf(body, msg)


def parse_metrics(body: bytes, json_body: bool = False) -> Any:
    msg = ExportMetricsServiceRequest()
    return _parse_json(body, msg) if json_body else _parse_protobuf(body, msg)


def decode_traces(
    body: bytes, json_body: bool = False, native: bool | None = None, roots: bool = False
) -> DecodedTraces:
    """A `/v1/traces` body (protobuf or OTLP/JSON) -> ReadableSpans.  Protobuf is decoded in C where the
    extension is built (`native`: force one decoder or the other, for tests).  `roots`: the parentless
    spans other than record spans (`rl.run`, `rl.log`, `rl.generations`), which begin trajectories, go to
    `.roots` instead of `.spans`."""
    if not json_body and (NATIVE if native is None else native):
        try:
            return _decode_native(body, roots)
        except RecursionError:  # pragma: no cover - C limits nesting itself
            raise DecodeError("attribute values nested too deeply") from None
    req = parse_traces(body, json_body)
    try:
        out = spans_from_request(req)
    except RecursionError:  # maps nested beyond Python's recursion limit (protobuf allows 100 levels)
        raise DecodeError("attribute values nested too deeply") from None
    return _split_roots(out) if roots else out


# ----------------------------------------------------------------------------- metrics


class MetricsSummary:
    __slots__ = ("resources", "metrics", "points", "runs")

    def __init__(self) -> None:
        self.resources = 0
        self.metrics = 0
        self.points = 0
        self.runs: set[tuple[str, str, str]] = set()


_POINT_FIELDS = {
    "gauge": "data_points",
    "sum": "data_points",
    "histogram": "data_points",
    "exponential_histogram": "data_points",
    "summary": "data_points",
}


def summarize_metrics(req: Any) -> MetricsSummary:
    """Counts of an ExportMetricsServiceRequest (the bridge logs and forwards metrics, it does not store them)."""

    out = MetricsSummary()
    for rm in req.resource_metrics:
        out.resources += 1
        res = {
            kv.key: kv.value.string_value
            for kv in rm.resource.attributes
            if kv.key in (sc.RL_PROJECT_NAME, sc.RL_EXPERIMENT_NAME, sc.RL_RUN_ID)
        }
        if res:
            out.runs.add(
                (res.get(sc.RL_PROJECT_NAME, ""), res.get(sc.RL_EXPERIMENT_NAME, ""), res.get(sc.RL_RUN_ID, ""))
            )
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.metrics += 1
                which = m.WhichOneof("data")
                if which in _POINT_FIELDS:
                    out.points += len(getattr(m, which).data_points)
    return out


def decode_metrics(body: bytes, json_body: bool = False) -> MetricsSummary:
    return summarize_metrics(parse_metrics(body, json_body))
