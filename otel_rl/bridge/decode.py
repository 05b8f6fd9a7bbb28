"""OTLP -> `opentelemetry.sdk.trace.ReadableSpan`, the inverse of the SDK's OTLP encoder.

The bridge builds its records with the same `RecordBuilder` as the in-process path, so received
spans must look exactly like the spans the trainer's SDK ended: resource (attributes, schema URL),
instrumentation scope (name, version, schema URL, attributes), name, kind, trace/span/parent ids,
trace state and flags, parent ``is_remote``, start/end times, attributes (arrays as tuples, maps as
dicts, bytes as bytes), events, links, status and the dropped counts.

Two wire encodings:

- protobuf (``application/x-protobuf``): parsed by the official generated messages
  (`opentelemetry-proto`);
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
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

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

    __slots__ = ("spans", "rejected", "reasons", "resources")

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []
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
        self.resources: dict[tuple[bytes, str], Resource] = {}
        self.scopes: dict[tuple[bytes, str], InstrumentationScope | None] = {}

    def resource(self, rs: Any) -> Resource:
        key = (rs.resource.SerializeToString(), rs.schema_url)
        res = self.resources.get(key)
        if res is None:
            if len(self.resources) >= self.limit:
                self.resources.clear()
            res = Resource(
                _with_dropped(attributes(rs.resource.attributes), rs.resource.dropped_attributes_count),
                rs.schema_url or None,
            )
            # Resource() copies the attributes into its own BoundedAttributes (values as they are)
            self.resources[key] = res
        return res

    def scope(self, ss: Any) -> InstrumentationScope | None:
        key = (ss.scope.SerializeToString(), ss.schema_url)
        try:
            return self.scopes[key]
        except KeyError:
            pass
        if len(self.scopes) >= self.limit:
            self.scopes.clear()
        sc = ss.scope
        if not sc.name and not sc.version and not sc.attributes and not ss.schema_url:
            scope = None  # the SDK encodes a span without a scope as an empty scope
        else:
            scope = InstrumentationScope(
                sc.name, sc.version or None, ss.schema_url or None, attributes(sc.attributes) if sc.attributes else None
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


def spans_from_request(req: Any, out: DecodedTraces | None = None, cache: _Cache | None = None) -> DecodedTraces:
    """ExportTraceServiceRequest -> ReadableSpans (in request order)."""
    out = out if out is not None else DecodedTraces()
    cache = cache or _cache
    append = out.spans.append
    from_bytes = int.from_bytes
    for rs in req.resource_spans:
        resource = cache.resource(rs)
        out.resources.append(resource)
        bad_resource = resource_problem(resource.attributes)
        for ss in rs.scope_spans:
            if bad_resource:
                for _ in ss.spans:
                    out.reject(bad_resource)
                continue
            scope = cache.scope(ss)
            last_tid = b""  # the spans of a trace come together: convert its id once
            trace_id = 0
            for s in ss.spans:
                tid = s.trace_id
                if tid != last_tid:
                    if len(tid) != 16 or tid == _ZERO_TRACE:
                        out.reject("trace_id must be 16 bytes, not all zero")
                        continue
                    last_tid = tid
                    trace_id = from_bytes(tid, "big")
                sid = s.span_id
                if len(sid) != 8 or sid == _ZERO_SPAN:
                    out.reject("span_id must be 8 bytes, not all zero")
                    continue
                psid = s.parent_span_id
                if psid and (len(psid) != 8 or psid == _ZERO_SPAN):
                    out.reject("parent_span_id must be empty or 8 bytes, not all zero")
                    continue
                flags = s.flags
                trace_flags = _FLAGS[flags & FLAGS_TRACE_FLAGS_MASK]
                text = s.trace_state
                state = _trace_state(text) if text else _EMPTY_STATE
                ctx = _valid_context(trace_id, from_bytes(sid, "big"), False, trace_flags, state)
                parent = (
                    _valid_context(trace_id, from_bytes(psid, "big"), _is_remote(flags), trace_flags, state)
                    if psid
                    else None
                )
                links: Any = ()
                if s.links:
                    links = _links(s.links)
                    if links is None:
                        out.reject("link ids must be 16 and 8 bytes")
                        continue
                    links = _bounded(links, s.dropped_links_count)
                elif s.dropped_links_count:
                    links = _bounded([], s.dropped_links_count)
                events: Any = ()
                if s.events:
                    events = _bounded(
                        [
                            Event(
                                e.name,
                                _with_dropped(attributes(e.attributes), e.dropped_attributes_count),
                                e.time_unix_nano,
                            )
                            for e in s.events
                        ],
                        s.dropped_events_count,
                    )
                elif s.dropped_events_count:
                    events = _bounded([], s.dropped_events_count)
                attrs, typed_ok = _span_attributes(s.attributes)
                name = s.name
                if not typed_ok or needs_check(name, attrs, bool(psid)):
                    why = span_problem(name, attrs, bool(psid))
                    if why:
                        out.reject(why)
                        continue
                st = s.status
                code = st.code
                if code == 2:
                    status = Status(StatusCode.ERROR, st.message or None)
                elif code == 1:
                    status = _OK  # the SDK keeps no description except for ERROR
                else:
                    status = _UNSET
                dropped = s.dropped_attributes_count
                append(
                    ReadableSpan(
                        name,
                        ctx,
                        parent,
                        resource,
                        _with_dropped(attrs, dropped) if dropped else attrs,
                        events,
                        links,
                        _KINDS.get(s.kind, SpanKind.INTERNAL),
                        None,
                        status,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        scope,
                    )
                )
    return out


def _links(received: Any) -> list[Link] | None:
    """A span's links, or None when one has ids that cannot be represented."""
    links = []
    for ln in received:
        lt, ls = ln.trace_id, ln.span_id
        if len(lt) != 16 or len(ls) != 8:
            return None
        links.append(
            Link(
                _context(int.from_bytes(lt, "big"), ls, ln.flags, ln.trace_state, _is_remote(ln.flags)),
                _with_dropped(attributes(ln.attributes), ln.dropped_attributes_count),
            )
        )
    return links


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


def decode_traces(body: bytes, json_body: bool = False) -> DecodedTraces:
    """A `/v1/traces` body (protobuf or OTLP/JSON) -> ReadableSpans."""
    req = parse_traces(body, json_body)
    try:
        return spans_from_request(req)
    except RecursionError:  # maps nested beyond Python's recursion limit (protobuf allows 100 levels)
        raise DecodeError("attribute values nested too deeply") from None


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
    from .. import semconv as sc

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
