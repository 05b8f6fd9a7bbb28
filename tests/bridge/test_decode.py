"""The OTLP decoder against the official encoders: SDK spans -> OTLP -> `decode_traces` -> the same spans.

Round trips through the SDK's protobuf encoder (`encode_spans`), through the official OTLP/JSON
encoder (opentelemetry-exporter-otlp-json-common, when installed) and through spec JSON built from
the protobuf with `google.protobuf.json_format` (hex ids, integer enums); every field the wire
carries is compared.  Plus the cases an encoder never produces: invalid ids, unknown JSON
fields, upper-case hex, int64 as numbers, garbage, deep nesting.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from otel_rl.bridge.decode import DecodeError, decode_metrics, decode_traces
from otel_rl.bridge.validate import TYPED, span_problem

from .helpers import official_json_encoder, spec_json

# ----------------------------------------------------------------------------- strategies

INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=12)
KEYS = st.text(min_size=1, max_size=10)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SCALARS = st.one_of(TEXT, st.booleans(), INT64, FLOATS, st.binary(max_size=8))
HOMOGENEOUS = st.one_of(*(st.lists(s, max_size=5).map(tuple) for s in (TEXT, st.booleans(), INT64, FLOATS)))
VALUES = st.recursive(
    st.one_of(SCALARS, HOMOGENEOUS, st.none()),
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(tuple), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=8,
)
ATTRS = st.dictionaries(KEYS, VALUES, max_size=6)
TRACE_IDS = st.integers(1, 2**128 - 1)
SPAN_IDS = st.integers(1, 2**64 - 1)
TRACE_STATES = st.lists(st.tuples(st.from_regex(r"[a-z][a-z0-9_\-*/]{0,8}", fullmatch=True),
                                  st.from_regex(r"[!-+\--<>-~]{1,8}", fullmatch=True)), max_size=3,
                        unique_by=lambda kv: kv[0]).map(TraceState)


@st.composite
def bounded_attrs(draw):
    """Plain dicts, or the SDK's BoundedAttributes with some attributes dropped."""
    attrs = draw(ATTRS)
    if attrs and draw(st.booleans()):
        keep = draw(st.integers(0, len(attrs)))
        b = BoundedAttributes(maxlen=keep, immutable=False)
        for k, v in attrs.items():
            b._dict[k] = v  # as the SDK would have kept them, without its value cleaning
            while len(b._dict) > keep:
                del b._dict[next(iter(b._dict))]
                b.dropped += 1
        b._immutable = True
        return b
    return attrs


@st.composite
def scopes(draw):
    if draw(st.booleans()):
        return None
    return InstrumentationScope(draw(st.text(min_size=1, max_size=10)), draw(st.one_of(st.none(), st.text(min_size=1))),
                                draw(st.one_of(st.none(), st.text(min_size=1, max_size=20))),
                                draw(st.one_of(st.none(), ATTRS.filter(bool))))


@st.composite
def spans(draw, resource, scope):
    tid = draw(TRACE_IDS)
    state = draw(TRACE_STATES)
    ctx = SpanContext(tid, draw(SPAN_IDS), False, TraceFlags(TraceFlags.SAMPLED), state)
    parent = None
    if draw(st.booleans()):
        parent = SpanContext(tid, draw(SPAN_IDS), draw(st.booleans()), TraceFlags(TraceFlags.SAMPLED), state)
    events = [Event(draw(TEXT), draw(bounded_attrs()), draw(UINT64)) for _ in range(draw(st.integers(0, 3)))]
    links = [Link(SpanContext(draw(TRACE_IDS), draw(SPAN_IDS), draw(st.booleans())), draw(bounded_attrs()))
             for _ in range(draw(st.integers(0, 2)))]
    if draw(st.booleans()):
        ev = BoundedList.from_seq(None, events)
        ev.dropped = draw(st.integers(0, 5))
        events = ev
    if draw(st.booleans()):
        ln = BoundedList.from_seq(None, links)
        ln.dropped = draw(st.integers(0, 5))
        links = ln
    code = draw(st.sampled_from([StatusCode.UNSET, StatusCode.OK, StatusCode.ERROR]))
    status = Status(code, draw(st.one_of(st.none(), st.text(min_size=1))) if code is StatusCode.ERROR else None)
    start = draw(UINT64)
    return ReadableSpan(draw(TEXT), context=ctx, parent=parent, resource=resource, attributes=draw(bounded_attrs()),
                        events=events, links=links, kind=draw(st.sampled_from(list(SpanKind))), status=status,
                        start_time=start, end_time=draw(st.integers(start, 2**64 - 1)), instrumentation_scope=scope)


@st.composite
def batches(draw):
    out = []
    for _ in range(draw(st.integers(1, 2))):  # resources
        resource = Resource(draw(ATTRS), draw(st.one_of(st.just(""), st.text(min_size=1, max_size=20))))
        for _ in range(draw(st.integers(1, 2))):  # scopes
            scope = draw(scopes())
            out.extend(draw(spans(resource, scope)) for _ in range(draw(st.integers(1, 3))))
    return out


# ----------------------------------------------------------------------------- comparison


def norm(v):
    """Comparable form: sequences as tuples, NaN as a marker."""
    if isinstance(v, float) and math.isnan(v):
        return ("<nan>",)
    if isinstance(v, (list, tuple)):
        return tuple(norm(x) for x in v)
    if isinstance(v, dict) or hasattr(v, "items"):
        return {k: norm(x) for k, x in v.items()}
    return v


def same_attrs(got, want) -> None:
    assert norm(dict(got or {})) == norm(dict(want or {}))
    for k, v in (want or {}).items():  # types kept exactly (int stays int, bool stays bool)
        assert type(got[k]) is type(v) or isinstance(v, (list, tuple)) and isinstance(got[k], tuple), k


def same_scope(got, want) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.name, got.version, got.schema_url) == (want.name, want.version, want.schema_url)
    same_attrs(got.attributes, want.attributes)


def same_span(got: ReadableSpan, want: ReadableSpan) -> None:
    assert got.name == want.name
    assert got.kind is want.kind
    assert (got.start_time, got.end_time) == (want.start_time, want.end_time)
    g, w = got.context, want.context
    assert (g.trace_id, g.span_id, g.is_remote) == (w.trace_id, w.span_id, w.is_remote)
    assert list(g.trace_state.items()) == list(w.trace_state.items())
    assert g.trace_flags.sampled  # the SDK's encoder does not send the flags: exported spans are sampled
    if want.parent is None:
        assert got.parent is None
    else:
        assert (got.parent.trace_id, got.parent.span_id, got.parent.is_remote) == \
            (want.parent.trace_id, want.parent.span_id, want.parent.is_remote)
    same_attrs(got.attributes, want.attributes)
    assert got.dropped_attributes == want.dropped_attributes
    assert got.dropped_events == want.dropped_events
    assert got.dropped_links == want.dropped_links
    assert len(got.events) == len(want.events)
    for ge, we in zip(got.events, want.events):
        assert (ge.name, ge.timestamp, ge.dropped_attributes) == (we.name, we.timestamp, we.dropped_attributes)
        same_attrs(ge.attributes, we.attributes)
    assert len(got.links) == len(want.links)
    for gl, wl in zip(got.links, want.links):
        assert (gl.context.trace_id, gl.context.span_id, gl.context.is_remote) == \
            (wl.context.trace_id, wl.context.span_id, wl.context.is_remote)
        same_attrs(gl.attributes, wl.attributes)
        assert gl.dropped_attributes == wl.dropped_attributes
    assert got.status.status_code is want.status.status_code
    assert got.status.description == want.status.description
    same_attrs(got.resource.attributes, want.resource.attributes)
    assert got.resource.schema_url == want.resource.schema_url
    same_scope(got.instrumentation_scope, want.instrumentation_scope)


def same_spans(got: list, want: list) -> None:
    # the encoder groups spans by resource and scope: compare per span id
    assert len(got) == len(want)
    by_key = {(s.context.trace_id, s.context.span_id, id(s)): s for s in want}
    remaining = list(by_key.values())
    for g in got:
        candidates = [w for w in remaining if (w.context.trace_id, w.context.span_id, w.name, w.start_time)
                      == (g.context.trace_id, g.context.span_id, g.name, g.start_time)]
        assert candidates, g.name
        for i, w in enumerate(candidates):  # spans may share all four (hypothesis makes such batches)
            try:
                same_span(g, w)
            except AssertionError:
                if i == len(candidates) - 1:
                    raise
                continue
            remaining.remove(w)
            break


FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- round trips


@FAST
@given(batches())
def test_protobuf_round_trip(batch):
    body = encode_spans(batch).SerializeToString()
    decoded = decode_traces(body)
    assert decoded.rejected == 0
    same_spans(decoded.spans, batch)


@FAST
@given(batches())
def test_spec_json_round_trip(batch):
    """JSON per the OTLP spec built from the protobuf (hex ids, integer enums, int64 as strings)."""
    decoded = decode_traces(spec_json(encode_spans(batch)), json_body=True)
    assert decoded.rejected == 0
    same_spans(decoded.spans, batch)


@FAST
@given(batches())
def test_official_json_encoder_round_trip(batch):
    enc = official_json_encoder()
    if enc is None:
        pytest.skip("opentelemetry-exporter-otlp-json-common is not installed; spec JSON is covered above")
    decoded = decode_traces(enc[0](batch).to_json().encode(), json_body=True)
    assert decoded.rejected == 0
    same_spans(decoded.spans, batch)


def test_resource_and_scope_objects_are_shared():
    """A run's resource decodes once: every span of a request (and of later ones) shares it."""
    res = Resource({"rl.run.id": "r1", "rl.project.name": "p"})
    scope = InstrumentationScope("otel_rl", "0.1.0")
    batch = [ReadableSpan(f"s{i}", context=SpanContext(7, i + 1, False), resource=res, attributes={},
                          start_time=1, end_time=2, instrumentation_scope=scope) for i in range(5)]
    body = encode_spans(batch).SerializeToString()
    a, b = decode_traces(body).spans, decode_traces(body).spans
    assert len({id(s.resource) for s in a + b}) == 1
    assert len({id(s.instrumentation_scope) for s in a + b}) == 1
    assert dict(a[0].resource.attributes) == dict(res.attributes)


# ----------------------------------------------------------------------------- what encoders don't send


def _one(**span_fields) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add()
    s.trace_id = bytes(range(1, 17))
    s.span_id = bytes(range(1, 9))
    s.name = "x"
    for k, v in span_fields.items():
        setattr(s, k, v)
    return req


@pytest.mark.parametrize("fields, reason", [
    ({"trace_id": b"short"}, "trace_id"),
    ({"trace_id": bytes(16)}, "trace_id"),
    ({"span_id": b""}, "span_id"),
    ({"span_id": bytes(8)}, "span_id"),
    ({"parent_span_id": b"123"}, "parent_span_id"),
])
def test_invalid_ids_reject_only_that_span(fields, reason):
    req = _one(**fields)
    good = req.resource_spans[0].scope_spans[0].spans.add()
    good.CopyFrom(_one().resource_spans[0].scope_spans[0].spans[0])
    decoded = decode_traces(req.SerializeToString())
    assert decoded.rejected == 1 and len(decoded.spans) == 1
    assert reason in decoded.error_message()


def _kv(span, key: str, **value) -> None:
    kv = span.attributes.add()
    kv.key = key
    for field, v in value.items():
        setattr(kv.value, field, v)


_WRONG = {int: {"string_value": "7"}, bool: {"int_value": 1}, str: {"int_value": 7}}
_RIGHT = {int: {"int_value": 7}, bool: {"bool_value": True}, str: {"string_value": "x"}}


@pytest.mark.parametrize("key", sorted(TYPED))
def test_typed_attributes_are_checked_while_decoding_with_the_validators_reasons(key):
    """Each typed rl.*/gen_ai.* attribute checked as it is decoded: a wrong type refuses that span alone with
    `span_problem`'s reason; the right type, or a repeated key whose last value is right, is accepted."""
    want = TYPED[key]
    req = _one()
    spans = req.resource_spans[0].scope_spans[0].spans
    bad = spans[0]
    _kv(bad, key, **_WRONG[want])
    repeated = spans.add()
    repeated.CopyFrom(_one().resource_spans[0].scope_spans[0].spans[0])
    _kv(repeated, key, **_WRONG[want])
    _kv(repeated, key, **_RIGHT[want])
    good = spans.add()
    good.CopyFrom(_one().resource_spans[0].scope_spans[0].spans[0])
    _kv(good, key, **_RIGHT[want])
    decoded = decode_traces(req.SerializeToString())
    reason = span_problem("x", {key: next(iter(_WRONG[want].values()))}, False)
    assert reason and decoded.reasons == {reason: 1}
    assert [type(s.attributes[key]) for s in decoded.spans] == [want, want]


def test_json_details_of_the_spec():
    body = (b'{"resourceSpans":[{"resource":{"attributes":[{"key":"rl.run.id","value":{"stringValue":"r"}}]},'
            b'"scopeSpans":[{"scope":{"name":"s"},"spans":[{"traceId":"0102030405060708090A0B0C0D0E0F10",'
            b'"spanId":"0102030405060708","parentSpanId":"","name":"n","kind":3,'
            b'"startTimeUnixNano":1700000000000000001,"endTimeUnixNano":"1700000000000000002",'
            b'"status":{"code":2,"message":"bad"},"someFutureField":{"x":1},'
            b'"attributes":[{"key":"i","value":{"intValue":5}},{"key":"big","value":{"intValue":"-9223372036854775808"}},'
            b'{"key":"d","value":{"doubleValue":"NaN"}},{"key":"e","value":{}}],'
            b'"events":[{"timeUnixNano":"3","name":"ev"}],'
            b'"links":[{"traceId":"ffffffffffffffffffffffffffffffff","spanId":"00000000000000ff","flags":768}]}]}]}]}')
    (s,) = decode_traces(body, json_body=True).spans
    assert s.context.trace_id == 0x0102030405060708090A0B0C0D0E0F10 and s.context.span_id == 0x0102030405060708
    assert s.parent is None and s.kind is SpanKind.CLIENT and s.name == "n"
    assert (s.start_time, s.end_time) == (1700000000000000001, 1700000000000000002)
    assert s.status.status_code is StatusCode.ERROR and s.status.description == "bad"
    assert s.attributes["i"] == 5 and s.attributes["big"] == -(2**63) and math.isnan(s.attributes["d"])
    assert s.attributes["e"] is None
    assert [(e.name, e.timestamp) for e in s.events] == [("ev", 3)]
    assert s.links[0].context.trace_id == 2**128 - 1 and s.links[0].context.is_remote
    assert s.resource.attributes["rl.run.id"] == "r"


@pytest.mark.parametrize("body, json_body", [
    (b"\xff\xfe garbage", False),
    (b"\x0a\x05\x0a\x03", False),  # truncated nested message
    (b"not json", True),
    (b"[1, 2]", True),
    (b'{"resourceSpans": 5}', True),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', True),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "-1"}]}]}]}', True),
    (b"[" * 100_000 + b"]" * 100_000, True),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, True),
])
def test_garbage_is_a_decode_error(body, json_body):
    with pytest.raises(DecodeError):
        decode_traces(body, json_body)


def test_unknown_enum_names_are_ignored_like_unknown_fields():
    body = (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "0102030405060708090a0b0c0d0e0f10", '
            b'"spanId": "0102030405060708", "kind": "SPAN_KIND_FROM_THE_FUTURE"}]}]}]}')
    (s,) = decode_traces(body, json_body=True).spans
    assert s.kind is SpanKind.INTERNAL


def test_deeply_nested_values_are_a_decode_error_not_a_crash():
    value = '{"stringValue":"x"}'
    for _ in range(200):
        value = '{"arrayValue":{"values":[' + value + "]}}"
    body = ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"0102030405060708090a0b0c0d0e0f10",'
            '"spanId":"0102030405060708","attributes":[{"key":"k","value":' + value + '}]}]}]}]}').encode()
    try:
        decoded = decode_traces(body, json_body=True)
    except DecodeError:
        return
    assert len(decoded.spans) == 1  # accepted is fine too, as long as nothing but DecodeError escapes


def test_metrics_are_counted():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource({"rl.run.id": "r9", "rl.project.name": "p",
                                                "rl.experiment.name": "e"}), metric_readers=[reader])
    meter = provider.get_meter("m")
    meter.create_counter("c").add(3, {"a": "1"})
    meter.create_counter("c2").add(1, {"a": "2"})
    meter.create_histogram("h").record(1.5)
    meter.create_gauge("g").set(2.0)
    data = reader.get_metrics_data()
    pb = encode_metrics(data)
    for body, is_json in ((pb.SerializeToString(), False), (spec_json(pb), True)):
        summary = decode_metrics(body, is_json)
        assert (summary.metrics, summary.points) == (4, 4)
        assert summary.runs == {("p", "e", "r9")}
    provider.shutdown()


@FAST
@given(batches())
def test_grpc_encoding_is_told_from_the_first_bytes_and_no_request_looks_compressed(batch):
    """gRPC messages reach the bridge as sent (grpcio's decompression is off): gzip and zlib are told by
    their first bytes, and no OTLP request, traces or metrics, is taken for either."""
    import gzip
    import zlib

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    from otel_rl.bridge._grpc import encoding_of

    body = encode_spans(batch).SerializeToString()
    assert encoding_of(body) == ""
    metrics = ExportMetricsServiceRequest()
    metrics.resource_metrics.add().schema_url = "x"
    assert encoding_of(metrics.SerializeToString()) == ""
    assert encoding_of(gzip.compress(body)) == "gzip"
    for level in (0, 1, 6, 9):
        assert encoding_of(zlib.compress(body, level)) == "deflate"
