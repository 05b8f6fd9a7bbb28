"""Light spans find their parent in OpenTelemetry's current context, whatever span type is current."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider


def _spans():
    tracer = TracerProvider().get_tracer("t")
    return tracer.start_span("a"), tracer.start_span("b")


def test_light_spans_start_under_whatever_span_is_current():
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otel_rl._lightspan import LightTracer

    light = LightTracer(lambda s: None, Resource.create({}), InstrumentationScope("t", "1"))
    sdk_span, _ = _spans()
    root = light.start_in_current("root", {})  # nothing current: the root of a new trace
    assert root._parent is None and root.get_span_context().is_valid
    token = otel_context.attach(trace_api.set_span_in_context(root))
    try:
        child = light.start_in_current("child", {})  # under a light span (read as a tuple)
    finally:
        otel_context.detach(token)
    assert child._parent is root.get_span_context()
    assert child.get_span_context().trace_id == root.get_span_context().trace_id
    assert child.get_span_context().span_id not in (0, root.get_span_context().span_id)
    token = otel_context.attach(trace_api.set_span_in_context(sdk_span))
    try:
        under_sdk = light.start_in_current("under-sdk", {})  # under an SDK span
    finally:
        otel_context.detach(token)
    assert under_sdk._parent == sdk_span.get_span_context()
    assert under_sdk.get_span_context().trace_id == sdk_span.get_span_context().trace_id
    invalid = trace_api.NonRecordingSpan(trace_api.INVALID_SPAN_CONTEXT)
    token = otel_context.attach(trace_api.set_span_in_context(invalid))
    try:
        orphan = light.start_in_current("orphan", {})  # under an invalid context: a new trace
    finally:
        otel_context.detach(token)
    assert orphan._parent is None
    assert orphan.get_span_context().trace_id not in (0, root.get_span_context().trace_id)
