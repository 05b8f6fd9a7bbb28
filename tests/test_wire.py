"""`otel_rl._wire.pack`: a light span packs to the same tuple as the SDK `ReadableSpan` it stands for,
whichever way its fields are read (the light spans' short path reads their contexts as tuples and knows
their shared UNSET status); and `unpack` gives back what the record builder reads."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, Status, StatusCode

from otel_rl import _lightspan
from otel_rl._token2text import _span_id, span_ids
from otel_rl._wire import pack, unpack


def _spans() -> list:
    ended: list = []
    tracer = _lightspan.LightTracer(ended.append, Resource.create({"service.name": "t"}),
                                    InstrumentationScope("t", "1"))
    root = tracer.start("root", None, {"rl.step": 3, "rl.span_kind": "AGENT"})
    child = tracer.start("child", root.get_span_context(), {"gen_ai.usage.input_tokens": 5},
                         [Link(root.get_span_context())])
    child.add_event("note", {"k": "v", "n": 2}, timestamp=123)
    child.set_status(Status(StatusCode.ERROR, "boom"))
    child.end(end_time=10**18 + 5)
    ok = tracer.start("ok", root.get_span_context(), {})
    ok.set_status(StatusCode.OK)
    ok.end()
    root.end()
    return [child, ok, root]


def test_light_spans_pack_as_their_readable_spans_do():
    assert _lightspan.CONTEXT_IS_TUPLE  # the short path is the one under test on this API version
    spans = _spans()
    for s in spans:
        assert pack(s) == pack(s.readable())
        assert pack(s, ("job",)) == (*pack(s.readable()), ("job",))
    child, ok, root = spans
    t = pack(child)
    assert (t[0], t[1], t[2]) == (root.get_span_context().trace_id, child.get_span_context().span_id,
                                  root.get_span_context().span_id)
    assert t[3:6] == ("child", child._start, 10**18 + 5)
    assert t[6] == {"gen_ai.usage.input_tokens": 5} and t[6] is not child._attributes
    assert t[7] == (("note", 123, {"k": "v", "n": 2}),)
    assert t[8:] == ("ERROR", "boom")
    assert pack(ok)[8:] == ("OK", None) and pack(root)[8:] == ("UNSET", None) and pack(root)[2] == 0


def test_unpacked_spans_carry_the_ids_and_fields_back():
    spans = _spans()
    back = unpack([pack(s) for s in spans], {"service.name": "t"}, seq=7)
    for s, w in zip(spans, back):
        r = s.readable()
        assert (w.context.trace_id, w.context.span_id) == (r.context.trace_id, r.context.span_id)
        assert (w.parent.span_id if w.parent else None) == (r.parent.span_id if r.parent else None)
        assert (w.name, w.start_time, w.end_time, w.attributes) == (r.name, r.start_time, r.end_time,
                                                                    dict(r.attributes))
        assert w.status.status_code == r.status.status_code.name and w.seq == 7
    assert span_ids(spans) == [_span_id(s) for s in spans] == [s.readable().context.span_id for s in spans]


class _Unpickled:
    """A pickle that, loaded, creates the file `path`: shows whether bytes were ever unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_op_values_as_bytes_are_unpickled_only_from_light_spans(tmp_path):
    """A light span's inputs and output may be copies (bytes, `serialize.snapshot`) that the receiving
    side makes into JSON text.  Bytes under those keys in any other span (the bridge decodes OTLP bytes
    values as bytes) are data: packed as their JSON text, never unpickled."""
    import pickle

    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    from otel_rl.export_process.receiver import Receiver
    from otel_rl.serialize import snapshot, to_json

    marker = tmp_path / "unpickled"
    blob = pickle.dumps(_Unpickled(str(marker)))
    ctx = SpanContext(0xA1, 0xB2, False, TraceFlags(TraceFlags.SAMPLED))
    foreign = ReadableSpan("received", context=ctx, attributes={"rl.op.inputs": blob, "rl.op.output": blob,
                                                                "other": "kept"},
                           start_time=1, end_time=2)
    t = pack(foreign)
    assert t[6] == {"rl.op.inputs": to_json(blob)[0], "rl.op.output": to_json(blob)[0], "other": "kept"}
    assert foreign.attributes["rl.op.inputs"] == blob  # the span itself is left as it is

    direct: list = []  # ended light spans as otel-rl's pipeline gets them
    tracer = _lightspan.LightTracer(direct.append, Resource.create({}), InstrumentationScope("t", "1"))
    own = tracer.start("op", None, {"rl.op.inputs": snapshot({"ids": [1, 2]})[0]})
    own._attributes["rl.op.output"] = snapshot([3])[0]
    own.end()
    mine = pack(own)
    assert type(mine[6]["rl.op.inputs"]) is bytes  # travels as the copy

    Receiver({}).put([], [], [t, mine], {})
    assert not marker.exists()
    assert t[6]["rl.op.inputs"] == to_json(blob)[0]
    assert mine[6] == {"rl.op.inputs": '{"ids": [1, 2]}', "rl.op.output": "[3]"}
