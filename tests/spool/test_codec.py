"""The spool codec: every record type and raw spans survive encode -> decode exactly."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

import otel_rl
from otel_rl.records import Generations, RunIdentity, RunStart, SpanNode, StepMetrics, Trajectory
from otel_rl.spool import codec
from otel_rl.spool.codec import CodecError, batch_items, decode_batch, encode_batch
from otel_rl.testing import CaptureExporter

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- exact comparison


def canon(x):
    """A comparable form that keeps what == loses: float bits (NaN, -0.0), bool vs int, tuple vs list."""
    t = type(x)
    if t is float:
        return ("f", struct.pack("<d", x))
    if t in (bool, int, str, bytes, type(None)):
        return (t.__name__, x)
    if t in (list, tuple):
        return (t.__name__, [canon(v) for v in x])
    if t is dict:
        return ("dict", [(canon(k), canon(v)) for k, v in x.items()])
    if t is SpanNode:
        return ("node", [canon(getattr(x, f)) for f in ("name", "kind", "span_id", "parent_id", "start_ns", "end_ns",
                                                         "attributes", "inputs", "output", "status",
                                                         "status_message", "events", "children")])
    if t in (RunStart, StepMetrics, Generations, Trajectory, RunIdentity):
        return (t.__name__, [canon(getattr(x, f)) for f in x.__dataclass_fields__])
    raise TypeError(t)


# ----------------------------------------------------------------------------- strategies

texts = st.text(st.characters(exclude_categories=()), max_size=12)  # includes lone surrogates
big_ints = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(), st.sampled_from([2**64, -2**64 - 1, 10**40]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]),
                   st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0]))
scalars = st.one_of(st.none(), st.booleans(), big_ints, floats, texts, st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
idents = st.builds(RunIdentity, texts, texts, texts)
times = st.integers(0, 2**64)


def metric_values():
    return st.dictionaries(texts, st.one_of(floats, big_ints, st.booleans()), max_size=20)


step_metrics = st.builds(StepMetrics, idents, big_ints, metric_values(), times)
run_starts = st.builds(RunStart, idents, st.dictionaries(texts, values, max_size=5), big_ints, times)
generations = st.builds(Generations, idents, big_ints, st.lists(st.tuples(texts, texts, floats), max_size=5), times)
opt_int = st.one_of(st.none(), big_ints)
opt_text = st.one_of(st.none(), texts)
events = st.lists(st.fixed_dictionaries({"name": texts, "time_ns": times,
                                         "attributes": st.dictionaries(texts, values)}), max_size=2)


def _node(children):
    return st.builds(SpanNode, name=texts, kind=st.sampled_from(["AGENT", "LLM", "TOOL", "CHAIN", "x"]),
                     span_id=st.integers(0, 2**64 - 1), parent_id=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
                     start_ns=times, end_ns=times, attributes=st.dictionaries(texts, values, max_size=3),
                     inputs=opt_text, output=opt_text, status=st.sampled_from(["OK", "ERROR", "UNSET"]),
                     status_message=opt_text, events=events, children=children)


trees = st.recursive(_node(st.just([])), lambda inner: _node(st.lists(inner, max_size=3)), max_leaves=8)
trajectories = st.builds(Trajectory, idents, st.integers(0, 2**128 - 1), opt_int, opt_int, opt_int, st.booleans(),
                         texts, trees, st.booleans())
records = st.lists(st.one_of(step_metrics, run_starts, generations, trajectories), max_size=6)


def _roundtrip(spans, recs, compress=True):
    data = encode_batch(spans, recs, compress=compress)
    assert batch_items(data) == len(spans) + len(recs)
    out_spans, out_recs = decode_batch(data)
    return data, out_spans, out_recs


# ----------------------------------------------------------------------------- records


@SETTINGS
@given(records, st.booleans())
def test_records_round_trip_exactly(recs, compress):
    _, spans, out = _roundtrip([], recs, compress)
    assert spans == []
    assert [canon(r) for r in out] == [canon(r) for r in recs]


@SETTINGS
@given(st.dictionaries(texts, values, max_size=6))
def test_any_value_round_trips_exactly(d):
    (out,) = _roundtrip([], [RunStart(RunIdentity("p", "e", "r"), d, 0, 0)])[2]
    assert canon(out.config) == canon(d)


def test_step_metrics_keep_exact_ints_bools_and_non_finite_floats():
    vals = {"loss": 0.1, "nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "neg0": -0.0, "big": 2**100,
            "neg": -(2**70), "n": 3, "t": True, "f": False, "指标/损失": 1e-300, "\ud800lone": 2.5}
    (r,) = _roundtrip([], [StepMetrics(RunIdentity("p", "e", "r"), 7, vals, 123)])[2]
    assert list(r.values) == list(vals)  # call order kept
    assert canon(r.values) == canon(vals)
    assert type(r.values["t"]) is bool and type(r.values["n"]) is int and r.values["big"] == 2**100


def test_deep_span_tree_is_not_recursive():
    """A 5000-deep chain of spans encodes and decodes (no RecursionError)."""
    root = node = SpanNode("n0", "CHAIN", 1, None, 0, 1, {}, None, None, "OK", None, [])
    for i in range(1, 5000):
        child = SpanNode(f"n{i}", "CHAIN", i + 1, i, i, i + 1, {"i": i}, None, None, "OK", None, [])
        node.children.append(child)
        node = child
    t = Trajectory(RunIdentity("p", "e", "r"), 99, 1, 0, 0, False, "deep", root)
    (out,) = _roundtrip([], [t])[2]
    a, b, depth = out.root, root, 0
    while True:  # compare iteratively
        assert (a.name, a.span_id, a.parent_id, a.attributes) == (b.name, b.span_id, b.parent_id, b.attributes)
        assert len(a.children) == len(b.children)
        if not a.children:
            break
        a, b, depth = a.children[0], b.children[0], depth + 1
    assert depth == 4999


# ----------------------------------------------------------------------------- raw spans

attr_scalars = st.one_of(texts, st.booleans(), st.integers(-2**63, 2**63 - 1), floats)
attr_values = st.one_of(attr_scalars, st.lists(texts, max_size=3).map(tuple),
                        st.lists(st.integers(-2**63, 2**63 - 1), max_size=3).map(tuple),
                        st.lists(floats, max_size=3).map(tuple), st.lists(st.booleans(), max_size=3).map(tuple))
attrs = st.dictionaries(texts.filter(bool), attr_values, max_size=4)  # OTel drops empty keys
contexts = st.builds(lambda t, s, f, r, ts: SpanContext(t, s, r, TraceFlags(f), TraceState(ts)),
                     st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1), st.integers(0, 255), st.booleans(),
                     st.lists(st.tuples(st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True),
                                        st.from_regex(r"[a-z0-9]{1,5}", fullmatch=True)), max_size=2,
                              unique_by=lambda kv: kv[0]))
resources = st.builds(lambda a, s: Resource(a, s), attrs, st.sampled_from(["", "https://opentelemetry.io/schemas/1"]))
scopes = st.builds(InstrumentationScope, texts, st.one_of(st.none(), texts), st.one_of(st.none(), texts),
                   st.one_of(st.none(), attrs))


@st.composite
def spans(draw):
    res = draw(st.lists(resources, min_size=1, max_size=2))  # shared by several spans, as in a real batch
    scs = draw(st.lists(st.one_of(st.none(), scopes), min_size=1, max_size=2))
    out = []
    for _ in range(draw(st.integers(0, 4))):
        out.append(ReadableSpan(
            draw(texts), context=draw(contexts), parent=draw(st.one_of(st.none(), contexts)),
            resource=draw(st.sampled_from(res)), attributes=draw(st.one_of(st.none(), attrs)),
            events=[Event(draw(texts), draw(st.one_of(st.none(), attrs)), draw(times))
                    for _ in range(draw(st.integers(0, 2)))],
            links=[Link(draw(contexts), draw(st.one_of(st.none(), attrs))) for _ in range(draw(st.integers(0, 2)))],
            kind=draw(st.sampled_from(list(SpanKind))),
            status=Status(draw(st.sampled_from(list(StatusCode))), draw(st.one_of(st.none(), texts))),
            start_time=draw(st.one_of(st.none(), times)), end_time=draw(st.one_of(st.none(), times)),
            instrumentation_scope=draw(st.sampled_from(scs))))
    return out


def span_canon(s):
    ctx = lambda c: None if c is None else (c.trace_id, c.span_id, int(c.trace_flags), c.is_remote,  # noqa: E731
                                            tuple(c.trace_state.items()))
    a = lambda m: None if m is None else canon(dict(m))  # noqa: E731
    sc = s.instrumentation_scope
    return (s.name, ctx(s.context), ctx(s.parent), s.kind, s.start_time, s.end_time, a(s.attributes),
            [(e.name, e.timestamp, a(e.attributes)) for e in s.events],
            [(ctx(link.context), a(link.attributes)) for link in s.links],
            s.status.status_code, s.status.description,
            (canon(dict(s.resource.attributes)), s.resource.schema_url),
            None if sc is None else (sc.name, sc.version, sc.schema_url, a(sc.attributes)))


@SETTINGS
@given(spans(), records)
def test_spans_round_trip_exactly(sp, recs):
    _, out_spans, out_recs = _roundtrip(sp, recs)
    assert [span_canon(s) for s in out_spans] == [span_canon(s) for s in sp]
    assert [canon(r) for r in out_recs] == [canon(r) for r in recs]


def test_real_pipeline_output_round_trips():
    """What an instrumented trainer really produces: spans and records from the pipeline."""
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], batch_delay_s=0.01, tracing=True, project="codec")

    @otel_rl.op
    def f(x):
        return {"x": x, "l": [1, 2.5, None]}

    try:
        for n in range(3):
            with otel_rl.step(n):
                with otel_rl.trajectory(sample_index=0):
                    f(n)
                try:
                    with otel_rl.trajectory(sample_index=1):
                        raise ValueError("boom")
                except ValueError:
                    pass
                otel_rl.log({"a": 1.5, "b": 2**70, "c": True, "d": math.nan, "e": -math.inf, "f": 3}, step=n)
            otel_rl.log_generations([("p", "o", 0.5), ("q", "", math.nan)], step=n)
        assert h.flush(10)
    finally:
        h.shutdown()
    assert cap.spans and cap.records
    _, out_spans, out_recs = _roundtrip(cap.spans, cap.records)
    assert [canon(r) for r in out_recs] == [canon(r) for r in cap.records]
    assert [span_canon(s) for s in out_spans] == [span_canon(s) for s in cap.spans]
    assert [s.to_json() for s in out_spans] == [s.to_json() for s in cap.spans]
    assert {type(r).__name__ for r in out_recs} == {"RunStart", "StepMetrics", "Generations", "Trajectory"}


# ----------------------------------------------------------------------------- what it refuses


@SETTINGS
@given(records.filter(bool), st.data())
def test_truncated_batch_is_rejected(recs, data):
    raw = encode_batch([], recs, compress=False)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CodecError):
        decode_batch(raw[:cut])


def test_unknown_version_and_garbage_are_rejected():
    raw = encode_batch([], [StepMetrics(RunIdentity("p", "e", "r"), 1, {"a": 1.0}, 1)])
    with pytest.raises(CodecError, match="version"):
        decode_batch(bytes([codec.VERSION + 1]) + raw[1:])
    with pytest.raises(CodecError):
        decode_batch(raw[:2] + b"\xff" * 20)
    with pytest.raises(CodecError):
        decode_batch(raw + b"\x00")  # bytes left over


def test_compression_is_used_for_big_batches_only():
    small = encode_batch([], [StepMetrics(RunIdentity("p", "e", "r"), 1, {"a": 1.0}, 1)])
    big_rec = StepMetrics(RunIdentity("p", "e", "r"), 1, {f"actor/key_{i}": float(i) for i in range(500)}, 1)
    big = encode_batch([], [big_rec])
    plain = encode_batch([], [big_rec], compress=False)
    assert not small[1] & codec.FLAG_ZLIB and big[1] & codec.FLAG_ZLIB and not plain[1] & codec.FLAG_ZLIB
    assert len(big) < len(plain) / 2
    assert zlib.decompress(big[3:])  # the body after version, flags and the item count
    assert canon(decode_batch(big)[1][0]) == canon(big_rec)


def test_unknown_record_type_cannot_be_encoded():
    class Other:
        run = RunIdentity("p", "e", "r")

    with pytest.raises(CodecError):
        encode_batch([], [Other()])
    with pytest.raises(CodecError):
        encode_batch([], [object()])
