"""Delivery queue policies: poison batches, partial-batch retries, tracker idempotency."""

from __future__ import annotations

import logging

import otel_rl
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import StepMetrics


class PoisonOnStep(otel_rl.Exporter):
    """Rejects (with a data error) any batch holding step 2; accepts the rest."""

    def __init__(self):
        self.steps: list[int] = []
        self.calls = 0

    def export_records(self, records):
        self.calls += 1
        steps = [r.step for r in records if isinstance(r, StepMetrics)]
        if 2 in steps:
            raise ValueError("step 2 cannot be stored")
        self.steps.extend(steps)


def test_poison_batch_is_dropped_counted_and_does_not_block(caplog):
    exp = PoisonOnStep()
    h = otel_rl.init(exporters=[exp], batch_delay_s=0.02)
    try:
        for s in (1, 2, 3):
            h.log({"x": float(s)}, step=s)
            h.flush(10)  # one batch per step
        stats = h.stats()["exporters"][exp.name]
    finally:
        h.shutdown(5)
    assert exp.steps == [1, 3]
    assert stats["dropped"] == 1
    assert stats["failed_attempts"] == 3
    assert any("rejected a batch 3 times" in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


class FlakyBoth(otel_rl.Exporter):
    """Consumes spans and records; records fail the first time."""

    wants_spans = True

    def __init__(self):
        self.spans: list = []
        self.records: list = []
        self.failures_left = 1

    def export_spans(self, spans):
        self.spans.extend(spans)

    def export_records(self, records):
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("tracker down")
        self.records.extend(records)


def test_retry_after_records_failure_does_not_resend_spans():
    exp = FlakyBoth()
    h = otel_rl.init(exporters=[exp], batch_delay_s=0.02)
    try:
        h.log({"a": 1.0}, step=1)
        assert h.flush(20)
    finally:
        h.shutdown(5)
    log_spans = [s for s in exp.spans if s.name == "rl.log"]
    assert len(log_spans) == 1
    assert [r.values for r in exp.records if isinstance(r, StepMetrics)] == [{"a": 1.0}]


class HalfFailingTracker(TrackerExporter):
    """Metrics succeed, generations fail once: the retry must not write the metrics twice."""

    tracker_name = "half"

    def __init__(self, config):
        super().__init__(config)
        self.metrics: list = []
        self.generations: list = []
        self.fail_generations = 1

    def open_run(self, run, start):
        return run

    def write_metrics(self, handle, metrics):
        self.metrics.extend((m.step, dict(m.values)) for m in metrics)

    def write_generations(self, handle, generations):
        if self.fail_generations:
            self.fail_generations -= 1
            raise ConnectionError("down")
        self.generations.extend(g.rows for g in generations)


def test_tracker_base_retry_is_idempotent_per_part():
    from otel_rl.config import resolve

    exp = HalfFailingTracker(resolve(env={}))
    h = otel_rl.init(exporters=[exp], batch_delay_s=0.05)
    try:
        h.log({"a": 1.0}, step=1)
        h.log_generations([("q", "a", 1.0)], step=1)
        assert h.flush(20)
    finally:
        h.shutdown(5)
    assert exp.metrics == [(1, {"a": 1.0})]
    assert exp.generations == [[("q", "a", 1.0)]]
