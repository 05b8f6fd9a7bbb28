"""While trajectories are open, the pipeline leaves what is submitted queued (``rollout_defer_s``):
it goes out at the pipeline thread's first look (every 50 ms) after the last one closed, at a flush,
after ``rollout_defer_s``, or at half the queue."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import otel_rl
from otel_rl.config import ConfigError, resolve
from otel_rl.records import StepMetrics, Trajectory
from spool.spool_helpers import wait_for  # noqa: E402  (tests/ is on sys.path)


class Timed(otel_rl.Exporter):
    """Keeps each delivery with the time it arrived."""

    wants_trajectories = True

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple[float, list]] = []

    def export_records(self, records):
        with self.lock:
            self.calls.append((time.monotonic(), list(records)))

    def of(self, kind) -> list:
        with self.lock:
            return [r for _, recs in self.calls for r in recs if isinstance(r, kind)]

    def first_time(self, kind) -> float | None:
        with self.lock:
            return next((t for t, recs in self.calls if any(isinstance(r, kind) for r in recs)), None)


@otel_rl.op
def double(n: int) -> int:
    return 2 * n


def start(exp: Timed, **kw):
    kw.setdefault("batch_delay_s", 0.02)
    return otel_rl.init(project="defer", experiment="e", exporters=[exp], **kw)


def test_batches_wait_for_the_open_rollouts_and_go_when_the_last_one_closes():
    exp = Timed()
    h = start(exp, rollout_defer_s=60)
    try:
        with otel_rl.trajectory(step=1, sample_index=0):
            with otel_rl.trajectory(step=1, sample_index=1):
                double(1)
                h.log({"x": 1.0}, step=1)
            time.sleep(0.4)  # 20 batch delays: all of it stays queued while one rollout is still open
            assert exp.calls == []
            assert h._pipeline.rollouts.open == 1 and h._pipeline.rollouts.deferrals >= 1
            closed = time.monotonic()
        assert wait_for(lambda: len(exp.of(Trajectory)) == 2 and exp.of(StepMetrics), 10)  # no flush
        first = min(exp.first_time(Trajectory), exp.first_time(StepMetrics))
        assert first >= closed and first - closed < 5.0  # seen after the end, not sent at the 60 s bound
        assert h._pipeline.rollouts.open == 0
    finally:
        h.shutdown(10)


def test_a_flush_inside_a_rollout_delivers_at_once():
    exp = Timed()
    h = start(exp, rollout_defer_s=60)
    try:
        with otel_rl.trajectory(step=2, sample_index=0):
            h.log({"x": 2.0}, step=2)
            assert h.flush(10)
            assert [r.step for r in exp.of(StepMetrics)] == [2]
            h.log({"x": 3.0}, step=3)  # and the deferral goes on after it
            time.sleep(0.3)
            assert [r.step for r in exp.of(StepMetrics)] == [2]
    finally:
        h.shutdown(10)
    assert [r.step for r in exp.of(StepMetrics)] == [2, 3]  # shutdown does not wait for anything


def test_deferral_ends_after_rollout_defer_s_of_open_rollouts():
    exp = Timed()
    h = start(exp, rollout_defer_s=0.3)
    try:
        with otel_rl.trajectory(step=0, sample_index=0):
            opened = time.monotonic()
            h.log({"x": 1.0}, step=0)
            assert wait_for(lambda: exp.of(StepMetrics), 10)  # while the rollout is still open
            assert exp.first_time(StepMetrics) - opened >= 0.25
            h.log({"x": 2.0}, step=1)  # past the bound: batches flow as without deferral
            assert wait_for(lambda: len(exp.of(StepMetrics)) == 2, 2)
    finally:
        h.shutdown(10)


def test_rollouts_one_after_another_are_one_stretch_for_the_bound():
    """A trainer that runs its trajectories one at a time opens the next one right after the last one
    closed: that is still one rollout phase, and `rollout_defer_s` bounds it as a whole (a stretch that
    started anew with each trajectory would leave everything queued for as long as the rollouts go on)."""
    exp = Timed()
    h = start(exp, rollout_defer_s=0.3)
    try:
        opened = time.monotonic()
        i = 0
        while not exp.of(StepMetrics) and time.monotonic() - opened < 3.0:
            with otel_rl.trajectory(step=0, sample_index=i):
                if i == 0:
                    h.log({"x": 1.0}, step=0)
                time.sleep(0.002)  # (the trajectory's work: the pipeline thread runs meanwhile)
            i += 1
        first = exp.first_time(StepMetrics)
        assert first is not None, "still held back after 3 s of back-to-back rollouts"
        assert 0.25 <= first - opened < 1.5 and i > 20
    finally:
        h.shutdown(10)


def test_rollouts_one_after_another_do_not_wake_the_pipeline_thread_at_each_end():
    exp = Timed()
    h = start(exp, rollout_defer_s=60)
    try:
        with otel_rl.trajectory(step=0, sample_index=-1):
            h.log({"x": 1.0}, step=0)
            time.sleep(0.1)  # the pipeline thread finds it open and leaves the batch queued
        for i in range(200):  # ~0.5 s of rollouts, each opened right after the last one closed
            with otel_rl.trajectory(step=0, sample_index=i):
                time.sleep(0.002)
                if i == 199:
                    woken = h._pipeline.rollouts.deferrals
                    assert exp.of(StepMetrics) == []  # still deferred: the stretch goes on
        # looked in on every ~50 ms rather than woken by each of the 200 ends
        assert 1 <= woken <= 40, woken
        assert wait_for(lambda: exp.of(StepMetrics), 5)  # after the last end: out within a look
    finally:
        h.shutdown(10)


def test_zero_turns_deferral_off():
    exp = Timed()
    h = start(exp, rollout_defer_s=0)
    try:
        with otel_rl.trajectory(step=0, sample_index=0):
            h.log({"x": 1.0}, step=0)
            assert wait_for(lambda: exp.of(StepMetrics), 10)
            assert h._pipeline.rollouts.open == 0 and h._pipeline.rollouts.deferrals == 0  # not even counted
    finally:
        h.shutdown(10)


def test_half_the_queue_is_not_held_back_and_nothing_is_dropped():
    exp = Timed()
    h = start(exp, rollout_defer_s=60, queue_size=2000)
    try:
        with otel_rl.trajectory(step=0, sample_index=0):
            for i in range(1500):
                h.log({"x": float(i)}, step=i)
            assert wait_for(lambda: len(exp.of(StepMetrics)) >= 1000, 10)  # still inside the rollout
        assert h.flush(10)
        assert sorted(r.step for r in exp.of(StepMetrics)) == list(range(1500))
        assert h.stats()["pipeline_dropped"] == 0
    finally:
        h.shutdown(10)


def test_open_rollouts_are_counted_exactly_across_threads_tasks_errors_and_sampling():
    exp = Timed()
    h = start(exp, rollout_defer_s=60, max_samples=1)  # most trajectories unsampled
    pipeline = h._pipeline
    try:
        def worker(k: int) -> None:
            for i in range(300):
                try:
                    with otel_rl.trajectory(step=k, sample_index=i, trace=i % 5 != 0):
                        if i % 7 == 0:
                            raise RuntimeError("tool failed")
                        double(i)
                except RuntimeError:
                    pass

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pipeline.rollouts.open == 0

        peak = []

        async def rollout(i: int) -> None:
            async with otel_rl.trajectory(step=99, sample_index=i):
                await asyncio.sleep(0.01)
                peak.append(pipeline.rollouts.open)

        async def main():
            await asyncio.gather(*(rollout(i) for i in range(50)))

        asyncio.run(main())
        assert max(peak) == 50 and pipeline.rollouts.open == 0
        assert h.flush(20)
        # and nothing was lost while they were deferred: the one sampled trajectory of step 99 arrived
        assert len([t for t in exp.of(Trajectory) if t.step == 99]) == 1
    finally:
        h.shutdown(10)


def test_the_setting_is_read_and_checked(monkeypatch):
    assert resolve().rollout_defer_s == 5.0
    assert resolve(rollout_defer_s="0.5").rollout_defer_s == 0.5
    monkeypatch.setenv("OTEL_RL_ROLLOUT_DEFER_S", "0")
    assert resolve().rollout_defer_s == 0.0
    for bad in ("soon", -1, 1e9):
        with pytest.raises(ConfigError, match="rollout_defer_s"):
            resolve(rollout_defer_s=bad)
