"""`otel_rl._wire`: a span packs to a tuple of plain values whichever way it was made (a light span or the
SDK's own), and unpacks to a light span -- the SDK's `ReadableSpan` -- with the same public fields."""

from __future__ import annotations

import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, Status, StatusCode

from otel_rl import _lightspan
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


def _sdk_copy(s: ReadableSpan) -> ReadableSpan:
    """The SDK's plain `ReadableSpan` with `s`'s public fields."""
    return ReadableSpan(s.name, context=s.context, parent=s.parent, resource=s.resource,
                        attributes=dict(s.attributes), events=s.events, links=s.links, kind=s.kind,
                        status=s.status, start_time=s.start_time, end_time=s.end_time,
                        instrumentation_scope=s.instrumentation_scope)


def test_light_spans_pack_as_the_sdks_readable_spans_do():
    assert _lightspan.CONTEXT_IS_TUPLE  # the short path is the one under test on this API version
    spans = _spans()
    for s in spans:
        assert isinstance(s, ReadableSpan)
        assert pack(s) == pack(_sdk_copy(s))
        assert pack(s, ("job",)) == (*pack(_sdk_copy(s)), ("job",))
    child, ok, root = spans
    t = pack(child)
    assert (t[0], t[1], t[2]) == (root.get_span_context().trace_id, child.get_span_context().span_id,
                                  root.get_span_context().span_id)
    assert t[3:6] == ("child", child.start_time, 10**18 + 5)
    assert t[6] == {"gen_ai.usage.input_tokens": 5} and t[6] is not child._attributes
    assert t[7] == (("note", 123, {"k": "v", "n": 2}),)
    assert t[8:] == (StatusCode.ERROR.value, "boom")
    assert pack(ok)[8:] == (StatusCode.OK.value, None)
    assert pack(root)[8:] == (StatusCode.UNSET.value, None) and pack(root)[2] == 0


def test_unpacked_spans_are_light_spans_with_the_same_public_fields():
    spans = _spans()
    resource = Resource({"service.name": "t"})
    back = unpack([pack(s) for s in spans], resource)
    for s, w in zip(spans, back):
        assert type(w) is _lightspan.LightSpan and isinstance(w, ReadableSpan) and not w.is_recording()
        assert (w.context.trace_id, w.context.span_id) == (s.context.trace_id, s.context.span_id)
        assert (w.parent.span_id if w.parent else None) == (s.parent.span_id if s.parent else None)
        assert (w.name, w.start_time, w.end_time, dict(w.attributes)) == (s.name, s.start_time, s.end_time,
                                                                          dict(s.attributes))
        assert (w.status.status_code, w.status.description) == (s.status.status_code, s.status.description)
        assert [(e.name, e.timestamp, dict(e.attributes)) for e in w.events] == [
            (e.name, e.timestamp, dict(e.attributes)) for e in s.events]
        assert w.resource is resource
        assert json.loads(w.to_json())["status"] == json.loads(s.to_json())["status"]


class _Unpickled:
    """A pickle that, loaded, creates the file `path`: shows whether bytes were ever unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_op_values_as_bytes_are_unpickled_only_from_light_spans(tmp_path):
    """A light span's inputs and output may be copies (bytes, `serialize.snapshot`; the op wrapper marks the
    span) that the receiving side makes into JSON text.  Bytes under those keys in any other span (the bridge decodes OTLP bytes
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
    own._deferred = True  # as the op wrapper marks a span it left copies in
    own.end()
    mine = pack(own)
    assert type(mine[6]["rl.op.inputs"]) is bytes  # travels as the copy

    Receiver({}).put([], [], [t, mine], {})
    assert not marker.exists()
    assert t[6]["rl.op.inputs"] == to_json(blob)[0]
    assert mine[6] == {"rl.op.inputs": '{"ids": [1, 2]}', "rl.op.output": "[3]"}
