"""The C decoder (`otel_rl.bridge._otlp`) against the decoder through the generated protobuf messages.

Both must give the same spans, the same rejections and the same errors for any body: what the official
encoder makes, what it never makes but the protobuf wire format allows (fields out of order, a scalar
repeated, a message field repeated and merged, unknown fields of every wire type, a known field with an
unexpected wire type), and what is not protobuf at all (every truncation and random corruption of a body).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, Status, StatusCode

from otel_rl import records
from otel_rl import semconv as sc
from otel_rl.bridge import decode
from otel_rl.bridge.core import Bridge, Settings
from otel_rl.bridge.decode import DecodeError, decode_traces

from .test_decode import batches, norm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_c_decoder_is_built_and_in_use():
    """The install builds it (setup.py); the bridge decodes protobuf with it."""
    assert decode.NATIVE, "otel_rl.bridge._otlp was not built: install with a C compiler"


def both(body: bytes):
    """(spans, reasons) from each decoder, or the error each raised."""
    out = []
    for native in (True, False):
        try:
            d = decode_traces(body, native=native)
            out.append((d.spans, dict(d.reasons), len(d.resources)))
        except DecodeError as exc:
            out.append(("DecodeError", str(exc)))
    return out


def _ctx(c):
    return None if c is None else (c.trace_id, c.span_id, c.is_remote, int(c.trace_flags), list(c.trace_state.items()),
                                   c.is_valid)


def _typed(attrs):
    return None if attrs is None else (norm(dict(attrs)), [(k, type(v)) for k, v in attrs.items()])


def fields_of(s: ReadableSpan) -> tuple:
    """Everything a span holds, comparable (types of attribute values included)."""
    scope = s.instrumentation_scope
    return (
        s.name, s.kind, s.start_time, s.end_time, _ctx(s.context), _ctx(s.parent), _typed(s.attributes),
        s.dropped_attributes, s.dropped_events, s.dropped_links,
        [(e.name, e.timestamp, _typed(e.attributes), e.dropped_attributes) for e in s.events],
        [(_ctx(ln.context), _typed(ln.attributes), ln.dropped_attributes) for ln in s.links],
        s.status.status_code, s.status.description,
        _typed(s.resource.attributes), s.resource.schema_url,
        None if scope is None else (scope.name, scope.version, scope.schema_url, _typed(scope.attributes)),
    )


def assert_same(body: bytes) -> None:
    c, py = both(body)
    if c[0] == "DecodeError" or py[0] == "DecodeError":
        assert c[0] == py[0], (c, py)
        return
    assert [fields_of(s) for s in c[0]] == [fields_of(s) for s in py[0]]
    assert c[1:] == py[1:]
    for got, want in zip(c[0], py[0]):
        assert type(got) is type(want) is ReadableSpan
        assert list(vars(got)) == list(vars(want))  # the same instance attributes, in the same order


@FAST
@given(batches())
def test_the_same_spans_as_the_generated_messages_give(batch):
    assert_same(encode_spans(batch).SerializeToString())


# ----------------------------------------------------------------------------- the wire format by hand


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(field: int, wt: int) -> bytes:
    return varint(field << 3 | wt)


def ld(field: int, payload: bytes) -> bytes:
    return tag(field, 2) + varint(len(payload)) + payload


def fixed64(field: int, n: int) -> bytes:
    return tag(field, 1) + n.to_bytes(8, "little")


def kv(key: str, value: bytes) -> bytes:
    return ld(1, key.encode()) + ld(2, value)


def request(*spans: bytes, resource: bytes = ld(1, kv(sc.RL_RUN_ID, ld(1, b"r1"))), scope: bytes = ld(1, b"s")) -> bytes:
    return ld(1, ld(1, resource) + ld(2, ld(1, scope) + b"".join(ld(2, s) for s in spans)))


TID = ld(1, bytes(range(1, 17)))
SID = ld(2, bytes(range(1, 9)))
UNKNOWN = [
    tag(99, 0) + varint(2**63),  # varint
    tag(98, 1) + b"\x01" * 8,  # fixed64
    ld(97, b"\xff\xfe not utf-8, but unknown"),  # length-delimited
    tag(96, 5) + b"\x02" * 4,  # fixed32
    tag(95, 3) + tag(1, 0) + varint(5) + tag(2, 3) + tag(1, 5) + b"abcd" + tag(2, 4) + tag(95, 4),  # nested groups
]


@pytest.mark.parametrize("extra", UNKNOWN, ids=["varint", "fixed64", "len", "fixed32", "group"])
def test_unknown_fields_are_skipped_everywhere(extra):
    span = TID + extra + SID + ld(5, b"name") + extra + ld(9, kv("k", ld(1, b"v") + extra) + extra)
    body = request(span + extra, resource=ld(1, kv("rl.run.id", ld(1, b"r") + extra) + extra) + extra)
    body = body + extra
    assert_same(body)
    (s,) = decode_traces(body).spans
    assert s.name == "name" and dict(s.attributes) == {"k": "v"}


def test_what_encoders_never_send_but_protobuf_allows():
    status_ok = ld(15, tag(3, 0) + varint(1))
    status_error = ld(15, ld(2, b"first") + tag(3, 0) + varint(2))
    cases = [
        # fields in reverse order; scalars repeated (the last wins)
        ld(5, b"b") + fixed64(8, 9) + fixed64(7, 3) + SID + TID + ld(5, b"last") + fixed64(7, 4),
        # a known field with another wire type is an unknown field
        TID + SID + tag(5, 0) + varint(7) + tag(7, 0) + varint(5) + ld(6, b"xx"),
        # the status twice: merged (code from the first, message from the second)
        TID + SID + status_error + ld(15, ld(2, b"second")),
        TID + SID + status_ok + ld(15, ld(2, b"msg")),
        # an attribute's value twice: merged (the later scalar wins; arrays and kvlists join)
        TID + SID + ld(9, ld(1, b"k") + ld(2, ld(1, b"a")) + ld(2, tag(3, 0) + varint(5))),
        TID + SID + ld(9, ld(1, b"k") + ld(2, ld(5, ld(1, tag(3, 0) + varint(1)))) + ld(2, ld(5, ld(1, ld(1, b"x"))))),
        TID + SID + ld(9, ld(1, b"k") + ld(2, ld(6, kv("a", ld(1, b"1")))) + ld(2, ld(6, kv("b", ld(1, b"2"))))),
        # values with no Python form, an empty value, a missing key
        TID + SID + ld(9, ld(1, b"k") + ld(2, tag(8, 0) + varint(3))) + ld(9, ld(1, b"e")) + ld(9, ld(2, ld(1, b"v"))),
        # a repeated key (the later value wins, at the first one's place), negative ints, a double
        TID + SID + ld(9, kv("a", tag(3, 0) + varint(-5))) + ld(9, kv("b", fixed64(4, 0x400921FB54442D18)))
        + ld(9, kv("a", ld(1, b"again"))),
        # kinds and flags: unknown kind, remote parent, flags of every bit
        TID + SID + ld(4, bytes(range(9, 17))) + tag(6, 0) + varint(77) + tag(16, 5) + (0x3FF).to_bytes(4, "little"),
        TID + SID + tag(6, 0) + varint(-1) + tag(16, 5) + (0x1FF).to_bytes(4, "little"),
        # a trace state, dropped counts, events and links (the span goes through the Python builder)
        TID + SID + ld(3, b"a=1,b=2") + tag(10, 0) + varint(2) + tag(12, 0) + varint(3) + tag(14, 0) + varint(4),
        TID + SID + ld(11, fixed64(1, 5) + ld(2, b"ev") + ld(3, kv("x", ld(1, b"y"))) + tag(4, 0) + varint(1))
        + ld(13, ld(1, bytes(range(2, 18))) + ld(2, bytes(range(3, 11))) + ld(3, b"k=v") + tag(6, 5)
             + (0x300).to_bytes(4, "little")),
        # a link whose ids cannot be represented, an error status, an rl.log span with mismatched arrays
        TID + SID + ld(13, ld(1, b"short") + ld(2, bytes(range(3, 11)))),
        TID + SID + status_error,
        TID + SID + ld(5, sc.SPAN_LOG.encode()) + ld(9, kv(sc.RL_STEP, tag(3, 0) + varint(1)))
        + ld(9, kv(sc.RL_METRICS_KEYS, ld(5, ld(1, ld(1, b"m"))))),
        # typed attributes of the wrong type, then right
        TID + SID + ld(9, kv(sc.RL_STEP, ld(1, b"7"))),
        TID + SID + ld(9, kv(sc.RL_STEP, ld(1, b"7"))) + ld(9, kv(sc.RL_STEP, tag(3, 0) + varint(7))),
        # ids: missing, all zero, wrong length
        SID,
        ld(1, bytes(16)) + SID,
        TID + ld(2, bytes(8)),
        TID + SID + ld(4, b"\x01\x02"),
        # a trace id whose upper half is zero
        ld(1, bytes(8) + bytes(range(1, 9))) + SID,
    ]
    for span in cases:
        assert_same(request(span))
    assert_same(request(*cases))  # all in one request


def test_a_resource_whose_spans_cannot_make_records_and_scopes_repeated():
    bad_res = ld(1, kv(sc.RL_RUN_ID, tag(3, 0) + varint(5)))
    assert_same(request(TID + SID, TID + SID, resource=bad_res))
    # the resource and scope fields twice: merged; schema URLs; several resources and scopes
    body = ld(1, ld(1, ld(1, kv("a", ld(1, b"1")))) + ld(2, ld(1, ld(1, b"s1")) + ld(2, TID + SID)
                                                           + ld(1, ld(2, b"v1")) + ld(3, b"https://scope"))
              + ld(1, ld(1, kv("b", ld(1, b"2")))) + ld(3, b"https://res"))
    body += request(TID + SID + ld(5, b"other"))
    assert_same(body)
    d = decode_traces(body)
    assert dict(d.spans[0].resource.attributes) == {"a": "1", "b": "2"}
    assert d.spans[0].resource.schema_url == "https://res"
    sc0 = d.spans[0].instrumentation_scope
    assert (sc0.name, sc0.version, sc0.schema_url) == ("s1", "v1", "https://scope")


@pytest.mark.parametrize("body", [
    request(TID + SID + ld(5, b"\xff\xfe")),  # a span name that is not UTF-8
    request(TID + SID + ld(9, kv("k", ld(1, b"\xed\xa0\x80")))),  # a surrogate
    request(TID + SID + ld(9, ld(1, b"\xc3"))),  # a key cut inside a character
    request(TID + SID + ld(3, b"\x80")),  # the trace state
    request(TID + SID + ld(15, ld(2, b"\xff"))),  # the status message
    request(TID + SID, resource=ld(1, kv("k", ld(1, b"\xff")))),
    request(TID + SID, resource=kv("not", ld(1, b"attributes"))),  # a resource that does not parse
    request(TID + SID, scope=tag(1, 1) + b"\x00"),  # a scope cut short
    # under a resource whose spans are refused, what is not protobuf is still an error
    request(TID + SID + ld(5, b"\xff"), resource=ld(1, kv(sc.RL_RUN_ID, tag(3, 0) + varint(5)))),
    request(TID + SID, resource=ld(1, kv(sc.RL_RUN_ID, tag(3, 0) + varint(5))), scope=ld(1, b"\xff")),
    request(TID + SID + tag(7, 1) + b"\x00"),  # a fixed64 cut short
    request(TID + SID + tag(1, 6)),  # wire type 6 does not exist
    request(TID + SID + tag(95, 3) + tag(1, 0) + varint(1) + tag(94, 4)),  # a group closed by another field
    request(TID + SID + tag(1, 4)),  # a group's end without its start
    request(TID + SID + tag(0, 0) + varint(1)),  # field number 0
    request(TID + SID + b"\xff" * 11),  # a varint longer than 10 bytes
])
def test_what_is_not_protobuf_is_a_decode_error_for_both(body):
    c, py = both(body)
    assert c[0] == "DecodeError", c
    assert py[0] == "DecodeError", py


def test_nesting_deeper_than_protobuf_allows_is_a_decode_error():
    value = ld(1, b"x")
    for _ in range(200):
        value = ld(5, ld(1, value))
    with pytest.raises(DecodeError):
        decode_traces(request(TID + SID + ld(9, kv("k", value))), native=True)
    value = ld(1, b"x")
    for _ in range(30):
        value = ld(5, ld(1, value))
    assert_same(request(TID + SID + ld(9, kv("k", value))))


def _sample_body() -> bytes:
    res = Resource({sc.RL_RUN_ID: "r", sc.RL_PROJECT_NAME: "p"})
    scope = InstrumentationScope("otel_rl", "1")
    spans = []
    for i in range(4):
        root = SpanContext(10 + i, 100 + i, False)
        spans.append(ReadableSpan(f"op{i}", SpanContext(10 + i, 200 + i, False), root, res,
                                  {sc.RL_SPAN_KIND: "tool", "n": i, "xs": (1.5, 2.5), "m": {"a": (1, "b")}},
                                  status=Status(StatusCode.OK), start_time=1, end_time=2, instrumentation_scope=scope))
        spans.append(ReadableSpan(f"trajectory {i}", root, None, res, {sc.RL_STEP: i, sc.RL_VALIDATE: False},
                                  start_time=1, end_time=3, instrumentation_scope=scope))
    return encode_spans(spans).SerializeToString()


def test_every_truncation_of_a_body_decodes_alike():
    body = _sample_body()
    for n in range(len(body)):
        assert_same(body[:n])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_random_corruptions_of_a_body_decode_alike(seed):
    rnd = random.Random(seed)
    body = bytearray(_sample_body())
    for _ in range(rnd.randint(1, 4)):
        i = rnd.randrange(len(body))
        op = rnd.random()
        if op < 0.6:
            body[i] = rnd.randrange(256)
        elif op < 0.8:
            del body[i]
        else:
            body[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 3)))
    assert_same(bytes(body))


def test_spans_decoded_in_c_hold_what_their_constructor_would():
    """A span made in C and one made by `ReadableSpan(...)` from the same fields: equal, field by field."""
    req = ExportTraceServiceRequest.FromString(_sample_body())
    (c,) = [s for s in decode_traces(_sample_body(), native=True).spans if s.name == "op0"]
    (py,) = [s for s in decode_traces(req.SerializeToString(), native=False).spans if s.name == "op0"]
    for name, value in vars(py).items():
        got = vars(c)[name]
        if name in ("_context", "_parent"):
            assert type(got) is type(value) and tuple(got) == tuple(value), name
        else:
            assert got == value, name
    assert c.context.is_valid and c.parent.is_valid and c.status.is_ok


def test_siblings_share_their_parent_context_only_when_it_is_the_same():
    parent = ld(4, bytes(range(9, 17)))
    remote = tag(16, 5) + (0x300).to_bytes(4, "little")
    local = tag(16, 5) + (0x100).to_bytes(4, "little")
    other_parent = ld(4, bytes(range(10, 18)))
    spans = [TID + SID + parent + remote, TID + ld(2, b"\x02" * 8) + parent + remote,
             TID + ld(2, b"\x03" * 8) + parent + local, TID + ld(2, b"\x04" * 8) + other_parent + local]
    body = request(*spans)
    assert_same(body)
    a, b, c, d = decode_traces(body).spans
    assert a.parent is b.parent and a.parent.is_remote
    assert not c.parent.is_remote and c.parent.span_id == a.parent.span_id
    assert d.parent.span_id != c.parent.span_id


# ----------------------------------------------------------------------------- record nodes made in C

NODE_VALUES = st.one_of(st.none(), st.text(max_size=8), st.integers(-5, 5), st.floats(allow_nan=False),
                        st.booleans(), st.lists(st.text(max_size=3), max_size=2).map(tuple))


@st.composite
def node_spans(draw):
    """Hand-made spans the C node maker takes (the decoder's own statuses, a dict of attributes, no events)
    or leaves to Python (any other status, events, attributes that are no dict, times that are no int)."""
    attrs = draw(st.dictionaries(st.text(min_size=1, max_size=6), NODE_VALUES, max_size=4))
    for key in (sc.RL_SPAN_KIND, sc.RL_OP_INPUTS, sc.RL_OP_OUTPUT):
        if draw(st.booleans()):
            attrs[key] = draw(NODE_VALUES)
    status = draw(st.sampled_from([decode._OK, decode._UNSET, Status(StatusCode.OK), Status(StatusCode.ERROR, "bad")]))
    events = [Event("e", {"k": 1}, 7)] if draw(st.integers(0, 5)) == 0 else []
    tid = draw(st.integers(1, 2**128 - 1))
    parent = SpanContext(tid, draw(st.integers(1, 2**64 - 1)), False) if draw(st.booleans()) else None
    times = st.one_of(st.none(), st.integers(0, 2**64 - 1), st.just(0.5))
    start, end = draw(times), draw(times)
    span = ReadableSpan(draw(st.text(max_size=6)), context=SpanContext(tid, draw(st.integers(1, 2**64 - 1)), False),
                        parent=parent, attributes=attrs if draw(st.integers(0, 5)) else BoundedAttributes(8, attrs),
                        events=events, status=status, start_time=start, end_time=end)  # type: ignore[arg-type]
    if draw(st.booleans()):
        span._events = ()  # as the C decoder leaves them
    return span


def node_fields(n) -> list:
    return [(f.name, getattr(n, f.name), type(getattr(n, f.name))) for f in dataclasses.fields(records.SpanNode)]


def test_the_bridge_builds_its_nodes_in_c():
    assert decode.node_maker is not None
    bridge = Bridge(Settings(http_address=None, grpc_address=None, exporters=("discard",)))
    try:
        assert bridge.pipeline._builder._node is decode.node_maker
    finally:
        bridge.stop(5)


@FAST
@given(node_spans())
def test_nodes_made_in_c_equal_the_python_nodes(span):
    want = records._node(span)
    got = decode.node_maker(span)
    assert type(got) is records.SpanNode
    assert node_fields(got) == node_fields(want)
    assert got.children == [] and got.children is not want.children
    assert got.attributes is not span._attributes  # a copy: the span keeps its inputs and outputs
    assert dict(span.attributes) == dict(span._attributes)


@FAST
@given(batches())
def test_nodes_of_spans_decoded_in_c_equal_the_python_nodes(batch):
    for span in decode_traces(encode_spans(batch).SerializeToString(), native=True).spans:
        got, want = decode.node_maker(span), records._node(span)
        assert repr(node_fields(got)) == repr(node_fields(want))  # (repr: NaN values compare equal)


def test_a_node_keeps_its_own_attributes_and_the_span_its_own():
    (span,) = decode_traces(request(TID + SID + ld(5, b"op") + ld(9, kv(sc.RL_OP_INPUTS, ld(1, b"in")))
                                    + ld(9, kv(sc.RL_SPAN_KIND, ld(1, b"llm"))))).spans
    node = decode.node_maker(span)
    assert (node.name, node.kind, node.inputs, node.output, node.status, node.parent_id) == \
        ("op", "llm", "in", None, "UNSET", None)
    assert node.attributes == {sc.RL_SPAN_KIND: "llm"}
    assert span.attributes[sc.RL_OP_INPUTS] == "in"  # the span is left as it was
    node.attributes["x"] = 1
    assert "x" not in span.attributes


def _records_of(builder: records.RecordBuilder, spans) -> list:
    out = builder.build(spans) + builder.flush_partial()
    return [repr(dataclasses.asdict(r)) for r in out]


def test_the_same_records_with_nodes_made_in_c_or_in_python():
    """The bridge's builder (C nodes) and the default one, on the benchmark's span mix decoded in C: every record
    alike, trajectories whole."""
    import bench_bridge as bb

    spans = []
    for b in bb.pre_encode(bb.batches(990, "run-c", 128)):
        spans.extend(decode_traces(b.message.SerializeToString()).spans)
    got = _records_of(records.RecordBuilder(node=decode.node_maker), spans)
    assert got == _records_of(records.RecordBuilder(), spans)
    assert len(got) == 990 // 33 * 9


# ----------------------------------------------------------------------------- roots apart


@FAST
@given(batches())
def test_both_decoders_put_the_same_spans_apart_as_roots(batch):
    body = encode_spans(batch).SerializeToString()
    whole = decode_traces(body).spans
    got = {}
    for native in (True, False):
        d = decode_traces(body, native=native, roots=True)
        assert all(s.parent is None and s.name not in decode._RECORD_NAMES for s in d.roots)
        assert all(s.parent is not None or s.name in decode._RECORD_NAMES for s in d.spans)
        got[native] = ([fields_of(s) for s in d.spans], [fields_of(s) for s in d.roots])
        # each keeps the request's order
        assert [fields_of(s) for s in whole if s.parent is not None or s.name in decode._RECORD_NAMES] == got[native][0]
    assert got[True] == got[False]


def test_record_spans_without_a_parent_are_not_held_as_roots():
    body = request(TID + SID + ld(5, sc.SPAN_LOG.encode()) + ld(9, kv(sc.RL_STEP, tag(3, 0) + varint(1))),
                   TID + ld(2, b"\x02" * 8) + ld(5, b"rollout"),
                   TID + ld(2, b"\x03" * 8) + ld(4, b"\x02" * 8) + ld(5, b"op"))
    for native in (True, False):
        d = decode_traces(body, native=native, roots=True)
        assert [s.name for s in d.spans] == [sc.SPAN_LOG, "op"]
        assert [s.name for s in d.roots] == ["rollout"]
