"""otel_rl._context: the current span set and read in one step, the same as through OpenTelemetry's API."""

from __future__ import annotations

import asyncio
import importlib
import logging

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider

from otel_rl import _context


def _spans():
    tracer = TracerProvider().get_tracer("t")
    return tracer.start_span("a"), tracer.start_span("b")


def test_the_default_runtime_context_takes_the_direct_path():
    assert _context.DIRECT


def test_attach_span_stores_what_the_api_stores_and_detach_restores():
    a, b = _spans()
    before = otel_context.get_current()
    token = _context.attach_span(a)
    try:
        now = otel_context.get_current()
        assert type(now) is otel_context.Context
        assert now == trace_api.set_span_in_context(a, before)  # the same entries: the old ones and the span
        assert trace_api.get_current_span() is a and _context.current_span() is a
        inner = otel_context.attach(trace_api.set_span_in_context(b))  # the API nested inside: both see it
        assert _context.current_span() is b
        otel_context.detach(inner)
        assert trace_api.get_current_span() is a
    finally:
        _context.detach(token)
    assert otel_context.get_current() is before
    assert _context.current_span() is trace_api.INVALID_SPAN


def test_attach_span_on_a_given_base_drops_the_current_entries():
    a, b = _spans()
    outer = otel_context.attach(otel_context.set_value("k", 1, trace_api.set_span_in_context(a)))
    try:
        token = _context.attach_span(b, otel_context.Context())
        assert otel_context.get_current() == trace_api.set_span_in_context(b, otel_context.Context())
        assert otel_context.get_value("k") is None and _context.current_span() is b
        _context.detach(token)
        assert otel_context.get_value("k") == 1 and _context.current_span() is a
    finally:
        otel_context.detach(outer)


def test_current_span_ignores_what_is_not_a_span():
    token = otel_context.attach(otel_context.set_value("current-span-key", "not a span"))
    try:
        assert trace_api.get_current_span() is trace_api.INVALID_SPAN
        assert _context.current_span() is trace_api.INVALID_SPAN
    finally:
        otel_context.detach(token)


def test_detach_of_a_token_from_another_context_logs_as_the_api_and_does_not_raise(caplog):
    a, _ = _spans()
    holder = {}

    async def attach_in_a_task():
        holder["token"] = _context.attach_span(a)

    asyncio.run(attach_in_a_task())  # the token belongs to the task's context, not to this one
    with caplog.at_level(logging.ERROR):
        _context.detach(holder["token"])
    assert "Failed to detach context" in caplog.text
    assert _context.current_span() is trace_api.INVALID_SPAN


def test_another_runtime_context_goes_through_the_api(monkeypatch):
    class Other(type(otel_context._RUNTIME_CONTEXT)):  # what OTEL_PYTHON_CONTEXT could load: not the default
        pass

    monkeypatch.setattr(otel_context, "_RUNTIME_CONTEXT", Other())
    try:
        mod = importlib.reload(_context)
        assert not mod.DIRECT
        a, _ = _spans()
        token = mod.attach_span(a)
        assert trace_api.get_current_span() is a and mod.current_span() is a
        mod.detach(token)
        assert mod.current_span() is trace_api.INVALID_SPAN
    finally:
        monkeypatch.undo()
        importlib.reload(_context)
    assert _context.DIRECT


def test_current_raw_is_what_the_context_holds_under_the_span_key():
    a, _ = _spans()
    assert _context.current_raw() is None
    token = _context.attach_span(a)
    try:
        assert _context.current_raw() is a
    finally:
        _context.detach(token)
    token = otel_context.attach(otel_context.set_value(_context._SPAN_KEY, "not a span"))
    try:
        assert _context.current_raw() == "not a span"  # unchecked: callers compare its type to their own
        assert _context.current_span() is trace_api.INVALID_SPAN
    finally:
        otel_context.detach(token)


def test_light_spans_start_under_whatever_span_is_current():
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from otel_rl._lightspan import LightTracer

    light = LightTracer(lambda s: None, Resource.create({}), InstrumentationScope("t", "1"))
    sdk_span, _ = _spans()
    root = light.start_in_current("root", {})  # nothing current: the root of a new trace
    assert root._parent is None and root.get_span_context().is_valid
    token = _context.attach_span(root)
    try:
        child = light.start_in_current("child", {})  # under a light span (read as a tuple)
    finally:
        _context.detach(token)
    assert child._parent is root.get_span_context()
    assert child.get_span_context().trace_id == root.get_span_context().trace_id
    assert child.get_span_context().span_id not in (0, root.get_span_context().span_id)
    token = _context.attach_span(sdk_span)
    try:
        under_sdk = light.start_in_current("under-sdk", {})  # under an SDK span
    finally:
        _context.detach(token)
    assert under_sdk._parent == sdk_span.get_span_context()
    assert under_sdk.get_span_context().trace_id == sdk_span.get_span_context().trace_id
    token = _context.attach_span(trace_api.NonRecordingSpan(trace_api.INVALID_SPAN_CONTEXT))
    try:
        orphan = light.start_in_current("orphan", {})  # under an invalid context: a new trace
    finally:
        _context.detach(token)
    assert orphan._parent is None
    assert orphan.get_span_context().trace_id not in (0, root.get_span_context().trace_id)
    token = otel_context.attach(otel_context.set_value(_context._SPAN_KEY, "not a span"))
    try:
        stray = light.start_in_current("stray", {})  # something that is not a span: as if none
    finally:
        otel_context.detach(token)
    assert stray._parent is None
