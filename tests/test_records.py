"""RecordBuilder on SDK spans made by hand (the form any OpenTelemetry producer gives it)."""

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from otel_rl import semconv as sc
from otel_rl.records import RecordBuilder, RunStart


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
