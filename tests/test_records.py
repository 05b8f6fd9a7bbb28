"""RecordBuilder on SDK spans made by hand (the form any OpenTelemetry producer gives it)."""

import math

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from otel_rl import semconv as sc
from otel_rl.records import Generations, RecordBuilder, RunStart, StepMetrics, Trajectory


def _run_span(rank: object) -> ReadableSpan:
    attrs = {sc.RL_PROJECT_NAME: "p", sc.RL_EXPERIMENT_NAME: "e", sc.RL_RUN_ID: "r"}
    if rank is not None:
        attrs[sc.RL_WORKER_RANK] = rank
    return ReadableSpan(
        name=sc.SPAN_RUN,
        context=SpanContext(0xABC, 0xDEF, False, TraceFlags(1)),
        resource=Resource(attrs),
        attributes={sc.RL_RUN_CONFIG: '{"lr": 0.1}'},
        start_time=5,
        end_time=6,
    )


@pytest.mark.parametrize(("rank", "expected"), [(3, 3), ("2", 2), (None, 0), ("", 0), ("not-a-rank", 0)])
def test_run_start_rank_read_from_the_resource_or_zero(rank, expected):
    (rec,) = RecordBuilder().build([_run_span(rank)])
    assert isinstance(rec, RunStart)
    assert rec.rank == expected
    assert rec.config == {"lr": 0.1}
    assert (rec.run.project, rec.run.experiment, rec.run.run_id) == ("p", "e", "r")


def _span(name: str, attrs: dict, span_id: int, parent: int | None = None, trace_id: int = 0x1) -> ReadableSpan:
    return ReadableSpan(
        name=name,
        context=SpanContext(trace_id, span_id, False, TraceFlags(1)),
        parent=SpanContext(trace_id, parent, False, TraceFlags(1)) if parent is not None else None,
        resource=Resource({sc.RL_PROJECT_NAME: "p", sc.RL_WORKER_RANK: float("inf")}),
        attributes=attrs,
        start_time=span_id,
        end_time=span_id + 1,
    )


def test_attribute_values_of_the_wrong_type_are_read_by_their_type():
    """A hand-made span can hold any value under any key (the bridge refuses such spans): the builder
    reads what has its type and leaves the rest, and never raises on the batch."""
    spans = [
        _span(sc.SPAN_LOG, {sc.RL_STEP: "three"}, 1),  # a step that is no integer: no record
        _span(
            sc.SPAN_LOG,
            {
                sc.RL_STEP: 4,
                sc.RL_METRICS_KEYS: ("a", "b", "c", "d"),
                sc.RL_METRICS_VALUES: (0.5, "x", ("nested",), "2.5"),
                sc.RL_METRICS_INT_KEYS: "not-an-array",
                sc.RL_METRICS_INT_VALUES: (1, 2),
                sc.RL_METRICS_BOOL_KEYS: ("ok",),
                sc.RL_METRICS_BOOL_VALUES: (1,),
            },
            2,
        ),
        _span(
            sc.SPAN_GENERATIONS,
            {
                sc.RL_STEP: 4,
                sc.RL_GENERATIONS_INPUTS: ("q1", "q2"),
                sc.RL_GENERATIONS_OUTPUTS: ("a1", "a2"),
                sc.RL_GENERATIONS_SCORES: (1.0, "?"),
            },
            3,
        ),
        _span(sc.SPAN_RUN, {sc.RL_RUN_CONFIG: "[1, 2]"}, 4, trace_id=0x2),
        _span("op", {sc.RL_OP_INPUTS: ("a", "b"), sc.RL_OP_OUTPUT: 7}, 6, parent=5, trace_id=0x3),
        _span("root", {sc.RL_STEP: "x", sc.RL_SAMPLE_INDEX: 2.0, sc.RL_ROLLOUT_N: (1,)}, 5, trace_id=0x3),
    ]
    metrics, gens, run, traj = RecordBuilder().build(spans)
    assert isinstance(metrics, StepMetrics) and metrics.step == 4
    assert metrics.values == {"a": 0.5, "d": 2.5, "ok": True}
    assert isinstance(gens, Generations) and gens.rows[0] == ("q1", "a1", 1.0)
    assert gens.rows[1][:2] == ("q2", "a2") and math.isnan(gens.rows[1][2])
    assert isinstance(run, RunStart) and run.config == {} and run.rank == 0
    assert isinstance(traj, Trajectory)
    assert (traj.step, traj.sample_index, traj.rollout_n) == (None, 2, None)
    (op,) = traj.root.children
    assert (op.inputs, op.output) == ("('a', 'b')", "7")


def test_a_span_received_twice_counts_once_and_a_span_that_is_its_own_parent_is_an_orphan():
    """A sender's retry can deliver the same span again; a hand-made span can name itself as parent."""
    root = _span("trajectory", {sc.RL_STEP: 1}, 0x10)
    child = _span("tool", {sc.RL_SPAN_KIND: sc.KIND_TOOL}, 0x11, parent=0x10)
    again = _span("tool", {sc.RL_SPAN_KIND: sc.KIND_TOOL}, 0x11, parent=0x10)
    selfish = _span("odd", {}, 0x12, parent=0x12)
    b = RecordBuilder()
    assert b.build([child, selfish]) == []
    assert [len(n) for n in b.pending()] == [2]
    (t,) = b.build([again, root])
    assert t.complete and t.step == 1
    assert sorted(n.name for n in t.root.children) == ["odd", "tool"]
    assert [n.span_id for n in t.root.walk()].count(0x11) == 1
    assert all(n.children == [] for n in t.root.children)
    assert not b.pending()


def test_beyond_the_pending_bound_only_traces_older_than_min_age_are_cut_into_partials():
    """The bridge holds roots for a grace period: at a high rate many traces wait at once and must not be cut
    while their root may still come; a builder without `min_age_s` cuts the oldest at the bound."""
    children = [_span("tool", {}, 0x100 + t, parent=0x10, trace_id=t + 1) for t in range(30)]
    roots = [_span("trajectory", {sc.RL_STEP: 1}, 0x10, trace_id=t + 1) for t in range(30)]
    patient = RecordBuilder(max_pending_traces=4, min_age_s=60.0)
    assert patient.build(children) == []  # 30 pending, none old enough to cut
    done = patient.build(roots)
    assert len(done) == 30 and all(t.complete and len(t.root.children) == 1 for t in done)
    hasty = RecordBuilder(max_pending_traces=4)
    cut = hasty.build(children)
    assert len(cut) == 26 and not any(t.complete for t in cut)
    assert len(hasty.pending()) == 4
    hard = RecordBuilder(max_pending_traces=2, min_age_s=60.0)  # ten times the bound: cut whatever the age
    assert len(hard.build(children)) == 10 and len(hard.pending()) == 20
