"""Delivery queue policies: poison batches, partial-batch retries, tracker idempotency."""

from __future__ import annotations

import logging

import pytest

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
    assert stats["dropped"] == 1 and stats["rejected"] == 1
    assert stats["failed_attempts"] == 3  # a batch of one record: that one is the bad one
    assert any("rejected a batch 3 times" in r.getMessage() for r in caplog.records)
    (msg,) = [r.getMessage() for r in caplog.records if "as bad data" in r.getMessage()]
    assert f"exporter {exp.name!r} rejected the metrics 'x' at step 2" in msg


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


# -- export_interval_s: a tracker exporter's queue gathers what is queued into one delivery -----------


class Calls(otel_rl.Exporter):
    """Keeps each export_records call; rejects (as bad data) any call holding step `bad`."""

    gathers = True

    def __init__(self, bad: int | None = None):
        self.calls: list[list[int]] = []
        self.bad = bad

    def export_records(self, records):
        steps = [r.step for r in records]
        if self.bad in steps:
            raise ValueError(f"step {self.bad} cannot be stored")
        self.calls.append(steps)


def _metrics(step: int) -> list:
    return [StepMetrics(run=None, step=step, values={"x": float(step)}, time_ns=step)]


def _wait(cond, timeout_s: float = 15.0) -> None:
    import time

    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_gathered_batches_go_out_in_one_call_in_order():
    from otel_rl._delivery import DeliveryQueue

    exp = Calls()
    q = DeliveryQueue(exp, 1000, gather_s=1.5)
    try:
        for s in range(1, 6):
            assert q.put([], _metrics(s))
        _wait(lambda: exp.calls)
        assert exp.calls == [[1, 2, 3, 4, 5]]  # five batches, one delivery, in order
        assert q.stats.exported == 5 and q.stats.queued == 0
    finally:
        q.stop(5)


def test_flush_and_stop_do_not_wait_for_the_interval():
    import time

    from otel_rl._delivery import DeliveryQueue

    exp = Calls()
    q = DeliveryQueue(exp, 1000, gather_s=60.0)
    t0 = time.monotonic()
    for s in (1, 2):
        q.put([], _metrics(s))
    assert q.wait_idle(20)  # a flush delivers now
    assert time.monotonic() - t0 < 20
    assert [s for c in exp.calls for s in c] == [1, 2]
    q.put([], _metrics(3))
    q.stop(20)  # and so does a stop
    assert time.monotonic() - t0 < 20
    assert [s for c in exp.calls for s in c] == [1, 2, 3]


def test_a_flush_ends_the_gathering_of_every_queue_at_once():
    """wait_all_idle (what a flush of the pipeline and of the export process waits with): while one
    queue's delivery is still running, the other queues have already stopped gathering and delivered;
    one after the other, each would gather until the ones before it were done."""
    import threading
    import time

    from otel_rl._delivery import DeliveryQueue, wait_all_idle

    class Held(Calls):
        def __init__(self):
            super().__init__()
            self.release = threading.Event()

        def export_records(self, records):
            self.release.wait(30)
            super().export_records(records)

    held, quick = Held(), Calls()
    qa, qb = DeliveryQueue(held, 1000, gather_s=60.0), DeliveryQueue(quick, 1000, gather_s=60.0)
    try:
        qa.put([], _metrics(1))
        qb.put([], _metrics(2))
        done = []
        t = threading.Thread(target=lambda: done.append(wait_all_idle([qa, qb], 60)))
        t.start()
        _wait(lambda: quick.calls)  # the second queue delivered while the first one's delivery is held
        assert not held.calls and not done
        held.release.set()
        t.join(30)
        assert done == [True] and held.calls == [[1]] and quick.calls == [[2]]
        qb.put([], _metrics(3))  # after the flush the queues gather again
        time.sleep(0.5)
        assert quick.calls == [[2]]
        assert wait_all_idle([qa, qb], 30) and quick.calls == [[2], [3]]
    finally:
        held.release.set()
        qa.stop(5)
        qb.stop(5)


def test_a_bad_record_in_a_gathered_delivery_drops_only_itself(caplog):
    from otel_rl._delivery import DeliveryQueue

    exp = Calls(bad=2)
    q = DeliveryQueue(exp, 1000, gather_s=1.0)
    try:
        for s in (1, 2, 3):
            q.put([], _metrics(s))
        _wait(lambda: q.stats.exported + q.stats.dropped == 3)
        assert [s for c in exp.calls for s in c] == [1, 3]  # the good records, once each
        assert q.stats.dropped == 1 and q.stats.rejected == 1
    finally:
        q.stop(5)
    assert any("rejected a batch 3 times" in r.getMessage() for r in caplog.records)


class RunRefusingTracker(TrackerExporter):
    """Writes metrics; refuses (as bad data) to open the run named "bad", the way a tracker refuses a run
    name, after the metrics of the other run of the batch are written."""

    tracker_name = "runrefusing"

    def __init__(self, config):
        super().__init__(config)
        self.points: list = []

    def open_run(self, run, start):
        if run.run_id == "bad":
            raise ValueError("the tracker refuses this run")
        return run

    def write_metrics(self, handle, metrics):
        self.points.extend((handle.run_id, m.step) for m in metrics)


def test_the_parts_of_a_rejected_batch_are_not_written_twice_by_a_tracker(caplog):
    """A batch a tracker exporter keeps rejecting (a run it cannot open, outside its own isolation of bad
    records) goes to it in parts: what its first attempts wrote, and each part that went through, is
    written once; only the records of the refused run are dropped."""
    from otel_rl._delivery import DeliveryQueue
    from otel_rl.config import resolve
    from otel_rl.records import RunIdentity

    good, bad = RunIdentity("p", "e", "good"), RunIdentity("p", "e", "bad")
    records = [StepMetrics(good, s, {"a": 1.0}, s) for s in range(6)] + [StepMetrics(bad, 6, {"a": 1.0}, 6)]
    records += [StepMetrics(good, s, {"a": 1.0}, s) for s in range(7, 10)]
    exp = RunRefusingTracker(resolve(env={}))
    exp.name = "runrefusing"
    q = DeliveryQueue(exp, 1000, backoff_max_s=0.1, gather_s=0.0)
    try:
        q.put([], records)
        assert q.wait_idle(20)
        stats = q.stats.as_dict()
    finally:
        q.stop(5)
    assert sorted(exp.points) == [("good", s) for s in range(10) if s != 6]  # each once
    assert stats["rejected"] == 1 and stats["dropped"] == 1 and stats["exported"] == 9


def test_only_gathering_exporters_gather_and_the_setting_is_checked():
    import pytest

    from otel_rl._delivery import DeliveryQueue
    from otel_rl.config import resolve

    class Plain(Calls):
        gathers = False

    cfg = resolve(export_interval_s=5)
    plain, tracker = Plain(), Calls()
    qp, qt = DeliveryQueue(plain, 1000, config=cfg), DeliveryQueue(tracker, 1000, config=cfg)
    try:
        qp.put([], _metrics(1))
        _wait(lambda: plain.calls)  # at once: an exporter that does not gather is not held back
        assert qp._gather_s == 0 and qt._gather_s == 5.0
    finally:
        qp.stop(5)
        qt.stop(5)
    assert resolve(env={}).export_interval_s == 1.0
    assert resolve(env={"OTEL_RL_EXPORT_INTERVAL_S": "0"}).export_interval_s == 0.0
    for bad in ("-1", "nan", "soon", 1e9):
        with pytest.raises(otel_rl.ConfigError, match="export_interval_s"):
            resolve(export_interval_s=bad)


def test_a_gathering_queue_wakes_its_thread_for_its_first_batch_only():
    """Batches that come while the delivery thread gathers do not wake it (in the training process each
    wake-up costs the training thread a switch of the interpreter lock); a queue that does not gather,
    a flush and a full gathering wake it as before."""
    from otel_rl._delivery import _GATHER_MAX_ITEMS, DeliveryQueue

    class Plain(Calls):
        gathers = False

    def counting(q):
        n = [0]
        notify = q._cond.notify

        def counted(*a):
            n[0] += 1
            notify(*a)

        q._cond.notify = counted
        return n

    exp, plain = Calls(), Plain()
    q, qp = DeliveryQueue(exp, 100_000, gather_s=60.0), DeliveryQueue(plain, 1000)
    try:
        wakes, plain_wakes = counting(q), counting(qp)
        for s in range(1, 11):
            q.put([], _metrics(s))
            qp.put([], _metrics(s))
        assert wakes[0] == 1  # the first batch; the thread then waits for the interval
        assert plain_wakes[0] == 10
        _wait(lambda: qp.stats.exported == 10)
        assert not exp.calls  # still gathering
        assert q.wait_idle(20)  # a flush cuts it short: everything in one delivery
        assert exp.calls == [list(range(1, 11))]
        # more than a gathered delivery holds: the thread is woken to send it at once
        big = [StepMetrics(run=None, step=100, values={"x": 1.0}, time_ns=i) for i in range(_GATHER_MAX_ITEMS)]
        q.put([], _metrics(99))
        before = wakes[0]
        q.put([], big)
        assert wakes[0] == before + 1
        _wait(lambda: q.stats.exported == 11 + _GATHER_MAX_ITEMS)
        assert [c[0] for c in exp.calls[1:]] == [99, 100]  # at once (not after 60 s), in two: over the cap
    finally:
        q.stop(5)
        qp.stop(5)


class Preparing(Calls):
    """Calls, with `prepare`: keeps the steps of each batch it is given ahead of its delivery."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.prepared: list[list[int]] = []
        self.delivered_before_prepared: list[int] = []
        self.fail = fail

    def prepare(self, records):
        steps = [r.step for r in records]
        delivered = [s for c in self.calls for s in c]
        self.delivered_before_prepared += [s for s in steps if s in delivered]
        self.prepared.append(steps)
        if self.fail:
            raise RuntimeError("cannot work ahead")


def test_a_gathering_queue_hands_each_batch_to_prepare_while_it_gathers():
    """An exporter with `prepare` gets each batch ahead of the gathered delivery (once each, as it comes,
    not when the delivery goes out); the delivery still gets everything, in order, in one call."""
    from otel_rl._delivery import DeliveryQueue

    exp = Preparing()
    q = DeliveryQueue(exp, 1000, gather_s=60.0)
    try:
        for s in range(1, 4):
            q.put([], _metrics(s))
            _wait(lambda s=s: [x for b in exp.prepared for x in b] == list(range(1, s + 1)))
        assert not exp.calls  # still gathering: the work was done ahead
        assert q.wait_idle(20)  # a flush delivers it
        assert exp.calls == [[1, 2, 3]] and exp.prepared == [[1], [2], [3]]
        q.put([], _metrics(4))
        assert q.wait_idle(20)  # a batch the flush caught before prepare: delivered all the same
        assert [s for c in exp.calls for s in c] == [1, 2, 3, 4]
        assert exp.delivered_before_prepared == []  # prepare never saw a batch already delivered
    finally:
        q.stop(5)


def test_a_failing_prepare_costs_nothing_but_its_time():
    from otel_rl._delivery import DeliveryQueue

    exp = Preparing(fail=True)
    q = DeliveryQueue(exp, 1000, gather_s=0.3)
    try:
        for s in (1, 2):
            q.put([], _metrics(s))
        _wait(lambda: exp.calls)
        assert exp.calls == [[1, 2]] and q.stats.exported == 2 and q.stats.failed_attempts == 0
        assert exp.prepared == [[1], [2]]
    finally:
        q.stop(5)
    # a queue that does not gather delivers each batch at once: nothing to do ahead
    plain = Preparing()
    qp = DeliveryQueue(plain, 1000, gather_s=0.0)
    try:
        qp.put([], _metrics(7))
        _wait(lambda: plain.calls)
        assert plain.prepared == [] and qp._prepare is None
    finally:
        qp.stop(5)


def test_console_and_jsonl_lines_are_gathered_and_flushed(tmp_path, capsys):
    """The console and JSONL exporters gather like the trackers: nothing within export_interval_s, every
    line at a flush, in step order."""
    import json

    h = otel_rl.init(exporters=["console", "file"], jsonl_path=str(tmp_path / "m.jsonl"), export_interval_s=60)
    try:
        capsys.readouterr()
        for s in (1, 2, 3):
            otel_rl.log({"x": float(s)}, step=s)
        import time

        time.sleep(0.8)  # the pipeline's batches (0.2 s) reached the queues, which hold them
        assert "step:" not in capsys.readouterr().out
        assert (tmp_path / "m.jsonl").read_text() == ""
        h.flush()
        out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step:")]
        assert [line.split(" - ")[0] for line in out] == ["step:1", "step:2", "step:3"]
        lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2, 3]
    finally:
        h.shutdown(10)


_DISK_FULL_CHILD = r"""
import os, resource, signal, sys
import otel_rl
path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as ENOSPC would
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
h = otel_rl.init(exporters=["file"], jsonl_path=path, batch_delay_s=0.01, export_interval_s=0.05)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # the disk is full after `limit` bytes
for s in range(1000):
    otel_rl.log({"loss": s / 7, "reward/mean": float(s), "note": s * 3}, step=s)
    if s % 100 == 99:
        h.flush(0.5)  # deliveries fail part-way and are retried
with open(path, "rb") as f:
    data = f.read()
full = len(data) if data.endswith(b"\n") else -1  # whole lines only, also while the disk is full
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again
ok = h.flush(30)
h.shutdown(10)
print(full, ok, h.stats()["exporters"]["file"]["failed_attempts"])
"""


@pytest.mark.slow
def test_jsonl_on_a_full_disk_writes_whole_lines_once_and_resumes(tmp_path):
    """A file-size limit (RLIMIT_FSIZE) stands in for a full disk: writes stop part-way through a line.
    The file never holds a torn line, and once there is space again every step is there exactly once,
    in order."""
    import json
    import subprocess
    import sys

    path = tmp_path / "m.jsonl"
    limit = 20_011  # not on a line boundary
    res = subprocess.run(
        [sys.executable, "-c", _DISK_FULL_CHILD, str(path), str(limit)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    full, ok, failed = res.stdout.split()[-3:]
    assert ok == "True" and int(failed) > 0  # it did hit the limit and retried
    assert 0 < int(full) <= limit
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    steps = [json.loads(line)["step"] for line in raw.splitlines()]  # every line whole JSON
    assert steps == list(range(1000))


# -- bad data: isolated to its own record ----------------------------------------------------------


def test_log_refuses_a_step_outside_int64_with_one_warning_and_keeps_the_rest(caplog):
    from otel_rl.testing import CaptureExporter

    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], batch_delay_s=0.02)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            otel_rl.log({"loss": 1.0}, step=1)
            otel_rl.log({"loss": 2.0}, step=2**63)
            otel_rl.log({"loss": 2.5}, step=2**63)  # the same step again: no second warning
            otel_rl.log_generations([("q", "a", 1.0)], step=-(2**63) - 1)
            otel_rl.log({"loss": 3.0}, step=2**63 - 1)  # the int64 bounds themselves are steps
            otel_rl.log({"loss": 4.0}, step=-(2**63))
            otel_rl.log({"loss": 5.0})  # the current step is still the last good one
        assert h.flush(10)
    finally:
        h.shutdown(5)
    got = [(r.step, r.values) for r in cap.records if isinstance(r, StepMetrics)]
    assert got == [(1, {"loss": 1.0}), (2**63 - 1, {"loss": 3.0}), (-(2**63), {"loss": 4.0}), (-(2**63), {"loss": 5.0})]
    assert not [r for r in cap.records if type(r).__name__ == "Generations"]
    warned = [r.getMessage() for r in caplog.records if "64-bit" in r.getMessage()]
    assert len(warned) == 2 and str(2**63) in warned[0] and str(-(2**63) - 1) in warned[1]


class PointRefusingTracker(TrackerExporter):
    """A tracker whose store refuses any point whose value is 13.0 (a data error), but only when it
    is written (the write of a whole batch fails)."""

    tracker_name = "refusing"

    def __init__(self, config):
        super().__init__(config)
        self.points: list[tuple[int, str, float]] = []
        self.calls = 0

    def open_run(self, run, start):
        return run

    def write_metrics(self, handle, metrics):
        self.calls += 1
        if any(v == 13.0 for m in metrics for v in m.values.values()):
            raise ValueError("value 13 cannot be stored")
        self.points.extend((m.step, k, v) for m in metrics for k, v in m.values.items())


def test_a_tracker_rejects_only_the_point_it_refuses_and_delivers_the_rest(caplog):
    """Bisecting a refused write finds the bad record among 200; of that step only the refused key is
    rejected, with one warning naming key and step; the other keys and steps are all delivered, and
    the data error is not retried."""
    from otel_rl._delivery import DeliveryQueue
    from otel_rl.config import resolve
    from otel_rl.records import RunIdentity

    run = RunIdentity("p", "e", "r")
    exp = PointRefusingTracker(resolve(env={}))
    exp.name = "refusing"
    records = [StepMetrics(run, s, {"a": float(s), "b": -float(s)}, s) for s in range(200)]
    q = DeliveryQueue(exp, 10_000, gather_s=0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            q.put([], records)
            assert q.wait_idle(10)
        stats = q.stats.as_dict()
    finally:
        q.stop(5)
    want = sorted((s, k, v) for s in range(200) for k, v in (("a", float(s)), ("b", -float(s))) if v != 13.0)
    assert sorted(exp.points) == want  # each once
    assert stats["rejected"] == 1 and stats["exported"] == 200 and stats["failed_attempts"] == 0
    assert exp.calls < 40  # halves, not one call per record
    (msg,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "metric 'a' at step 13" in msg


# -- overload: records are never dropped in memory, spans may be shed --------------------------------


def _burst(h, threads: int, per: int) -> None:
    import threading

    def loop(t: int) -> None:
        for i in range(per):
            otel_rl.log({"loss": i / 3, "thread": t}, step=t * per + i)
            if i % 10 == 0:
                otel_rl.log_generations([(f"q{t}", f"a{i}", i / 7)], step=t * per + i)

    ts = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _jsonl_steps(path) -> list[int]:
    import json

    return [json.loads(line)["step"] for line in path.read_bytes().splitlines()]


@pytest.mark.parametrize("policy", [None, "wait"], ids=["spill-by-default", "wait"])
def test_a_burst_of_log_calls_beyond_the_queue_is_stored_whole_and_in_order(tmp_path, policy):
    """Four tight loops log 20x the queue's bound (and a generations table every 10th step): every record
    reaches the JSONL file (and the capture) once, each loop's in its order; with `spill` the excess went
    through the spill file, with `wait` the callers waited."""
    from otel_rl.records import Generations
    from otel_rl.testing import CaptureExporter

    threads, per = 4, 5000
    path = tmp_path / "m.jsonl"
    kw = {} if policy is None else {"record_overflow": policy}
    cap = CaptureExporter()
    h = otel_rl.init(exporters=["file", cap], jsonl_path=str(path), queue_size=1000,
                     spool_dir=str(tmp_path / "spool"), batch_delay_s=0.05, **kw)
    try:
        _burst(h, threads, per)
        assert h.flush(120)
        stats = h.stats()
    finally:
        h.shutdown(30)
    steps = _jsonl_steps(path)
    assert sorted(steps) == list(range(threads * per))  # all of them, once
    tables = [(g.step, g.rows) for g in cap.records if isinstance(g, Generations)]
    assert sorted(tables) == [(t * per + i, [(f"q{t}", f"a{i}", i / 7)]) for t in range(threads)
                              for i in range(0, per, 10)]
    for t in range(threads):
        mine = [s for s in steps if s // per == t]
        assert mine == sorted(mine)
    assert stats["pipeline_dropped"] == 0 and stats["exporters"]["file"]["dropped"] == 0
    if policy is None:
        assert stats["records_spilled"] > 0
    else:
        assert stats["records_waited"] > 0 and stats["records_spilled"] == 0
    assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]  # the spill file went with it


def test_under_overload_only_spans_are_shed_counted_per_kind_in_stats_and_metrics(tmp_path):
    """Steps with timers in a tight loop overflow a small queue: step and timer spans are shed (counted
    by kind in stats() and in otel_rl.exporter.items{exporter=pipeline,outcome=shed}); every step's
    log() and timing record is kept."""
    from otel_rl import semconv as sc
    from otel_rl.testing import CaptureExporter

    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], queue_size=500, spool_dir=str(tmp_path / "spool"), batch_delay_s=0.05)
    n = 6000
    try:
        for s in range(n):
            with otel_rl.step(s):
                with otel_rl.timer("gen"):
                    pass
                otel_rl.log({"loss": s / 2}, step=s)
        assert h.flush(120)
        stats = h.stats()
    finally:
        h.shutdown(30)
    metrics = [r for r in cap.records if isinstance(r, StepMetrics)]
    losses = sorted(r.step for r in metrics if "loss" in r.values)
    timed = sorted(r.step for r in metrics if "timing_s/gen" in r.values)
    assert losses == list(range(n)) and timed == list(range(n))
    shed = stats["shed"]
    assert shed and set(shed) <= {sc.KIND_STEP, sc.KIND_TIMER} and sum(shed.values()) == stats["pipeline_dropped"]
    assert len([s for s in cap.spans if s.name != sc.SPAN_LOG and s.name != "rl.run"]) + sum(shed.values()) == 2 * n
    points = {}
    for rm in cap.metric_reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == sc.METRIC_EXPORT_ITEMS:
                    for p in m.data.data_points:
                        a = p.attributes
                        if a.get(sc.EXPORTER) == sc.PIPELINE and a.get(sc.OUTCOME) == "shed":
                            points[a[sc.RL_SPAN_KIND]] = p.value
    assert points == shed
