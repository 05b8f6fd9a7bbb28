"""Behaviour of the instrumentation API (`op`, `generate`, `tool`, `step`, `timer`,
`trajectory`) through the real pipeline, captured with `CaptureExporter`.

Nothing is mocked: every test starts a real `otel_rl.init(...)` (or none at all),
runs instrumented code, flushes the pipeline and inspects the records, raw spans
and metric points that came out of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import json
import logging
import re
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rl
from otel_rl import semconv as sc
from otel_rl import _runtime
from otel_rl.records import SpanNode, Trajectory
from otel_rl.testing import CaptureExporter

TRUNC_RE = re.compile(r"\.\.\.\[truncated \d+ chars\]$")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _no_leftover_handle():
    """Every test starts and ends without a running pipeline."""
    h = otel_rl.current()
    if h is not None:
        h.shutdown()
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown()


@contextlib.contextmanager
def capture(**kwargs: Any):
    cap = CaptureExporter()
    kwargs.setdefault("tracing", True)
    kwargs.setdefault("batch_delay_s", 0.05)
    h = otel_rl.init(exporters=[cap], **kwargs)
    cap.handle = h
    try:
        yield cap
    finally:
        h.shutdown()


@pytest.fixture
def cap():
    with capture() as c:
        yield c


def one_trajectory(cap: CaptureExporter, **filters: Any) -> Trajectory:
    ts = cap.trajectories(**filters)
    assert len(ts) == 1, f"expected one trajectory for {filters}, got {[t.root.name for t in ts]}"
    return ts[0]


def only(nodes: list) -> Any:
    assert len(nodes) == 1, nodes
    return nodes[0]


def inputs_of(node: SpanNode) -> dict:
    assert node.inputs is not None
    return json.loads(node.inputs)


def output_of(node: SpanNode) -> Any:
    assert node.output is not None
    return json.loads(node.output)


def exception_events(node: SpanNode) -> list[dict]:
    return [e for e in node.events if e["name"] == sc.EVENT_EXCEPTION]


def is_my_error(type_name: str) -> bool:
    """The SDK writes `exception.type` module-qualified for non-builtin exceptions."""
    return type_name in ("MyError", f"{MyError.__module__}.MyError")


def span_ids_in_trace(cap: CaptureExporter, trace_id: int) -> list[Any]:
    return [s for s in cap.spans if s.context.trace_id == trace_id]


# ----------------------------------------------------------------------------- ops under test


class MyError(Exception):
    pass


@otel_rl.op
def add(a, b=2):
    return {"sum": a + b}


@otel_rl.op
def signature_zoo(a, b=2, *rest, c=3, **extra):
    return None


def _raise_here(msg):
    raise MyError(msg)


@otel_rl.op
def failing(x):
    _raise_here(f"bad {x}")


@otel_rl.op
def identity(obj):
    return obj


class Agent:
    def __init__(self, name="agent"):
        self.name = name

    @otel_rl.op
    def act(self, obs, temperature=1.0):
        return f"{self.name}:{obs}@{temperature}"

    @otel_rl.op
    @classmethod
    def make(cls, name):
        return cls(name)

    @classmethod
    @otel_rl.op
    def make_inner(cls, name):
        return cls(name)

    @otel_rl.op
    @staticmethod
    def helper(y, z=0):
        return y * 10 + z

    @staticmethod
    @otel_rl.op
    def helper_inner(y):
        return y * 100


@otel_rl.op
async def fetch_double(x, delay=0.0):
    await asyncio.sleep(delay)
    return x * 2


@otel_rl.op
async def fetch_fail(x):
    await asyncio.sleep(0)
    raise MyError(f"async {x}")


@otel_rl.op
def count_up(n, closed=None):
    try:
        for i in range(n):
            yield i
    finally:
        if closed is not None:
            closed.append(time.time_ns())


@otel_rl.op
def accumulator():
    """Yields its running total; send() adds, throw(KeyError) adds 100, send(None) stops."""
    total = 0
    while True:
        try:
            x = yield total
        except KeyError:
            x = 100
        if x is None:
            return total
        total += x


@otel_rl.op
async def acount(n, closed=None):
    try:
        for i in range(n):
            await asyncio.sleep(0)
            yield i
    finally:
        if closed is not None:
            closed.append(time.time_ns())


@otel_rl.op
async def aecho():
    got = None
    while True:
        got = yield got
        if got == "stop":
            return


@otel_rl.op
def outer(x):
    return middle(x) + 1


@otel_rl.op
def middle(x):
    return inner(x) * 2


@otel_rl.op
def inner(x):
    return x + 1


# ----------------------------------------------------------------------------- op: kinds of callables


def test_op_plain_function_span_inputs_output(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        result = add(1)
        result2 = add(3, b=4)
    assert result == {"sum": 3} and result2 == {"sum": 7}
    cap.collect()
    t = one_trajectory(cap, step=0, sample_index=0)
    nodes = t.root.find("add")
    assert [inputs_of(n) for n in nodes] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [output_of(n) for n in nodes] == [{"sum": 3}, {"sum": 7}]
    assert all(n.kind == sc.KIND_CHAIN and n.status == "UNSET" for n in nodes)
    assert add.__name__ == "add" and add.__wrapped__.__name__ == "add"  # functools.wraps


def test_op_span_name_is_qualname(cap):
    def local_fn(v):
        return v

    traced = otel_rl.op(local_fn)
    named = otel_rl.op(name="custom-name")(local_fn)
    with otel_rl.trajectory(step=0, sample_index=0):
        traced(1)
        named(2)
        Agent().act("o")
    cap.collect()
    names = [c.name for c in one_trajectory(cap).root.children]
    assert names == [local_fn.__qualname__, "custom-name", "Agent.act"]
    assert local_fn.__qualname__.endswith("<locals>.local_fn")


def test_op_binds_defaults_varargs_kwargs(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        signature_zoo(1)
        signature_zoo(1, 5, 6, 7, c=4, z=9)
        signature_zoo(a=10)
        signature_zoo(1, c=4)
    cap.collect()
    nodes = one_trajectory(cap).root.find("signature_zoo")
    got = [inputs_of(n) for n in nodes]
    assert got == [
        {"a": 1, "b": 2, "c": 3},
        {"a": 1, "b": 5, "rest": [6, 7], "c": 4, "z": 9},  # extra keywords appear under their own names
        {"a": 10, "b": 2, "c": 3},
        {"a": 1, "b": 2, "c": 4},
    ]
    # declaration order, whatever order the caller used and defaults filled in
    assert [list(d) for d in got] == [["a", "b", "c"], ["a", "b", "rest", "c", "z"], ["a", "b", "c"], ["a", "b", "c"]]


def test_op_method_inputs_exclude_self(cap):
    agent = Agent("bob")
    with otel_rl.trajectory(step=0, sample_index=0):
        out = agent.act("obs1", temperature=0.5)
    assert out == "bob:obs1@0.5"
    cap.collect()
    node = only(one_trajectory(cap).root.find("Agent.act"))
    assert inputs_of(node) == {"obs": "obs1", "temperature": 0.5}
    assert output_of(node) == "bob:obs1@0.5"


def test_op_classmethod_and_staticmethod(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        a1 = Agent.make("x")
        a2 = Agent().make("y")  # via an instance
        a3 = Agent.make_inner("z")
        h1 = Agent.helper(2)
        h2 = Agent().helper(3, z=1)
        h3 = Agent.helper_inner(4)
    assert isinstance(a1, Agent) and (a1.name, a2.name, a3.name) == ("x", "y", "z")
    assert (h1, h2, h3) == (20, 31, 400)
    cap.collect()
    root = one_trajectory(cap).root
    assert [inputs_of(n) for n in root.find("Agent.make")] == [{"name": "x"}, {"name": "y"}]
    assert [inputs_of(n) for n in root.find("Agent.make_inner")] == [{"name": "z"}]
    assert [inputs_of(n) for n in root.find("Agent.helper")] == [{"y": 2, "z": 0}, {"y": 3, "z": 1}]
    assert [inputs_of(n) for n in root.find("Agent.helper_inner")] == [{"y": 4}]
    assert [c.name for c in root.children] == ["Agent.make", "Agent.make", "Agent.make_inner", "Agent.helper",
                                               "Agent.helper", "Agent.helper_inner"]


def test_op_async_function(cap):
    async def main():
        async with otel_rl.trajectory(step=0, sample_index=0):
            return await fetch_double(21)

    assert asyncio.run(main()) == 42
    cap.collect()
    node = only(one_trajectory(cap).root.find("fetch_double"))
    assert inputs_of(node) == {"x": 21, "delay": 0.0}
    assert output_of(node) == 42
    assert node.end_ns >= node.start_ns


def test_op_async_function_exception(cap):
    async def main():
        with otel_rl.trajectory(step=0, sample_index=0):
            await fetch_fail(7)

    with pytest.raises(MyError, match="async 7"):
        asyncio.run(main())
    cap.collect()
    t = one_trajectory(cap)
    node = only(t.root.find("fetch_fail"))
    assert node.status == "ERROR"
    ev = only(exception_events(node))
    assert is_my_error(ev["attributes"][sc.EXCEPTION_TYPE])
    assert ev["attributes"][sc.EXCEPTION_MESSAGE] == "async 7"
    assert t.root.status == "ERROR"  # it escaped the trajectory too


def test_op_generator_items_are_output(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        items = list(count_up(3))
    assert items == [0, 1, 2]
    cap.collect()
    node = only(one_trajectory(cap).root.find("count_up"))
    assert inputs_of(node) == {"n": 3, "closed": None}
    assert output_of(node) == [0, 1, 2]
    assert node.status == "UNSET"


def test_op_generator_send_throw_and_return_value(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        g = accumulator()
        assert next(g) == 0
        assert g.send(5) == 5
        assert g.throw(KeyError("k")) == 105  # handled inside the generator
        with pytest.raises(StopIteration) as stop:
            g.send(None)
    assert stop.value.value == 105
    cap.collect()
    node = only(one_trajectory(cap).root.find("accumulator"))
    assert output_of(node) == {"yielded": [0, 5, 105], "return": 105}
    assert node.status == "UNSET" and not exception_events(node)


def test_op_generator_throw_unhandled_is_reraised_and_recorded(cap):
    err = ValueError("thrown in")
    with otel_rl.trajectory(step=0, sample_index=0):
        g = accumulator()
        next(g)
        with pytest.raises(ValueError) as ei:
            g.throw(err)
    assert ei.value is err
    cap.collect()
    node = only(one_trajectory(cap).root.find("accumulator"))
    assert node.status == "ERROR"
    assert only(exception_events(node))["attributes"][sc.EXCEPTION_MESSAGE] == "thrown in"


def test_op_generator_break_ends_span(cap):
    closed: list = []
    with otel_rl.trajectory(step=0, sample_index=0):
        seen = []
        for x in count_up(10, closed):
            seen.append(x)
            if x == 2:
                break
        # CPython finalises the abandoned generator right away: the wrapped one is closed too
        assert len(closed) == 1
    assert seen == [0, 1, 2]
    cap.collect()
    node = only(one_trajectory(cap).root.find("count_up"))
    assert output_of(node) == [0, 1, 2]
    assert node.end_ns > 0 and node.status == "UNSET"
    # the wrapped generator's cleanup ran inside the span, which ended before the trajectory root did
    assert node.start_ns <= closed[0] <= node.end_ns <= one_trajectory(cap).root.end_ns


def test_op_generator_explicit_close_ends_span(cap):
    closed: list = []
    with otel_rl.trajectory(step=0, sample_index=0):
        g = count_up(10, closed)
        assert next(g) == 0
        g.close()
        assert len(closed) == 1
    cap.collect()
    node = only(one_trajectory(cap).root.find("count_up"))
    assert output_of(node) == [0]
    assert node.start_ns <= closed[0] <= node.end_ns


def test_op_async_generator(cap):
    closed: list = []

    async def main():
        async with otel_rl.trajectory(step=0, sample_index=0):
            full = [x async for x in acount(3)]
            agen = acount(10, closed)
            part = []
            async for x in agen:
                part.append(x)
                if x == 1:
                    break
            await agen.aclose()
            echo = aecho()
            first = await echo.asend(None)
            second = await echo.asend("hello")
            with pytest.raises(StopAsyncIteration):
                await echo.asend("stop")
            return full, part, first, second

    full, part, first, second = asyncio.run(main())
    assert full == [0, 1, 2] and part == [0, 1] and (first, second) == (None, "hello")
    assert len(closed) == 1
    cap.collect()
    root = one_trajectory(cap).root
    nodes = root.find("acount")
    assert nodes[1].start_ns <= closed[0] <= nodes[1].end_ns  # aclose() reached the wrapped generator
    assert [inputs_of(n)["n"] for n in nodes] == [3, 10]
    assert [output_of(n) for n in nodes] == [[0, 1, 2], [0, 1]]
    assert output_of(only(root.find("aecho"))) == [None, "hello"]


def test_op_return_value_identical_and_unchanged(cap):
    payload = {"prompt_ids": [1, 2], "response_ids": [3], "nested": {"k": [1, 2, 3]}}
    snapshot = copy.deepcopy(payload)
    arr = np.arange(4)
    with otel_rl.trajectory(step=0, sample_index=0):
        out = identity(payload)
        out_arr = identity(arr)
    cap.collect()
    assert out is payload and payload == snapshot
    assert out_arr is arr
    assert output_of(one_trajectory(cap).root.find("identity")[0]) == snapshot


def test_op_exception_reraised_unchanged_and_recorded(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        with pytest.raises(MyError) as ei:
            failing(3)
    exc = ei.value
    assert type(exc) is MyError and str(exc) == "bad 3"
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    assert frames[-2:] == ["failing", "_raise_here"]  # the original frames are all there
    assert exc.__cause__ is None and exc.__context__ is None
    cap.collect()
    node = only(one_trajectory(cap).root.find("failing"))
    assert node.status == "ERROR" and node.status_message == "MyError: bad 3"
    ev = only(exception_events(node))
    assert is_my_error(ev["attributes"][sc.EXCEPTION_TYPE])
    assert ev["attributes"][sc.EXCEPTION_MESSAGE] == "bad 3"
    assert "_raise_here" in ev["attributes"][sc.EXCEPTION_STACKTRACE]
    assert node.attributes[sc.ERROR_TYPE] == "MyError"
    assert node.output is None


def test_op_exception_same_object(cap):
    err = MyError("the very same")

    @otel_rl.op
    def raiser():
        raise err

    @otel_rl.op
    def gen_raiser():
        yield 1
        raise err

    with otel_rl.trajectory(step=0, sample_index=0):
        with pytest.raises(MyError) as e1:
            raiser()
        with pytest.raises(MyError) as e2:
            list(gen_raiser())
    assert e1.value is err and e2.value is err
    cap.collect()
    root = one_trajectory(cap).root
    assert [c.status for c in root.children] == ["ERROR", "ERROR"]


# ----------------------------------------------------------------------------- nesting, trajectories, steps


def test_nested_ops_form_a_tree_in_the_trajectory_trace():
    with capture(experiment="exp-nest") as cap:
        with otel_rl.step(4):
            with otel_rl.trajectory(sample_index=2, rollout_n=3) as t:
                assert t.sampled
                assert outer(1) == 5
            with otel_rl.trajectory(sample_index=3, rollout_n=3):
                inner(0)
        cap.collect()
        t2 = one_trajectory(cap, step=4, sample_index=2)
        root = t2.root
        assert root.name == sc.SPAN_TRAJECTORY and root.kind == sc.KIND_AGENT
        assert root.attributes[sc.RL_STEP] == 4  # taken from the enclosing step
        assert root.attributes[sc.RL_SAMPLE_INDEX] == 2
        assert root.attributes[sc.RL_ROLLOUT_N] == 3
        assert root.attributes[sc.RL_VALIDATE] is False
        assert root.attributes[sc.RL_EXPERIMENT_NAME] == "exp-nest"
        assert (t2.step, t2.sample_index, t2.rollout_n, t2.validate) == (4, 2, 3, False)
        # outer -> middle -> inner
        o = only(root.children)
        assert o.name == "outer" and o.parent_id == root.span_id
        m = only(o.children)
        assert m.name == "middle" and m.parent_id == o.span_id
        i = only(m.children)
        assert i.name == "inner" and i.parent_id == m.span_id and not i.children
        assert root.start_ns <= o.start_ns <= m.start_ns <= i.start_ns <= i.end_ns <= m.end_ns <= o.end_ns <= root.end_ns
        # all in one trace
        spans = span_ids_in_trace(cap, t2.trace_id)
        assert sorted(s.name for s in spans) == ["inner", "middle", "outer", "rl.trajectory"]

        # link to the step span; each trajectory is its own trace, none is the step's
        step_span = only(cap.spans_named(sc.SPAN_STEP))
        traj_spans = cap.spans_named(sc.SPAN_TRAJECTORY)
        assert len(traj_spans) == 2
        for ts in traj_spans:
            assert ts.parent is None
            assert len(ts.links) == 1
            assert ts.links[0].context.span_id == step_span.context.span_id
            assert ts.links[0].context.trace_id == step_span.context.trace_id
        trace_ids = {ts.context.trace_id for ts in traj_spans}
        assert len(trace_ids) == 2 and step_span.context.trace_id not in trace_ids
        t3 = one_trajectory(cap, step=4, sample_index=3)
        assert t3.trace_id != t2.trace_id



def test_span_contexts_are_what_the_api_constructor_makes_and_propagate():
    """The light spans build their SpanContext without the constructor's checks: every field must be what
    `SpanContext(...)` gives for the same ids, and W3C propagation must carry it into a child process's
    context (a traceparent header and back)."""
    from opentelemetry.propagate import extract, inject
    from opentelemetry.trace import SpanContext, TraceFlags

    with capture() as cap:
        with otel_rl.step(1) as st:
            headers: dict = {}
            inject(headers)
            step_ctx = st.span_context
            with otel_rl.trajectory(sample_index=0) as t:
                outer(1)
                op_ctx = trace_api.get_current_span().get_span_context()
        cap.collect()
        light = [step_ctx, op_ctx, t.span.get_span_context()]
        assert all(c.trace_flags == TraceFlags(TraceFlags.SAMPLED) for c in light)
        seen = [s.context for s in cap.spans] + light
        assert len(seen) >= 6
        for c in seen:
            ref = SpanContext(c.trace_id, c.span_id, False, c.trace_flags, c.trace_state)
            assert type(c) is SpanContext and c == ref
            assert (c.trace_id, c.span_id, c.is_remote, c.trace_flags, c.trace_state, c.is_valid) == (
                ref.trace_id, ref.span_id, ref.is_remote, ref.trace_flags, ref.trace_state, ref.is_valid)
            assert c.is_valid and c.trace_flags.sampled and 0 < c.span_id < 2 ** 64 and 0 < c.trace_id < 2 ** 128
        assert headers["traceparent"] == f"00-{step_ctx.trace_id:032x}-{step_ctx.span_id:016x}-01"
        back = trace_api.get_current_span(extract(headers)).get_span_context()
        assert (back.trace_id, back.span_id, back.is_remote) == (step_ctx.trace_id, step_ctx.span_id, True)

def test_trajectories_of_consecutive_steps_link_each_to_their_own_step(cap):
    for n in (1, 2, 2, 3):  # the same step twice: a new step span each time
        with otel_rl.step(n):
            for i in range(2):
                with otel_rl.trajectory(sample_index=i):
                    inner(0)
    with otel_rl.trajectory(step=7, sample_index=0):  # outside any step: no link
        inner(0)
    cap.collect()
    steps = cap.spans_named(sc.SPAN_STEP)
    trajs = cap.spans_named(sc.SPAN_TRAJECTORY)
    assert len(steps) == 4 and len(trajs) == 9
    by_step_span = {}
    for ts in trajs:
        if ts.attributes[sc.RL_STEP] == 7:
            assert ts.links == ()
            continue
        assert len(ts.links) == 1
        by_step_span.setdefault(ts.links[0].context.span_id, []).append(ts.attributes[sc.RL_STEP])
    assert sorted(by_step_span) == sorted(s.context.span_id for s in steps)
    for s in steps:
        assert by_step_span[s.context.span_id] == [s.attributes[sc.RL_STEP]] * 2


def test_trace_ids_begin_with_the_time_and_end_random():
    """Every trace otel-rl starts (trajectories, steps, an unsampled trajectory kept for its error, the
    run's own spans) has the milliseconds of its start in the first 48 bits of its id and 80 random
    bits after them: ids sort by time; no two are alike."""
    t0 = time.time_ns() // 1_000_000
    with capture(max_samples_per_step_per_worker=1) as cap:  # (its run span too)
        for n in range(3):
            with otel_rl.step(n):
                for i in range(3):
                    try:
                        with otel_rl.trajectory(sample_index=i):  # one sample traced, the others not
                            inner(i)
                            if i == 2:
                                raise RuntimeError("kept for its error")
                    except RuntimeError:
                        pass
                time.sleep(0.003)
        otel_rl.log({"x": 1.0}, step=0)
        cap.collect()
        t1 = time.time_ns() // 1_000_000
    roots = [s for s in cap.spans if s.parent is None]
    assert {sc.SPAN_STEP, sc.SPAN_TRAJECTORY, sc.SPAN_LOG} <= {s.name for s in roots}
    assert any(s.attributes.get(sc.RL_SAMPLED) is False for s in roots)  # a kept error's root (an SDK span)
    ids = [s.context.trace_id for s in roots]
    assert len(set(ids)) == len(ids)
    for s in roots:
        ms = s.context.trace_id >> 80
        assert t0 <= ms <= t1, (s.name, ms, t0, t1)
        if s.name in (sc.SPAN_STEP, sc.SPAN_TRAJECTORY) and s.attributes.get(sc.RL_SAMPLED) is not False:
            assert ms == s.start_time // 1_000_000, s.name  # light spans: the id from their start time
        elif s.name != sc.SPAN_LOG:  # SDK spans: the id when the span is made (a kept error's: at its end)
            assert abs(s.start_time // 1_000_000 - ms) <= 50, s.name
    low = [i & ((1 << 80) - 1) for i in ids]
    assert len(set(low)) == len(low) and len({x >> 72 for x in low}) > 1  # the random part varies
    steps = sorted((s.attributes[sc.RL_STEP], s.context.trace_id) for s in roots if s.name == sc.SPAN_STEP)
    assert [t for _, t in steps] == sorted(t for _, t in steps)  # later steps, larger ids


def test_trajectory_explicit_attributes_validate_and_name(cap):
    with otel_rl.trajectory(step=9, sample_index=1, rollout_n=0, validate=True, name="my-rollout") as t:
        t.set_reward(0.75)
        inner(1)
    cap.collect()
    tr = one_trajectory(cap, step=9, validate=True)
    assert tr.root.name == "my-rollout" and tr.name == "my-rollout"
    assert tr.root.attributes[sc.RL_VALIDATE] is True
    assert tr.root.attributes[sc.RL_REWARD] == 0.75
    assert tr.rollout_n == 0
    # outside any step there is nothing to link to
    assert only(cap.spans_named("my-rollout")).links == ()


def test_step_and_timers(cap):
    raw: dict = {}
    with otel_rl.step(5) as st:
        assert otel_rl.current_step() == 5 and st.n == 5
        with otel_rl.timer("gen") as t1:
            time.sleep(0.01)
        with otel_rl.timer("gen", timing_raw=raw) as t2:
            time.sleep(0.01)
            inner(1)  # an op inside a timer is its child
        with otel_rl.timer("update", timing_raw=raw) as t3:
            pass
    assert otel_rl.current_step() is None
    cap.collect()
    m = cap.metrics_by_step()[5]
    assert m["timing_s/gen"] == pytest.approx(t1.last + t2.last)
    assert m["timing_s/gen"] >= 0.02
    assert m["timing_s/update"] == pytest.approx(t3.last)
    assert raw == {"gen": t2.last, "update": t3.last}

    step_span = only(cap.spans_named(sc.SPAN_STEP))
    assert step_span.attributes[sc.RL_STEP] == 5 and step_span.parent is None
    timers = cap.spans_named("gen") + cap.spans_named("update")
    assert len(timers) == 3
    for ts in timers:
        assert ts.parent is not None and ts.parent.span_id == step_span.context.span_id
        assert ts.context.trace_id == step_span.context.trace_id
        assert ts.attributes[sc.RL_SPAN_KIND] == sc.KIND_TIMER
    inner_span = only(cap.spans_named("inner"))
    assert inner_span.parent.span_id == cap.spans_named("gen")[1].context.span_id
    # a step's waterfall is not a trajectory
    assert cap.trajectories() == []


def test_timer_accumulates_timing_raw_outside_step(cap):
    raw = {"gen": 1.0}
    with otel_rl.timer("gen", timing_raw=raw) as t:
        pass
    assert raw["gen"] == pytest.approx(1.0 + t.last)
    cap.collect()
    assert cap.metrics_by_step() == {}


def test_step_timer_error_recorded_and_reraised(cap):
    with pytest.raises(MyError):
        with otel_rl.step(1):
            with otel_rl.timer("update"):
                raise MyError("in timer")
    cap.collect()
    for name in ("update", sc.SPAN_STEP):
        s = only(cap.spans_named(name))
        assert s.status.status_code.name == "ERROR"
        assert s.events[0].attributes[sc.EXCEPTION_MESSAGE] == "in timer"
    assert "timing_s/update" in cap.metrics_by_step()[1]


def test_trajectory_trace_false_turns_off_nested_ops(cap):
    with otel_rl.trajectory(step=0, sample_index=0, trace=False) as t:
        assert not t.sampled
        assert outer(1) == 5
        with otel_rl.trajectory(step=0, sample_index=1, trace=True) as nested:
            assert not nested.sampled
            assert inner(1) == 2
    cap.collect()
    names = {s.name for s in cap.spans}
    assert not names & {"outer", "middle", "inner", sc.SPAN_TRAJECTORY}
    assert cap.trajectories() == []
    # traced again afterwards
    with otel_rl.trajectory(step=0, sample_index=2):
        inner(5)
    cap.collect()
    assert inputs_of(only(one_trajectory(cap, sample_index=2).root.find("inner"))) == {"x": 5}


def test_trajectory_trace_false_restored_after_exception(cap):
    with pytest.raises(MyError):
        with otel_rl.trajectory(step=0, sample_index=0, trace=False):
            inner(1)
            failing(1)
    assert otel_rl.current_trajectory() is None
    inner(2)  # outside any trajectory: its own trace again
    with otel_rl.trajectory(step=0, sample_index=1):
        inner(3)
    cap.collect()
    assert [json.loads(s.attributes[sc.RL_OP_INPUTS]) for s in cap.spans_named("inner")] == [{"x": 2}, {"x": 3}]
    assert cap.spans_named("failing") == []
    assert [t.sample_index for t in cap.trajectories()] == [1]


# ----------------------------------------------------------------------------- isolation


@otel_rl.op
async def a_step(tag, i, log):
    log.append((tag, i))
    await asyncio.sleep(0.002)
    return f"{tag}-{i}"


@otel_rl.op
async def a_agent(tag, log):
    return [await a_step(tag, i, log) for i in range(3)]


def _tags_in_tree(root: SpanNode) -> set:
    return {inputs_of(n)["tag"] for n in root.walk() if n is not root}


def test_isolation_asyncio_tasks(cap):
    log: list = []

    async def rollout(idx):
        async with otel_rl.trajectory(step=0, sample_index=idx) as t:
            assert otel_rl.current_trajectory() is t
            out = await a_agent(f"s{idx}", log)
            assert otel_rl.current_trajectory() is t
            return out

    async def main():
        return await asyncio.gather(rollout(0), rollout(1))

    res = asyncio.run(main())
    assert res == [["s0-0", "s0-1", "s0-2"], ["s1-0", "s1-1", "s1-2"]]
    # the two tasks really interleaved
    assert [tag for tag, _ in log[:2]] == ["s0", "s1"]
    cap.collect()
    t0 = one_trajectory(cap, sample_index=0)
    t1 = one_trajectory(cap, sample_index=1)
    assert t0.trace_id != t1.trace_id
    for t, tag in ((t0, "s0"), (t1, "s1")):
        agent = only(t.root.children)
        assert agent.name == "a_agent" and inputs_of(agent)["tag"] == tag
        assert [(c.name, inputs_of(c)["i"]) for c in agent.children] == [("a_step", 0), ("a_step", 1), ("a_step", 2)]
        assert _tags_in_tree(t.root) == {tag}
        assert all(s.context.trace_id == t.trace_id for s in cap.spans
                   if s.name.startswith("a_") and json.loads(s.attributes[sc.RL_OP_INPUTS])["tag"] == tag)


@otel_rl.op
def t_step(tag, i):
    time.sleep(0.002)
    return f"{tag}-{i}"


@otel_rl.op
def t_agent(tag, barrier):
    out = [t_step(tag, 0)]
    barrier.wait(timeout=10)  # all trajectories are open at the same time here
    out += [t_step(tag, i) for i in (1, 2)]
    return out


def test_isolation_threads(cap):
    n = 4
    barrier = threading.Barrier(n)

    def work(idx):
        with otel_rl.trajectory(step=0, sample_index=idx) as t:
            out = t_agent(f"w{idx}", barrier)
            assert otel_rl.current_trajectory() is t
            return out

    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(work, range(n)))
    assert results == [[f"w{i}-0", f"w{i}-1", f"w{i}-2"] for i in range(n)]
    cap.collect()
    ts = cap.trajectories(step=0)
    assert sorted(t.sample_index for t in ts) == list(range(n))
    assert len({t.trace_id for t in ts}) == n
    for t in ts:
        tag = f"w{t.sample_index}"
        agent = only(t.root.children)
        assert inputs_of(agent)["tag"] == tag
        assert len(agent.children) == 3
        assert _tags_in_tree(t.root) == {tag}


def test_thread_started_inside_trajectory_does_not_inherit_it(cap):
    """Python threads start with an empty context (3.11; no thread_inherit_context):
    a plain thread sees no trajectory and its ops start their own trace; running
    the thread in a copy of the context puts its ops inside the trajectory."""
    seen: dict = {}

    def body(key):
        seen[key] = (otel_rl.current_trajectory(), trace_api.get_current_span().get_span_context().is_valid)
        identity(key)

    with otel_rl.trajectory(step=0, sample_index=0) as t:
        th = threading.Thread(target=body, args=("plain",))
        th.start()
        th.join()
        ctx = contextvars.copy_context()
        th2 = threading.Thread(target=ctx.run, args=(body, "copied"))
        th2.start()
        th2.join()
    assert seen["plain"] == (None, False)
    assert seen["copied"] == (t, True)
    cap.collect()
    traj = one_trajectory(cap)
    assert [inputs_of(n)["obj"] for n in traj.root.find("identity")] == ["copied"]
    plain = [s for s in cap.spans_named("identity") if json.loads(s.attributes[sc.RL_OP_INPUTS])["obj"] == "plain"]
    s = only(plain)
    assert s.parent is None and s.context.trace_id != traj.trace_id


# ----------------------------------------------------------------------------- tracing off


def _exercise_all_kinds() -> list:
    out = [add(1), Agent("a").act("o"), Agent.helper(1), list(count_up(2))]

    async def amain():
        return [await fetch_double(2), [x async for x in acount(2)]]

    out += asyncio.run(amain())
    with pytest.raises(MyError):
        failing(1)
    return out


EXPECTED_ALL_KINDS = [{"sum": 3}, "a:o@1.0", 10, [0, 1], 4, [0, 1]]


def test_tracing_off_without_span_consumer():
    h = otel_rl.init(exporters=["console"], batch_delay_s=0.05)
    try:
        assert h.tracing is False and _runtime.active.tracing is False
        with otel_rl.step(1):
            with otel_rl.timer("gen"):
                with otel_rl.trajectory(sample_index=0) as t:
                    assert not t.sampled
                    assert _exercise_all_kinds() == EXPECTED_ALL_KINDS
        h.flush()
        assert h._pipeline.queues[0].stats.as_dict()["exported"] >= 1  # the step's log line only
    finally:
        h.shutdown()


class _Seen(SpanProcessor):
    """A user's span processor: what it saw start (on which thread) and end."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []
        self.ended: list = []

    def on_start(self, span, parent_context=None) -> None:
        self.started.append((span.name if hasattr(span, "name") else span._name, threading.current_thread().name))

    def on_end(self, span) -> None:
        self.ended.append(span)


def test_a_span_processor_of_the_users_sees_every_span_start_and_end():
    """Added to otel-rl's provider, a processor turns tracing on and sees every span otel-rl makes: the step,
    its timer, the trajectory and its ops start on the training thread (the rl.log span on the pipeline's,
    where it is made); each ends as the SDK's `ReadableSpan`, the rl.log span with its exact values too,
    delivered from the pipeline's thread."""
    h = otel_rl.init(exporters=["console"], batch_delay_s=0.05)
    try:
        seen = _Seen()
        h.tracer_provider.add_span_processor(seen)
        assert h.tracing is True and _runtime.active.tracing is True
        with otel_rl.step(1):
            with otel_rl.timer("gen"):
                with otel_rl.trajectory(sample_index=0) as t:
                    assert t.sampled
                    assert _exercise_all_kinds() == EXPECTED_ALL_KINDS
            otel_rl.log({"loss": 0.25, "n": 3}, step=1)
        h.flush()
        ended = {s.name for s in seen.ended}
        started = {name for name, _ in seen.started}
        assert {sc.SPAN_STEP, "gen", sc.SPAN_TRAJECTORY, sc.SPAN_LOG} <= ended
        assert {sc.SPAN_STEP, "gen", sc.SPAN_TRAJECTORY, sc.SPAN_LOG} <= started
        ops = [s for s in seen.ended if sc.RL_OP_INPUTS in s.attributes]
        assert ops and all(isinstance(s, ReadableSpan) for s in seen.ended)
        assert all(isinstance(s.attributes[sc.RL_OP_INPUTS], str) for s in ops)  # materialised as JSON text
        main = threading.current_thread().name
        assert {thread for name, thread in seen.started if name != sc.SPAN_LOG} == {main}
        assert {thread for name, thread in seen.started if name == sc.SPAN_LOG} == {"otel-rl-pipeline"}
        log = next(s for s in seen.ended if s.name == sc.SPAN_LOG and "loss" in s.attributes[sc.RL_METRICS_KEYS])
        keys = list(log.attributes[sc.RL_METRICS_KEYS])
        assert log.attributes[sc.RL_METRICS_VALUES][keys.index("loss")] == 0.25
        assert dict(zip(log.attributes[sc.RL_METRICS_INT_KEYS], log.attributes[sc.RL_METRICS_INT_VALUES])) == {"n": 3}
    finally:
        h.shutdown()


class RecordsOnly(CaptureExporter):
    """A capture that consumes records but neither spans nor trajectories."""

    wants_spans = False
    wants_trajectories = False


def test_tracing_off_records_still_flow():
    rec = RecordsOnly()
    h = otel_rl.init(exporters=["console", rec], batch_delay_s=0.05)
    try:
        assert h.tracing is False
        with otel_rl.step(2):
            with otel_rl.timer("gen"):
                with otel_rl.trajectory(sample_index=0):
                    assert _exercise_all_kinds() == EXPECTED_ALL_KINDS
        rec.collect()
        assert set(rec.metrics_by_step()[2]) == {"timing_s/gen"}
        assert rec.trajectories() == [] and rec.spans == []
        # untraced trajectories still count in the duration metric
        assert sum(p.count for p in rec.metric_points(sc.METRIC_TRAJECTORY_DURATION)) == 1
    finally:
        h.shutdown()


def test_no_init_at_all():
    assert otel_rl.current() is None and _runtime.active.tracing is False
    with otel_rl.step(1):
        with otel_rl.timer("gen") as tm:
            with otel_rl.trajectory(sample_index=0) as t:
                assert not t.sampled
                assert _exercise_all_kinds() == EXPECTED_ALL_KINDS
    assert tm.last >= 0
    assert otel_rl.current() is None


# ----------------------------------------------------------------------------- GenAI spans


class GenOut:
    def __init__(self, p, r):
        self.prompt_ids = p
        self.response_ids = r


@otel_rl.generate(model="m")
def llm_dict(prompt):
    return {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "text": "ok"}


@otel_rl.generate(model="m")
def llm_obj(prompt):
    return GenOut([1] * 7, [2] * 11)


@otel_rl.generate(model="m")
def llm_usage(prompt):
    return {"text": "ok", "usage": {"input_tokens": 13, "output_tokens": 17}}


@otel_rl.generate(model="m")
def llm_usage_openai(prompt):
    return {"text": "ok", "usage": {"prompt_tokens": 19, "completion_tokens": 23}}


@otel_rl.generate(model="m")
async def llm_async(prompt):
    await asyncio.sleep(0)
    return {"prompt_ids": [1], "response_ids": [2, 3]}


@otel_rl.generate
def llm_plain(prompt):
    return "no usage"


def test_generate_span(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        r = llm_dict("p")
        o = llm_obj("p")
        llm_usage("p")
        llm_usage_openai("p")
        asyncio.run(llm_async("p"))
        llm_plain("p")
    assert r["text"] == "ok" and isinstance(o, GenOut)
    cap.collect()
    root = one_trajectory(cap).root
    llm_nodes = root.find("chat m")
    assert len(llm_nodes) == 5
    tokens = []
    for n in llm_nodes:
        assert n.kind == sc.KIND_LLM
        assert n.attributes[sc.GEN_AI_OPERATION_NAME] == sc.GEN_AI_OP_CHAT
        assert n.attributes[sc.GEN_AI_REQUEST_MODEL] == "m"
        tokens.append((n.attributes.get(sc.GEN_AI_USAGE_INPUT_TOKENS), n.attributes.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS)))
    assert tokens == [(3, 2), (7, 11), (13, 17), (19, 23), (1, 2)]
    assert inputs_of(llm_nodes[0]) == {"prompt": "p"}
    plain = only(root.find("llm_plain"))
    assert plain.kind == sc.KIND_LLM and sc.GEN_AI_REQUEST_MODEL not in plain.attributes
    assert sc.GEN_AI_USAGE_INPUT_TOKENS not in plain.attributes
    # the LLM spans feed the GenAI token histogram
    pts = cap.metric_points(sc.METRIC_GEN_AI_TOKEN_USAGE)
    by_type = {p.attributes[sc.GEN_AI_TOKEN_TYPE]: p.sum for p in pts}
    assert by_type == {"input": 3 + 7 + 13 + 19 + 1, "output": 2 + 11 + 17 + 23 + 2}


@otel_rl.tool(name="calc")
def calc(expr, tool_call_id=None):
    a, b = expr.split("+")
    return int(a) + int(b)


@otel_rl.op(kind="TOOL")
def search(query, call_id):
    return [query]


@otel_rl.op(kind="llm")
def routed_llm(prompt):
    return {"prompt_ids": [1], "response_ids": [1, 2]}


def test_tool_span(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        assert calc("1+2", tool_call_id="call_1") == 3
        assert calc("2+2", "call_2") == 4  # positional works too
        assert calc("3+2") == 5
        assert search("q", "c-9") == ["q"]
        routed_llm("p")
    cap.collect()
    root = one_trajectory(cap).root
    calcs = root.find("execute_tool calc")
    assert len(calcs) == 3
    for n in calcs:
        assert n.kind == sc.KIND_TOOL
        assert n.attributes[sc.GEN_AI_TOOL_NAME] == "calc"
        assert n.attributes[sc.GEN_AI_OPERATION_NAME] == sc.GEN_AI_OP_EXECUTE_TOOL
    assert [n.attributes.get(sc.GEN_AI_TOOL_CALL_ID) for n in calcs] == ["call_1", "call_2", None]
    assert [output_of(n) for n in calcs] == [3, 4, 5]
    s = only(root.find("execute_tool search"))
    assert s.kind == sc.KIND_TOOL and s.attributes[sc.GEN_AI_TOOL_NAME] == "search"
    assert s.attributes[sc.GEN_AI_TOOL_CALL_ID] == "c-9"
    r = only(root.find("routed_llm"))
    assert r.kind == sc.KIND_LLM and r.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == 2


def test_op_unknown_kind_rejected():
    with pytest.raises(ValueError, match="unknown op kind"):
        otel_rl.op(kind="NOPE")


# ----------------------------------------------------------------------------- inputs / outputs


@dataclasses.dataclass
class Sampling:
    temperature: float
    stop: list


class Prompt(pydantic.BaseModel):
    text: str
    n: int = 1


@otel_rl.op
def consume(cfg, prompt, arr, scalar, ten):
    return {"ten2": ten * 2, "arr": arr + 1}


def test_inputs_outputs_serialise_rich_values(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        consume(Sampling(0.7, ["</s>"]), Prompt(text="hi"), np.arange(6).reshape(2, 3), np.float32(1.5),
                torch.tensor([1.5, 2.5]))
    cap.collect()
    node = only(one_trajectory(cap).root.find("consume"))
    assert inputs_of(node) == {
        "cfg": {"temperature": 0.7, "stop": ["</s>"]},
        "prompt": {"text": "hi", "n": 1},
        "arr": [[0, 1, 2], [3, 4, 5]],
        "scalar": 1.5,
        "ten": [1.5, 2.5],
    }
    assert output_of(node) == {"ten2": [3.0, 5.0], "arr": [[1, 2, 3], [4, 5, 6]]}
    assert sc.RL_TRUNCATED not in node.attributes


def test_large_values_truncated():
    with capture(max_value_chars=1000) as cap:
        big = "x" * 1_000_000
        with otel_rl.trajectory(step=0, sample_index=0):
            assert identity(big) is big
            add(1)
        cap.collect()
        root = one_trajectory(cap).root
        node = only(root.find("identity"))
        for text in (node.inputs, node.output):
            assert TRUNC_RE.search(text), text[-60:]
            assert len(text) < 1000 + 40
            assert text.startswith(('{"obj": "xxx', '"xxx'))
        assert node.attributes[sc.RL_TRUNCATED] is True
        assert sc.RL_TRUNCATED not in only(root.find("add")).attributes


# ----------------------------------------------------------------------------- token2text


class LetterTokenizer:
    """ids -> letters (0 -> 'a'); negative ids are special tokens. Counts its calls."""

    def __init__(self):
        self.calls: list[tuple[int, str, int, bool]] = []
        self._lock = threading.Lock()

    def batch_decode(self, seqs, skip_special_tokens=False):
        with self._lock:
            self.calls.append((threading.get_ident(), threading.current_thread().name, len(seqs),
                               skip_special_tokens))
        return ["".join(chr(ord("a") + i) for i in s if not (skip_special_tokens and i < 0)) for s in seqs]


class Rollout:
    def __init__(self, tokenizer=None):
        if tokenizer is not None:
            self.tokenizer = tokenizer

    @otel_rl.op
    def run(self, p, r):
        return {"prompt_ids": p, "response_ids": r}


def test_token2text_with_init_tokenizer():
    tok = LetterTokenizer()
    with capture(token2text=True, tokenizer=tok) as cap:
        ro = Rollout()
        with otel_rl.trajectory(step=0, sample_index=0):
            out = ro.run([7, 4, 11, -1], [11, 14])
        assert out == {"prompt_ids": [7, 4, 11, -1], "response_ids": [11, 14]}  # caller's value untouched
        cap.collect()
        node = only(one_trajectory(cap).root.find("Rollout.run"))
        assert output_of(node) == {"prompt_ids": [7, 4, 11, -1], "response_ids": [11, 14],
                                   "prompt_text": "hel", "response_text": "lo"}
        main = threading.get_ident()
        assert tok.calls and all(ident != main for ident, *_ in tok.calls)
        assert all(skip for *_, skip in tok.calls)


def test_token2text_tokenizer_from_self():
    tok = LetterTokenizer()
    with capture(token2text=True) as cap:
        with otel_rl.trajectory(step=0, sample_index=0):
            Rollout(tok).run([0, 1], [2])
            Rollout().run([0], [1])  # no tokenizer anywhere: left as ids
        cap.collect()
        nodes = one_trajectory(cap).root.find("Rollout.run")
        assert output_of(nodes[0]) == {"prompt_ids": [0, 1], "response_ids": [2], "prompt_text": "ab",
                                       "response_text": "c"}
        assert output_of(nodes[1]) == {"prompt_ids": [0], "response_ids": [1]}
        assert len(tok.calls) == 1 and tok.calls[0][0] != threading.get_ident()


def test_token2text_output_is_the_json_of_the_merged_object():
    """The op's output text with the decoded texts is exactly the JSON otel-rl writes for the merged dict,
    whether the texts are appended to the JSON text or the object is parsed and encoded again."""
    from otel_rl.serialize import to_json

    class Odd(Rollout):
        @otel_rl.op
        def note(self, p, r, extra):
            return {"prompt_ids": p, "response_ids": r, **extra}

    tok = LetterTokenizer()
    cases = [{}, {"note": 'é}"{ ✓', "score": [1.5, -0.0, 1e300]}, {"prompt_text": "stale", "z": None}]
    with capture(token2text=True, tokenizer=tok, max_value_chars=200) as cap:
        ro = Odd()
        with otel_rl.trajectory(step=0, sample_index=0):
            for extra in cases:
                ro.note([0, 1], [2], extra)
            ro.note([3], [4], {"long": "x" * 140})  # the merged text exceeds max_value_chars
        cap.collect()
        nodes = [n for n in one_trajectory(cap).root.walk() if n.name.endswith("Odd.note")]
        assert len(nodes) == 4
        for node, extra in zip(nodes, cases):
            merged = {"prompt_ids": [0, 1], "response_ids": [2], **extra}
            merged.update(prompt_text="ab", response_text="c")
            assert node.output == to_json(merged, 200)[0]
            assert sc.RL_TRUNCATED not in node.attributes
        last = {"prompt_ids": [3], "response_ids": [4], "long": "x" * 140, "prompt_text": "d", "response_text": "e"}
        assert nodes[3].output == to_json(last, 200)[0] and nodes[3].attributes[sc.RL_TRUNCATED] is True


def test_token2text_off_by_default(cap):
    tok = LetterTokenizer()
    with otel_rl.trajectory(step=0, sample_index=0):
        Rollout(tok).run([0, 1], [2])
    cap.collect()
    assert "prompt_text" not in output_of(only(one_trajectory(cap).root.find("Rollout.run")))
    assert tok.calls == []


def test_token2text_is_batched_off_thread():
    tok = LetterTokenizer()
    n_ops = 40
    # a long batch delay: the worker only drains when collect() asks it to
    with capture(token2text=True, tokenizer=tok, batch_delay_s=5.0) as cap:
        ro = Rollout()
        with otel_rl.trajectory(step=0, sample_index=0):
            for i in range(n_ops):
                ro.run([i % 26], [(i + 1) % 26, (i + 2) % 26])
        assert tok.calls == []  # nothing decoded on the caller's thread while it ran
        cap.collect()
        nodes = one_trajectory(cap).root.find("Rollout.run")
        assert len(nodes) == n_ops
        for i, n in enumerate(nodes):
            o = output_of(n)
            assert o["prompt_text"] == chr(97 + i % 26)
            assert o["response_text"] == chr(97 + (i + 1) % 26) + chr(97 + (i + 2) % 26)
        assert 1 <= len(tok.calls) < n_ops
        assert len(tok.calls) <= 2
        assert sum(c[2] for c in tok.calls) == 2 * n_ops  # prompt + response of every op
        main = threading.get_ident()
        assert all(ident != main and name == "otel-rl-pipeline" for ident, name, _, _ in tok.calls)


def _jobs_left() -> list:
    """The token2text jobs the op wrapper left in the spans queued for the pipeline (not taken yet)."""
    return [s._decode for s in otel_rl.current()._pipeline._items if getattr(s, "_decode", None) is not None]


def test_token2text_reads_the_ids_from_the_output_copy():
    """An op whose output is a dict of plain data: the training thread notes only the tokenizer (the ids are
    read from the output's copy where they are decoded), and the texts are those of the ids as the op
    returned them, whatever the caller does to its lists afterwards."""
    from otel_rl._token2text import FROM_OUTPUT

    tok = LetterTokenizer()
    with capture(token2text=True, tokenizer=tok, batch_delay_s=5.0) as cap:
        ro = Rollout()
        with otel_rl.trajectory(step=0, sample_index=0):
            prompt, response = [0, 1], [2]
            out = ro.run(prompt, response)
            entries = _jobs_left()
            prompt.append(3)  # the caller goes on with its lists (as an agent loop does with its context)
            response[0] = 25
        assert out["prompt_ids"] == [0, 1, 3]
        assert entries == [(tok, FROM_OUTPUT)]  # no ids copied on the training thread
        cap.collect()
        node = only(one_trajectory(cap).root.find("Rollout.run"))
        assert output_of(node) == {"prompt_ids": [0, 1], "response_ids": [2], "prompt_text": "ab",
                                   "response_text": "c"}


@pytest.mark.parametrize("case", ["tensor", "large", "object"])
def test_token2text_ids_copied_when_the_output_is_not_a_small_plain_copy(case):
    """Ids in an output that is not copied as plain data (a tensor), whose copy is too large to be sure its
    JSON text is not cut, or that is an object rather than a dict: the training thread copies the ids, and
    they are decoded all the same."""

    class Out:
        def __init__(self, p, r):
            self.prompt_ids, self.response_ids = p, r

    class Ops:
        tokenizer = LetterTokenizer()

        @otel_rl.op
        def run(self, p, r):
            if case == "tensor":
                return {"prompt_ids": torch.tensor(p), "response_ids": r}
            if case == "large":
                return {"prompt_ids": p, "response_ids": r, "pad": "x" * 200}
            return Out(p, r)

    with capture(token2text=True, batch_delay_s=5.0, max_value_chars=1000) as cap:
        with otel_rl.trajectory(step=0, sample_index=0):
            Ops().run([0, 1], [2])
            entries = _jobs_left()
        assert len(entries) == 1 and len(entries[0]) == 3
        assert [list(map(int, ids)) for ids in entries[0][1:]] == [[0, 1], [2]]
        cap.collect()
        node = only([n for n in one_trajectory(cap).root.walk() if n.name.endswith("Ops.run")])
        texts = (output_of(node)["prompt_text"], output_of(node)["response_text"]) if case != "object" else (
            node.attributes.get(sc.PROMPT_TEXT), node.attributes.get(sc.RESPONSE_TEXT))
        assert texts == ("ab", "c")


def test_token2text_with_a_span_processor_of_the_users():
    """A span processor of the user's own gets the op spans as otel-rl's exporters do: materialised on the
    pipeline's thread, token2text's texts included."""
    tok = LetterTokenizer()
    mem = InMemorySpanExporter()
    with capture(token2text=True, tokenizer=tok) as cap:
        cap.handle.tracer_provider.add_span_processor(SimpleSpanProcessor(mem))
        with otel_rl.trajectory(step=0, sample_index=0):
            Rollout().run([4, 0], [1, 2])
        cap.collect()
        node = only(one_trajectory(cap).root.find("Rollout.run"))
        assert output_of(node) == {"prompt_ids": [4, 0], "response_ids": [1, 2], "prompt_text": "ea",
                                   "response_text": "bc"}
        mine = only([s for s in mem.get_finished_spans() if s.name == "Rollout.run"])
        assert json.loads(mine.attributes[sc.RL_OP_OUTPUT]) == {"prompt_ids": [4, 0], "response_ids": [1, 2],
                                                                "prompt_text": "ea", "response_text": "bc"}


# ----------------------------------------------------------------------------- unsampled trajectories


def test_unsampled_trajectory_emits_no_spans():
    with capture(max_samples=0) as cap:
        with otel_rl.step(1):
            with otel_rl.trajectory(sample_index=0) as t:
                assert not t.sampled
                assert outer(1) == 5
                assert list(count_up(2)) == [0, 1]
                assert asyncio.run(fetch_double(1)) == 2
        cap.collect()
        assert {s.name for s in cap.spans} <= {sc.SPAN_RUN, sc.SPAN_STEP, sc.SPAN_LOG}
        assert cap.trajectories() == []


def test_unsampled_trajectory_error_is_kept():
    with capture(max_samples=0) as cap:
        with otel_rl.step(1):
            with pytest.raises(MyError):
                with otel_rl.trajectory(sample_index=4, rollout_n=1) as t:
                    assert not t.sampled
                    inner(1)
                    failing(2)
        cap.collect()
        tr = one_trajectory(cap, step=1, sample_index=4)
        root = tr.root
        assert root.attributes[sc.RL_SAMPLED] is False
        assert root.status == "ERROR" and root.status_message == "MyError: bad 2"
        assert is_my_error(only(exception_events(root))["attributes"][sc.EXCEPTION_TYPE])
        assert [c.name for c in root.children] == ["failing"]  # the op that worked is not kept
        op_node = root.children[0]
        assert op_node.status == "ERROR"
        assert only(exception_events(op_node))["attributes"][sc.EXCEPTION_MESSAGE] == "bad 2"
        assert root.start_ns <= op_node.start_ns <= op_node.end_ns <= root.end_ns
        # still linked to the step
        traj_span = only(cap.spans_named(sc.SPAN_TRAJECTORY))
        assert traj_span.links[0].context.span_id == only(cap.spans_named(sc.SPAN_STEP)).context.span_id


def test_unsampled_trajectory_caught_error_is_kept():
    with capture(max_samples=0) as cap:
        with otel_rl.trajectory(step=2, sample_index=0):
            with pytest.raises(MyError):
                failing(5)
        cap.collect()
        root = one_trajectory(cap, step=2).root
        assert root.attributes[sc.RL_SAMPLED] is False
        assert root.status == "ERROR" and not exception_events(root)
        assert [c.name for c in root.children] == ["failing"]


# ----------------------------------------------------------------------------- metric instruments


def test_log_becomes_gauge_without_step(cap):
    otel_rl.log({"actor/pg_loss": 0.5, "n": 3}, step=7)
    cap.collect()
    pts = cap.metric_points("rl.train.actor/pg_loss")
    assert len(pts) == 1
    p = pts[0]
    assert p.value == 0.5
    assert sc.RL_STEP not in p.attributes
    assert p.attributes[sc.RL_RUN_ID] == cap.handle.run_id
    assert cap.metrics_by_step()[7] == {"actor/pg_loss": 0.5, "n": 3}


def test_trajectory_duration_counts_sampled_and_unsampled():
    with capture(max_samples=1) as cap:
        states = []
        for i in range(3):
            with otel_rl.trajectory(step=0, sample_index=i) as t:
                states.append(t.sampled)
                time.sleep(0.005)
                inner(i)
        assert states == [True, False, False]
        with otel_rl.trajectory(step=0, sample_index=9, trace=False):
            pass
        cap.collect()
        assert len(cap.trajectories()) == 1
        pts = cap.metric_points(sc.METRIC_TRAJECTORY_DURATION)
        assert sum(p.count for p in pts) == 4
        assert sum(p.sum for p in pts) >= 0.015
        assert sum(p.value for p in cap.metric_points(sc.METRIC_TRAJECTORIES)) == 4


def test_tool_calls_counted(cap):
    with otel_rl.trajectory(step=0, sample_index=0):
        calc("1+1")
        calc("1+2", tool_call_id="x")
        with pytest.raises(ValueError):
            calc("nonsense")
    cap.collect()
    calls = cap.metric_points(sc.METRIC_TOOL_CALLS)
    assert sum(p.value for p in calls) == 3
    assert {p.attributes[sc.GEN_AI_TOOL_NAME] for p in calls} == {"calc"}
    assert sum(p.value for p in cap.metric_points(sc.METRIC_TOOL_ERRORS)) == 1


# ----------------------------------------------------------------------------- handle lifecycle


def test_handle_context_manager_shuts_down():
    cap = CaptureExporter()
    with otel_rl.init(exporters=[cap], tracing=True, batch_delay_s=0.05) as h:
        assert otel_rl.current() is h and not h.closed
        with otel_rl.trajectory(step=0, sample_index=0):
            inner(1)
    assert h.closed and otel_rl.current() is None and _runtime.active.tracing is False
    # everything made before the shutdown was delivered
    assert len(cap.trajectories()) == 1
    n = len(cap.spans)
    assert inner(2) == 3  # no pipeline any more: plain call
    assert len(cap.spans) == n


def test_shutdown_twice_is_fine():
    h = otel_rl.init(exporters=[CaptureExporter()], tracing=True, batch_delay_s=0.05)
    h.shutdown()
    h.shutdown()
    otel_rl.shutdown()  # nothing current: no-op
    assert h.closed and h.flush() is True


def test_log_after_shutdown_warns_and_is_noop(caplog):
    from otel_rl import _values

    _values._warned_keys.discard("log-after-shutdown")  # warn_once is per process
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], tracing=True, batch_delay_s=0.05)
    h.log({"a": 1.0}, step=1)
    h.shutdown()
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        h.log({"a": 2.0}, step=2)
    assert any("after shutdown" in r.getMessage() for r in caplog.records)
    assert cap.metrics_by_step() == {1: {"a": 1.0}}


def test_init_twice_shuts_down_the_first(caplog):
    c1, c2 = CaptureExporter(), CaptureExporter()
    h1 = otel_rl.init(exporters=[c1], tracing=True, batch_delay_s=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            h2 = otel_rl.init(exporters=[c2], tracing=True, batch_delay_s=0.05)
        try:
            assert h1.closed and not h2.closed
            assert otel_rl.current() is h2
            assert any("init() called again" in r.getMessage() for r in caplog.records)
            otel_rl.log({"x": 1.0}, step=0)
            c2.collect()
            assert c2.metrics_by_step() == {0: {"x": 1.0}}
            assert c1.metrics_by_step() == {}
        finally:
            h2.shutdown()
    finally:
        h1.shutdown()
