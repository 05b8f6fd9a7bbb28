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
