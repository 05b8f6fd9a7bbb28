"""DeliveryQueue with a spool: spill on failure / backlog / flush / shutdown, order, exactly-once, cap,
recovery at the next start, the metrics and the log lines.  Real threads, real files; no timing asserts."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest

import otel_rl
from otel_rl._delivery import DeliveryQueue
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import RunIdentity, RunStart, StepMetrics
from otel_rl.spool import SpoolOptions, options_for
from otel_rl.testing import CaptureExporter
from .spool_helpers import wait_for


class Switch(otel_rl.Exporter):
    """A tracker stand-in: down (ConnectionError), up, blocked (a call that does not return yet),
    or rejecting some steps with a data error."""

    spool = True
    wants_trajectories = True

    def __init__(self, name: str = "switch", up: bool = False):
        self.name = name
        self.up = threading.Event()
        if up:
            self.up.set()
        self.gate = threading.Event()
        self.gate.set()
        self.reject_steps: set[int] = set()
        self.got: list = []
        self.batches: list = []
        self.calls = 0

    def export_records(self, records):
        self.calls += 1
        self.gate.wait()
        if not self.up.is_set():
            raise ConnectionError("tracker down")
        if any(getattr(r, "step", None) in self.reject_steps for r in records):
            raise ValueError("tracker rejects this step")
        self.batches.append(records)
        self.got.extend(records)

    def steps(self) -> list[int]:
        return [r.step for r in self.got if isinstance(r, StepMetrics)]


@pytest.fixture(autouse=True)
def _no_leftover_handle():
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown(2)


def _init(exporters, spool_dir, **kw):
    return otel_rl.init(exporters=exporters, batch_delay_s=0.02, spool_dir=str(spool_dir), project="spool-q", **kw)


def test_tracker_down_spills_then_delivers_everything_once_in_order(tmp_path):
    sw = Switch()
    h = _init([sw], tmp_path)
    for n in range(30):
        assert h.log({"n": n, "loss": 1 / (n + 1)}, step=n) is None  # never waits, never raises
    assert h.flush(0.3) is False  # not delivered ...
    s = h.stats()["exporters"]["switch"]
    assert s["in_memory"] == 0 and s["spool_pending"] == s["queued"] == 31  # ... but all acknowledged on disk
    assert s["spooled"] == 31 and s["exported"] == 0 and s["failed_attempts"] >= 1 and s["dropped"] == 0
    assert list((tmp_path / "switch").glob("*.seg"))
    sw.up.set()
    assert h.flush(30)
    s = h.stats()["exporters"]["switch"]
    assert sw.steps() == list(range(30))
    assert sum(isinstance(r, RunStart) for r in sw.got) == 1
    assert s["exported"] == s["replayed"] == 31 and s["queued"] == 0 and s["dropped"] == 0
    h.shutdown()
    assert not (tmp_path / "switch").exists()  # delivered: nothing left behind


def test_next_start_with_the_same_spool_dir_delivers_the_rest_first(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    sw = Switch()
    h = _init([sw], tmp_path, run_id="first")
    for n in range(10):
        h.log({"n": n}, step=n)
    h.shutdown(0.5)
    s = h.stats()["exporters"]["switch"]
    assert s["spool_pending"] == 11 and s["dropped"] == 0  # kept, not dropped
    assert any("kept in spool" in r.getMessage() and "otel-rl replay" in r.getMessage() for r in caplog.records)
    sw2 = Switch(up=True)
    h2 = _init([sw2], tmp_path, run_id="second")
    h2.log({"n": 100}, step=100)
    assert h2.flush(30)
    h2.shutdown()
    assert sw2.steps() == list(range(10)) + [100]  # the earlier process's data first
    assert [r.run.run_id for r in sw2.got if isinstance(r, RunStart)] == ["first", "second"]
    assert any("left in spool" in r.getMessage() and "earlier process" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "switch").exists()


def test_default_spool_dir_is_per_run_and_cleaned_up(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sw = Switch()
    h = otel_rl.init(exporters=[sw], batch_delay_s=0.02, run_id="run-42")
    q = h._pipeline.queues[0]
    assert q.spool.options.path == str(tmp_path / "cache" / "otel-rl" / "spool" / "run-42" / "switch")
    assert not (tmp_path / "cache").exists()  # created only when needed
    h.log({"x": 1.0}, step=1)
    h.flush(0.2)
    assert wait_for((tmp_path / "cache" / "otel-rl" / "spool" / "run-42" / "switch").is_dir, 30)
    sw.up.set()
    assert h.flush(30)
    h.shutdown()
    assert sw.steps() == [1]
    assert not (tmp_path / "cache" / "otel-rl" / "spool" / "run-42").exists()


def test_which_exporters_get_a_spool(tmp_path, capsys):
    class Tracker(TrackerExporter):
        tracker_name = "t"

        def open_run(self, run, start):
            return run

    def spooled(**kw):
        cap = CaptureExporter()
        tr = Tracker(otel_rl.config.resolve(env={}))
        tr.name = "t"
        h = _init([cap, tr, Switch(up=True)], tmp_path, **kw)
        out = {q.name: q.spool is not None for q in h._pipeline.queues}
        h.shutdown(5)
        return out

    assert spooled() == {"CaptureExporter": False, "t": True, "switch": True}
    assert spooled(spool_exporters="all") == {"CaptureExporter": True, "t": True, "switch": True}
    assert spooled(spool_exporters="none") == {"CaptureExporter": False, "t": False, "switch": False}
    assert spooled(spool_exporters="CaptureExporter") == {"CaptureExporter": True, "t": False, "switch": False}
    h = otel_rl.init(exporters=[Switch(up=True)], spool_dir="off")
    assert h._pipeline.queues[0].spool is None
    h.shutdown(5)
    opts = options_for(otel_rl.config.resolve(env={}, run_id="r", rank=3, spool_dir=str(tmp_path)), Switch("a/b"))
    assert opts.path == str(tmp_path / "a_b-rank3")


def test_backlog_spills_to_disk_instead_of_dropping(tmp_path):
    """A slow tracker (a call that does not return yet): memory holds `max_items`, the rest goes to disk."""
    sw = Switch(up=True)
    sw.gate.clear()
    q = DeliveryQueue(sw, 10, spool=SpoolOptions(path=str(tmp_path / "q")))
    ident = RunIdentity("p", "e", "r")
    for n in range(100):
        q.put([], [StepMetrics(ident, n, {"n": n}, n)])
    assert wait_for(lambda: q.stats.spooled > 0)
    assert q.stats.in_memory <= 11 and q.stats.dropped == 0 and q.stats.queued == 100
    sw.gate.set()
    assert q.wait_idle(30)
    q.stop(5)
    assert sw.steps() == list(range(100))
    assert q.stats.exported == 100 and q.stats.dropped == 0 and q.stats.replayed == q.stats.spooled


def test_poison_batch_in_the_spool_is_dropped_and_delivery_moves_on(tmp_path):
    sw = Switch()
    q = DeliveryQueue(sw, 1000, backoff_max_s=0.2, spool=SpoolOptions(path=str(tmp_path / "q")))
    ident = RunIdentity("p", "e", "r")
    for n in range(5):
        q.put([], [StepMetrics(ident, n, {"n": n}, n)])
    assert not q.wait_idle(0.3)  # down: all on disk now
    assert q.stats.spool_pending == 5
    sw.reject_steps = {2}
    sw.up.set()
    assert q.wait_idle(30)
    q.stop(5)
    assert sw.steps() == [0, 1, 3, 4]
    assert q.stats.dropped == 1 and q.stats.spool_pending == 0 and q.stats.exported == 4
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_spool_cap_drops_by_policy_counted_in_metrics_and_logged(tmp_path, caplog, policy):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    cap = CaptureExporter()  # its metric reader sees otel-rl's own instruments
    sw = Switch()
    limit = 256 << 10
    h = _init([cap, sw], tmp_path, spool_max_bytes=limit, spool_drop_policy=policy)
    rnd = random.Random(7)
    n_steps = 1000
    for n in range(n_steps):  # random values: ~0.5 KB per step even compressed
        h.log({f"actor/key_{i:03d}": rnd.random() for i in range(60)}, step=n)
        if n % 100 == 99:
            h.flush(0.05)
    h.flush(0.3)

    def accounted() -> bool:  # every item spooled or dropped (a slow machine takes longer than the flush)
        st = h.stats()["exporters"]["switch"]
        return st["dropped"] + st["spool_pending"] == n_steps + 1 and st["in_memory"] == 0

    wait_for(accounted, 60)
    s = h.stats()["exporters"]["switch"]
    assert 0 < s["spool_bytes"] <= limit
    assert s["dropped"] > 0
    assert s["dropped"] + s["spool_pending"] == n_steps + 1 and s["in_memory"] == 0
    assert any("spool of exporter 'switch' is full" in r.getMessage() and policy in r.getMessage()
               for r in caplog.records)
    points = {(p.attributes["exporter"], p.attributes["outcome"]): p.value
              for p in cap.metric_points("otel_rl.exporter.items")}
    assert points[("switch", "dropped")] == s["dropped"]
    assert points[("switch", "spooled")] == s["spooled"]
    (gauge,) = [p for p in cap.metric_points("otel_rl.exporter.spool.bytes") if p.attributes["exporter"] == "switch"]
    assert gauge.value == s["spool_bytes"]
    sw.up.set()
    assert h.flush(60)
    steps = sw.steps()
    h.shutdown(5)
    assert len(steps) + 1 == s["spool_pending"]  # + the run start, in the oldest batch
    assert steps == sorted(set(steps))  # in order, no duplicates
    if policy == "drop_oldest":
        # the newest are kept, and the batch that was in flight when its segment was dropped
        gaps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
        assert len(gaps) == 1 and steps[-1] == n_steps - 1
    else:
        assert steps == list(range(len(steps)))  # the oldest are kept


def test_write_through_queue_is_durable_when_put_returns(tmp_path):
    """The bridge's mode: put() returns once the batch is on disk; delivery reuses the objects."""
    sw = Switch(up=True)
    sw.gate.clear()
    q = DeliveryQueue(sw, 1000, spool=SpoolOptions(path=str(tmp_path / "q"), write_through=True, fsync="always"))
    ident = RunIdentity("p", "e", "r")
    batches = [[StepMetrics(ident, n, {"n": n}, n)] for n in range(20)]
    for b in batches:
        assert q.put([], b) is True
        assert q.stats.in_memory <= 1  # at most the one the exporter holds right now
    assert q.stats.spooled >= 19
    sw.gate.set()
    assert q.wait_idle(30)
    q.stop(5)
    assert sw.steps() == list(range(20))
    assert all(got is sent for got, sent in zip(sw.batches[1:], batches[1:]))  # from memory, not decoded again
    assert q.stats.exported == 20


def test_stuck_exporter_at_shutdown_leaves_everything_in_the_spool(tmp_path, caplog):
    """log() keeps working while the tracker hangs; shutdown is bounded and spools what is left."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    sw = Switch(up=True)
    sw.gate.clear()  # every call hangs
    h = _init([sw], tmp_path)
    for n in range(1000):
        h.log({"n": n}, step=n)
    h.shutdown(1.0)
    s = h.stats()["exporters"]["switch"]
    assert s["exported"] == 0 and s["dropped"] == 0
    assert s["in_memory"] == 0 and s["spool_pending"] == s["queued"] == 1001
    assert any("kept in spool" in r.getMessage() for r in caplog.records)
    stuck = [t for t in threading.enumerate() if t.name == "otel-rl-export-switch"]
    assert len(stuck) == 1
    sw.gate.set()  # let the abandoned delivery thread go (it then delivers one batch, acked)
    for t in stuck:  # ... and closes the spool: while it holds it, a new handle spools beside it instead
        t.join(30)
        assert not t.is_alive()
    sw2 = Switch(up=True)
    h2 = _init([sw2], tmp_path)
    assert h2.flush(30)
    h2.shutdown()
    assert sorted(set(sw.steps() + sw2.steps())) == list(range(1000))
    assert len(sw.steps()) + len(sw2.steps()) == 1000  # exactly once across both
    assert sw2.steps() == sorted(sw2.steps())


def test_memory_only_queue_sheds_spans_but_keeps_every_record_when_no_spool(tmp_path):
    """Over its bound a queue without a spool drops the spans of its oldest batches (counted as shed);
    its records are all kept and delivered once the tracker is up."""
    sw = Switch()  # down
    sw.wants_spans = True
    sw.export_spans = lambda spans: None
    q = DeliveryQueue(sw, 10)
    ident = RunIdentity("p", "e", "r")
    for n in range(30):
        q.put([f"span-{n}"], [StepMetrics(ident, n, {"n": n}, n)])
    assert q.spool is None and q.stats.spooled == 0
    assert q.stats.shed == q.stats.dropped >= 19  # spans only
    sw.up.set()
    assert q.wait_idle(30)
    q.request_stop()
    q.join(5)
    assert sw.steps() == list(range(30))
    assert not os.listdir(tmp_path)


def test_unusable_spool_dir_falls_back_to_memory(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sw = Switch()
    q = DeliveryQueue(sw, 1000, spool=SpoolOptions(path=str(blocker / "q")))
    q.put([], [StepMetrics(RunIdentity("p", "e", "r"), 1, {"n": 1}, 1)])
    assert not q.wait_idle(0.3)
    assert q.stats.in_memory == 1 and q.stats.dropped == 0
    deadline = time.monotonic() + 30  # the queue's thread tries the directory when it gets to run
    while not any("cannot use the spool directory" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no warning about the spool directory"
        time.sleep(0.05)
    assert q.stats.in_memory == 1 and q.stats.dropped == 0
    sw.up.set()
    assert q.wait_idle(30)
    q.stop(5)
    assert sw.steps() == [1]
    assert Path(blocker).read_text() == "not a directory"


def test_wait_idle_right_after_start_waits_for_what_an_earlier_run_left(tmp_path):
    """A queue over a spool directory it has not opened yet is not idle until its thread recovered it."""
    from otel_rl.spool import Spool
    from otel_rl.spool.codec import encode_batch

    ident = RunIdentity("p", "e", "r")
    sp = Spool(SpoolOptions(path=str(tmp_path / "q")))
    sp.open()
    for n in range(50):
        sp.append(encode_batch([], [StepMetrics(ident, n, {"n": n}, n)]), 1)
    sp.close()
    sw = Switch(up=True)
    q = DeliveryQueue(sw, 1000, spool=SpoolOptions(path=str(tmp_path / "q")))
    assert q.wait_idle(30)  # immediately: must not return before the spool was even opened
    assert sw.steps() == list(range(50))
    q.stop(5)
    assert not (tmp_path / "q").exists()


class GatheringSwitch(Switch):
    gathers = True  # as the trackers: batches queued within export_interval_s go out as one delivery


def _down_backlog(q: DeliveryQueue, n: int) -> None:
    """`n` batches of one step each, put while the exporter is down: each is spilled as its own frame."""
    ident = RunIdentity("p", "e", "r")
    for s in range(n):
        q.put([], [StepMetrics(ident, s, {"n": s}, s)])
        if s == 0:
            wait_for(lambda: q.stats.failed_attempts >= 1)  # the first failure: from now on put() spills
    assert wait_for(lambda: q.stats.spool_pending == n)


def test_a_gathering_queue_delivers_its_spooled_backlog_gathered_once_in_order(tmp_path, monkeypatch):
    """A backlog written batch by batch while the tracker was down goes out as few deliveries as the same
    batches from memory: frames read back together, each delivery within the gathering bounds."""
    import otel_rl._delivery_thread as dt

    monkeypatch.setattr(dt, "_GATHER_MAX_ITEMS", 70)
    sw = GatheringSwitch()
    q = DeliveryQueue(sw, 1000, backoff_max_s=0.2, spool=SpoolOptions(path=str(tmp_path / "q")), gather_s=0.05)
    _down_backlog(q, 300)
    assert q.spool.pending_frames == 300  # one frame per batch
    sw.up.set()
    assert q.wait_idle(30)
    q.stop(5)
    assert sw.steps() == list(range(300))  # each once, in order
    # the batch in flight when the tracker failed stays alone (its frame was written as the one in flight);
    # the frames after it are read back together, up to the bound
    assert [len(b) for b in sw.batches] == [1, 70, 70, 70, 70, 19]
    assert q.stats.exported == q.stats.replayed == 300 and q.stats.dropped == 0 and q.stats.spool_pending == 0
    assert not (tmp_path / "q").exists()


def test_a_queue_that_does_not_gather_delivers_its_spool_frame_by_frame(tmp_path):
    sw = Switch()
    q = DeliveryQueue(sw, 1000, backoff_max_s=0.2, spool=SpoolOptions(path=str(tmp_path / "q")))
    _down_backlog(q, 30)
    sw.up.set()
    assert q.wait_idle(30)
    q.stop(5)
    assert [len(b) for b in sw.batches] == [1] * 30


def test_a_gathered_spool_delivery_cut_short_is_delivered_again_whole_by_the_next_process(tmp_path):
    """The process stops while frames read back together are being delivered: none is acknowledged, the
    next process with the same spool delivers them (and the rest) in order, nothing lost."""
    sw = GatheringSwitch()
    opts = SpoolOptions(path=str(tmp_path / "q"))
    q = DeliveryQueue(sw, 1000, backoff_max_s=0.2, spool=opts, gather_s=0.05)
    _down_backlog(q, 50)
    sw.gate.clear()  # the next call hangs
    sw.up.set()
    assert wait_for(lambda: sw.calls >= 2)  # the gathered delivery is in the exporter's hands
    q.request_stop()
    q.join(0.5)
    assert q.stats.spool_pending == 50
    q._disk.close()  # the process ends: its spool as it is on disk
    sw2 = GatheringSwitch(up=True)
    q2 = DeliveryQueue(sw2, 1000, spool=SpoolOptions(path=str(tmp_path / "q")), gather_s=0.05)
    assert q2.wait_idle(30)
    q2.stop(5)
    assert sw2.steps() == list(range(50))
    assert len(sw2.batches) == 1
    sw.gate.set()


def test_an_undecodable_frame_in_a_gathered_backlog_is_skipped_alone(tmp_path, caplog):
    """A frame that passes its checksum but cannot be decoded is counted and skipped; the frames around it
    are delivered in the same delivery."""
    from otel_rl.spool import Spool
    from otel_rl.spool.codec import encode_batch

    caplog.set_level(logging.WARNING, logger="otel_rl")
    ident = RunIdentity("p", "e", "r")
    sp = Spool(SpoolOptions(path=str(tmp_path / "q"), meta={"exporter": "switch"}))
    assert sp.open()
    for s in range(10):
        sp.append(encode_batch([], [StepMetrics(ident, s, {"n": s}, s)]), 1)
        if s == 4:
            sp.append(b"\x01\x00\x03not a batch", 3)  # version 1, 3 items, then garbage
    sp.close(remove_if_empty=False)
    sw = GatheringSwitch(up=True)
    q = DeliveryQueue(sw, 1000, spool=SpoolOptions(path=str(tmp_path / "q")), gather_s=0.05)
    assert q.wait_idle(30)
    q.stop(5)
    assert sw.steps() == list(range(10)) and len(sw.batches) == 1
    assert q.stats.dropped == 3 and q.stats.exported == 10 and q.stats.spool_pending == 0
    assert sum("cannot be read" in r.getMessage() for r in caplog.records) == 1


def test_replay_delivers_a_spooled_backlog_gathered_for_an_exporter_that_gathers(tmp_path, monkeypatch):
    """`otel-rl replay` hands a gathering exporter the spool's frames read back together, as a trainer's
    queue does: one batch per frame on disk, a few calls to the tracker."""
    import json

    from otel_rl.config import resolve
    from otel_rl.spool.replay import replay_one

    from .spool_helpers import GatheringAppendLog

    sink = tmp_path / "sink.jsonl"
    monkeypatch.setenv("SPOOL_TEST_SINK", str(sink))
    sink.with_name("sink.jsonl.down").touch()  # down: every batch is spilled as its own frame
    config = resolve(project="p", run_id="r", spool_dir=str(tmp_path / "spool"), export_interval_s=0.05)
    ex = GatheringAppendLog(config)
    q = DeliveryQueue(ex, 1000, backoff_max_s=0.2, config=config)
    _down_backlog(q, 120)
    q.request_stop()
    q.join(5)
    path = q.spool.path
    assert q.spool.pending_frames == 120
    sink.with_name("sink.jsonl.down").unlink()
    res = replay_one(path)
    assert res is not None and res.status == "delivered" and res.delivered == 120, res
    lines = [json.loads(x) for x in sink.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(120))
    assert len({x["call"] for x in lines}) <= 2  # (the batch in flight at the failure may go alone)
