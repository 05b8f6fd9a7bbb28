"""One bad record in a batch its exporter keeps rejecting: the delivery queue hands the batch over in parts
until the bad record is alone, drops only it (counted, logged once naming it), and delivers every other
record once -- a gathered batch from memory, a batch spilled to the spool in an outage and read back, a
spool delivered by `otel-rl replay`.  A crash in the middle of the parts leaves the batch's frame in the
spool: it is delivered again, whole.

The exporter is a real file sink (O_APPEND: a record delivered twice shows up twice) that refuses one
record with a data error and, unlike a tracker exporter, does not find it itself; the spools are real
directories, the replay a real `otel-rl replay` process.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from otel_rl._delivery import DeliveryQueue
from otel_rl.records import RunIdentity, RunStart, StepMetrics
from otel_rl.spool import SpoolOptions, exporter_meta

from .spool_helpers import BAD_SPAN, RejectingAppendLog, clean_env, read_sink, run_replay, spool_contents

RUN = RunIdentity("parts", "e", "run-parts")
BAD = 17
GOOD = [s for s in range(50) if s != BAD]


@pytest.fixture
def sink(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "sink.jsonl"
    monkeypatch.setenv("SPOOL_TEST_SINK", str(path))
    monkeypatch.setenv("SPOOL_TEST_BAD_STEP", str(BAD))
    return path


def _batches() -> list[list]:
    """A run start, then steps 0..49 in batches of 5 (step 17 is in the fourth, with 15, 16, 18, 19)."""
    t = time.time_ns()
    steps = [StepMetrics(RUN, s, {"loss": s / 4}, t + s) for s in range(50)]
    return [[RunStart(RUN, {"lr": 0.1}, 0, t)]] + [steps[i : i + 5] for i in range(0, 50, 5)]


def _steps(sink: Path) -> list[int]:
    return [e["step"] for e in read_sink(sink) if e.get("kind") == "StepMetrics"]


def _rejections(text: str) -> list[str]:
    return [line for line in text.splitlines() if "rejected" in line and "as bad data" in line and "dropped it" in line]


def test_a_gathered_batch_from_memory_loses_only_its_bad_record_and_span(sink, caplog):
    exp = RejectingAppendLog()
    q = DeliveryQueue(exp, 10_000, backoff_max_s=0.2, gather_s=60.0)
    spans = [ReadableSpan(name) for name in ("rollout", BAD_SPAN, "reward")]
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            for b in _batches():
                assert q.put([], b)
            assert q.put(spans, [])
            assert q.wait_idle(60)  # a flush: everything queued goes in one gathered delivery
        stats = q.stats.as_dict()
    finally:
        q.stop(5)
    assert _steps(sink) == GOOD  # every good record once, in order
    assert [e.get("kind") for e in read_sink(sink)].count("RunStart") == 1
    assert [e["span"] for e in read_sink(sink) if "span" in e] == ["rollout", "reward"]
    assert stats["rejected"] == 2 and stats["dropped"] == 2 and stats["exported"] == 51 + 3 - 2
    lines = _rejections(caplog.text)
    assert len(lines) == 2, lines
    assert sum(f"the metrics 'loss' at step {BAD} of run 'run-parts'" in x for x in lines) == 1
    assert sum(f"span '{BAD_SPAN}'" in x for x in lines) == 1
    assert all("'rejecting'" in x for x in lines)


def test_a_batch_spilled_in_an_outage_loses_only_its_bad_record_when_read_back(sink, tmp_path, caplog):
    down = Path(f"{sink}.down")
    down.touch()
    spool = tmp_path / "spool" / "rejecting"
    exp = RejectingAppendLog()
    q = DeliveryQueue(exp, 10_000, backoff_max_s=0.2, gather_s=0.5, spool=SpoolOptions(path=str(spool)))
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            for b in _batches():
                assert q.put([], b)
            assert not q.wait_idle(1.0)  # the sink is down: everything is on disk now
            assert q.stats.spool_pending == 51 and q.stats.in_memory == 0
            down.unlink()
            assert q.wait_idle(60)
        stats = q.stats.as_dict()
    finally:
        q.stop(5)
    assert _steps(sink) == GOOD
    assert stats["rejected"] == 1 and stats["dropped"] == 1
    assert stats["exported"] == stats["replayed"] == 50 and stats["spool_pending"] == 0
    (line,) = _rejections(caplog.text)
    assert f"the metrics 'loss' at step {BAD}" in line
    assert not spool.exists()  # every frame acknowledged


def _leave_spool(tmp_path: Path, sink: Path) -> Path:
    """What a trainer leaves when its exporter is down to the end: a spool of 11 frames (one per batch)."""
    down = Path(f"{sink}.down")
    down.touch()
    spool = tmp_path / "spools" / "rejecting"
    exp = RejectingAppendLog()
    opts = SpoolOptions(path=str(spool), meta=exporter_meta(None, exp))
    q = DeliveryQueue(exp, 10_000, backoff_max_s=0.2, spool=opts)
    for b in _batches():
        q.put([], b)
    assert not q.wait_idle(1.0)
    q.request_stop()  # still down: the thread gives up, what is left stays in the spool
    q.join(30)
    down.unlink()
    assert len(spool_contents(spool)) == 51 and not _steps(sink)
    return spool


def test_replay_loses_only_the_bad_record_of_a_spool(sink, tmp_path):
    spool = _leave_spool(tmp_path, sink)
    env = clean_env(SPOOL_TEST_SINK=str(sink), SPOOL_TEST_BAD_STEP=str(BAD))
    code, out = run_replay([str(spool.parent)], env, tmp_path, timeout_s=120)
    assert code == 0, out
    assert _steps(sink) == GOOD
    assert "delivered 50 of 51 items" in out and "1 dropped" in out and "1 rejected as bad data" in out, out
    (line,) = _rejections(out)
    assert f"the metrics 'loss' at step {BAD}" in line and "'rejecting'" in line
    assert not spool.exists()


def test_a_crash_in_the_middle_of_the_parts_delivers_the_frames_again(sink, tmp_path):
    """Frames read back together (the exporter gathers) are acknowledged only once all the parts of their
    delivery are resolved: a replay that dies after the first part went through leaves every one of them
    in the spool, and the next replay delivers them again, whole (that first part twice: at least once)."""
    spool = _leave_spool(tmp_path, sink)
    env = clean_env(SPOOL_TEST_SINK=str(sink), SPOOL_TEST_BAD_STEP=str(BAD), SPOOL_TEST_CRASH_MID_SPLIT="1")
    code, out = run_replay([str(spool.parent)], env, tmp_path, timeout_s=120)
    assert code == 9, out
    first = _steps(sink)
    assert first and first == list(range(len(first))) and BAD not in first  # a first part went through
    left = [r.step for r in spool_contents(spool) if isinstance(r, StepMetrics)]
    assert left == list(range(50))  # nothing acknowledged: the frames are all still there, whole
    del env["SPOOL_TEST_CRASH_MID_SPLIT"]
    code, out = run_replay([str(spool.parent)], env, tmp_path, timeout_s=120)
    assert code == 0, out
    assert Counter(_steps(sink)) == Counter(GOOD + first)
    assert not spool.exists()
