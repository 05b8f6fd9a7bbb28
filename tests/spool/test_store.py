"""The spool store on a real file system: segments, ack, recovery, corruption, size cap, fsync policy."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import pytest

from otel_rl.records import RunIdentity, StepMetrics
from otel_rl.spool import files
from otel_rl.spool import store as store_mod
from otel_rl.spool.codec import decode_batch, encode_batch
from otel_rl.spool.files import FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES
from otel_rl.spool.store import Spool, SpoolBusy, SpoolOptions

IDENT = RunIdentity("p", "e", "r")


def batch(step: int, keys: int = 3) -> bytes:
    return encode_batch([], [StepMetrics(IDENT, step, {f"k{i}": step + i / 10 for i in range(keys)}, step)],
                        compress=False)


def steps_of(payload: bytes) -> list[int]:
    return [r.step for r in decode_batch(payload)[1]]


def open_spool(path: Path, **kw) -> Spool:
    sp = Spool(SpoolOptions(path=str(path), **kw))
    assert sp.open()
    return sp


def drain(sp: Spool, limit: int = 10_000) -> list[int]:
    out = []
    while limit:
        f = sp.peek()
        if f is None:
            break
        out += steps_of(f.payload)
        sp.advance(f)
        limit -= 1
    return out


def segments(path: Path) -> list[Path]:
    return sorted(path.glob("*.seg"))


def test_append_deliver_and_clean_up(tmp_path):
    d = tmp_path / "exp"
    sp = open_spool(d, meta={"exporter": "x"})
    for s in range(5):
        frame, dropped = sp.append(batch(s), 1)
        assert frame is not None and dropped == 0
    assert (sp.pending_frames, sp.pending_items) == (5, 5)
    assert sorted(p.name for p in d.iterdir()) == ["0000000000000001.seg", "ack", "lock", "meta.json"]
    assert drain(sp) == [0, 1, 2, 3, 4]
    assert sp.pending_frames == 0 and sp.peek() is None
    assert sp.close() is True
    assert not d.exists()


def test_reopen_resumes_after_the_last_ack(tmp_path):
    d = tmp_path / "exp"
    sp = open_spool(d)
    for s in range(6):
        sp.append(batch(s), 1)
    f = sp.peek()
    sp.advance(f)
    f = sp.peek()
    sp.advance(f)  # steps 0 and 1 delivered
    assert sp.close() is False  # not empty: kept
    sp2 = open_spool(d)
    assert (sp2.pending_frames, sp2.pending_items, sp2.recovered_items) == (4, 4, 4)
    sp2.append(batch(100), 1)  # a new process appends to a new segment, after the old frames
    assert len(segments(d)) == 2
    assert drain(sp2) == [2, 3, 4, 5, 100]
    sp2.close()
    assert not d.exists()


def test_segments_roll_and_delivered_ones_are_deleted(tmp_path):
    d = tmp_path / "exp"
    sp = open_spool(d, segment_bytes=4096, max_bytes=1 << 20)
    for s in range(200):
        sp.append(batch(s), 1)
    n_segs = len(segments(d))
    assert n_segs > 3
    assert sp.bytes == sum(p.stat().st_size for p in segments(d))
    got = []
    for _ in range(100):
        f = sp.peek()
        got += steps_of(f.payload)
        sp.advance(f)
    assert len(segments(d)) < n_segs  # fully delivered segments are gone
    sp.close()
    sp = open_spool(d, segment_bytes=4096, max_bytes=1 << 20)
    assert drain(sp) == list(range(100, 200))
    sp.close()


def test_truncated_tail_is_detected_counted_and_cut(tmp_path, caplog):
    d = tmp_path / "exp"
    sp = open_spool(d)
    for s in range(5):
        sp.append(batch(s), 1)
    sp.close()
    (seg,) = segments(d)
    size = seg.stat().st_size
    with open(seg, "r+b") as f:  # a crash in the middle of writing the last frame
        f.truncate(size - 7)
    caplog.set_level(logging.WARNING, logger="otel_rl")
    sp = open_spool(d)
    assert (sp.pending_frames, sp.corrupt_frames) == (4, 1)
    assert sp.corrupt_bytes == (size - 7) - (size - len(batch(4)) - FRAME_HEADER_BYTES)
    assert any("truncated tail" in r.getMessage() for r in caplog.records)
    assert seg.stat().st_size == size - len(batch(4)) - FRAME_HEADER_BYTES  # the torn frame is cut off
    assert drain(sp) == [0, 1, 2, 3]
    sp.close()


@pytest.mark.parametrize("where", ["payload", "length", "magic"])
def test_bad_frame_is_skipped_and_counted(tmp_path, caplog, where):
    d = tmp_path / "exp"
    sp = open_spool(d)
    offsets = []
    for s in range(5):
        f, _ = sp.append(batch(s), 1)
        offsets.append(f.offset)
    sp.close()
    (seg,) = segments(d)
    data = bytearray(seg.read_bytes())
    pos = offsets[2] + {"payload": FRAME_HEADER_BYTES + 5, "length": 4, "magic": 0}[where]
    data[pos] ^= 0x5A  # one flipped byte in frame 2
    seg.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="otel_rl")
    sp = open_spool(d)
    assert sp.corrupt_frames == 1 and sp.corrupt_bytes == offsets[3] - offsets[2]
    assert sp.pending_frames == 4
    assert any("bad frame" in r.getMessage() for r in caplog.records)
    assert drain(sp) == [0, 1, 3, 4]
    sp.close()


def test_garbage_between_frames_and_bad_segment_header(tmp_path):
    d = tmp_path / "exp"
    sp = open_spool(d, segment_bytes=64 << 10)
    sp.append(batch(0), 1)
    sp.append(batch(1), 1)
    sp.close()
    (seg,) = segments(d)
    data = seg.read_bytes()
    cut = SEGMENT_HEADER_BYTES + FRAME_HEADER_BYTES + len(batch(0))
    seg.write_bytes(data[:cut] + b"\xf5RLF garbage \x00\x01" * 3 + data[cut:])  # fake magics inside
    bad = d / "0000000000000009.seg"
    bad.write_bytes(b"not a segment at all")
    sp = open_spool(d)
    assert sp.corrupt_frames == 2  # the garbage region and the file without a header
    assert not bad.exists()
    assert drain(sp) == [0, 1]
    sp.close()


def test_frame_changed_on_disk_after_recovery_is_skipped(tmp_path):
    d = tmp_path / "exp"
    sp = open_spool(d)
    frames = [sp.append(batch(s), 1)[0] for s in range(3)]
    (seg,) = segments(d)
    with open(seg, "r+b") as f:  # bit rot under a running spool
        f.seek(frames[1].offset + FRAME_HEADER_BYTES + 3)
        f.write(b"\x00\x00")
    assert drain(sp) == [0, 2]
    assert sp.corrupt_frames == 1
    sp.close()


def test_torn_ack_falls_back_to_the_previous_slot(tmp_path):
    d = tmp_path / "exp"
    sp = open_spool(d)
    for s in range(4):
        sp.append(batch(s), 1)
    for _ in range(2):
        sp.advance(sp.peek())
    counter = sp._ack_counter
    sp.close()
    ack = d / "ack"
    data = bytearray(ack.read_bytes())
    slot = (counter % 2) * files.ACK_SLOT_BYTES  # the newest slot
    data[slot + 10] ^= 0xFF
    ack.write_bytes(bytes(data))
    sp = open_spool(d)
    assert drain(sp) == [1, 2, 3]  # one step back, never lost and never further
    sp.close()


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_size_cap_and_drop_policy(tmp_path, policy):
    d = tmp_path / "exp"
    frame = FRAME_HEADER_BYTES + len(batch(0))
    cap = 64 << 10
    sp = open_spool(d, max_bytes=cap, segment_bytes=8 << 10, drop_policy=policy)
    dropped = 0
    written = []
    for s in range(2000):
        f, lost = sp.append(batch(s), 1)
        dropped += lost
        if f is not None:
            written.append(s)
        assert sp.bytes <= cap
        assert sum(p.stat().st_size for p in segments(d)) <= cap
    assert dropped == sp.dropped_items > 0
    assert sp.pending_items + dropped == 2000
    got = drain(sp)
    assert len(got) == sp.recovered_items + len(got) and len(got) + dropped == 2000
    if policy == "drop_oldest":
        assert got == list(range(2000 - len(got), 2000))  # the newest are kept
    else:
        assert got == list(range(len(got)))  # the oldest are kept
        assert written == got
    assert len(got) > (cap - 8 * SEGMENT_HEADER_BYTES) // frame * 0.7
    sp.close()


def test_frame_bigger_than_the_cap_is_dropped(tmp_path):
    sp = open_spool(tmp_path / "exp", max_bytes=4096, segment_bytes=4096)
    f, lost = sp.append(batch(1, keys=2000), 1)
    assert f is None and lost == 1 and sp.dropped_items == 1
    f, lost = sp.append(batch(2), 1)
    assert f is not None and lost == 0
    assert drain(sp) == [2]
    sp.close()


def test_drop_oldest_keeps_the_frame_in_flight(tmp_path):
    """The cap drops the segment of the frame being delivered: that frame is not counted as lost."""
    sp = open_spool(tmp_path / "exp", max_bytes=16 << 10, segment_bytes=4096)
    for s in range(5):
        sp.append(batch(s, keys=20), 1)
    inflight = sp.peek()
    assert steps_of(inflight.payload) == [0]
    for s in range(5, 200):
        sp.append(batch(s, keys=20), 1)
    assert sp.dropped_items > 0
    sp.advance(inflight)  # delivered after all
    rest = drain(sp)
    assert rest[0] > 1 and rest[-1] == 199
    assert sp.dropped_items + len(rest) + 1 == 200
    assert sp.pending_items == 0
    sp.close()


def test_frames_read_ahead_across_segments_are_acknowledged_in_order(tmp_path):
    """peek + peek_next: the oldest frames in order, across segments, within the limits given; nothing
    moves until `advance()`; a reopened spool starts after what was advanced."""
    d = tmp_path / "exp"
    sp = open_spool(d, segment_bytes=1024)
    for s in range(40):
        sp.append(batch(s, keys=10), 1)
    assert len(segments(d)) > 3
    first = sp.peek()
    frames = [first]
    while (nxt := sp.peek_next(frames[-1], 100, 1 << 20)) is not None:
        frames.append(nxt)
    assert [steps_of(f.payload)[0] for f in frames] == list(range(40))
    assert sp.peek_next(frames[-1], 100, 1 << 20) is None  # the end
    assert sp.pending_frames == 40
    for f in frames[:25]:
        sp.advance(f)
    assert (sp.pending_frames, sp.pending_items) == (15, 15)
    sp.close()
    sp = open_spool(d, segment_bytes=1024)
    assert drain(sp) == list(range(25, 40))
    sp.close()


def test_read_ahead_stops_at_the_limits_and_at_a_bad_frame(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    d = tmp_path / "exp"
    sp = open_spool(d)
    sp.append(batch(0), 1)
    sp.append(batch(1), 3)
    big = sp.append(batch(2, keys=200), 1)[0]
    sp.append(batch(3), 1)
    first = sp.peek()
    assert sp.peek_next(first, 2, 1 << 20) is None  # 3 items do not fit in 2
    second = sp.peek_next(first, 3, 1 << 20)
    assert steps_of(second.payload) == [1]
    assert sp.peek_next(second, 10, 500) is None  # too many bytes
    sp.advance(first)
    sp.advance(second)
    # a frame that fails its check ends the read-ahead, uncounted; peek skips it (counted) once it is the oldest
    with open(d / "0000000000000001.seg", "r+b") as f:
        f.seek(big.offset + FRAME_HEADER_BYTES + 5)
        f.write(b"\xff\xff")
    third = sp.peek_next(second, 10, 1 << 20)
    assert third is None and sp.corrupt_frames == 0
    head = sp.peek()
    assert steps_of(head.payload) == [3] and sp.corrupt_frames == 1
    sp.advance(head)
    assert sp.pending_frames == 0
    sp.close()


def test_drop_oldest_keeps_every_frame_read_ahead(tmp_path):
    """The cap drops the segments of frames being delivered together: none of them counts as lost, and
    advancing them afterwards is exact."""
    sp = open_spool(tmp_path / "exp", max_bytes=16 << 10, segment_bytes=2048)
    for s in range(12):
        sp.append(batch(s, keys=20), 1)
    frames = [sp.peek()]
    for _ in range(5):
        frames.append(sp.peek_next(frames[-1], 100, 1 << 20))
    assert [steps_of(f.payload)[0] for f in frames] == list(range(6))
    for s in range(12, 300):
        sp.append(batch(s, keys=20), 1)
    assert sp.dropped_items > 0
    for f in frames:  # delivered after all
        sp.advance(f)
    rest = drain(sp)
    assert rest[0] > 6 and rest[-1] == 299
    assert sp.dropped_items + len(rest) + len(frames) == 300
    assert sp.pending_items == 0 and sp.pending_frames == 0
    sp.close()


def test_lock_busy_exact_and_fallback(tmp_path, caplog):
    d = tmp_path / "exp"
    a = open_spool(d)
    with pytest.raises(SpoolBusy):
        Spool(SpoolOptions(path=str(d), exact=True)).open()
    caplog.set_level(logging.WARNING, logger="otel_rl")
    b = Spool(SpoolOptions(path=str(d)))
    assert b.open()
    assert b.path == f"{d}.{os.getpid()}"
    assert any("in use by another process" in r.getMessage() for r in caplog.records)
    b.append(batch(1), 1)
    a.close()
    assert Spool(SpoolOptions(path=str(d), exact=True)).open()  # released by close()
    assert b.close(remove_if_empty=False) is False


def test_fsync_policy(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    counts = {}
    for policy in ("always", "batch", "never"):
        calls.clear()
        sp = open_spool(tmp_path / policy, fsync=policy)
        after_open = len(calls)
        for s in range(20):
            sp.append(batch(s), 1)
        for _ in range(20):
            sp.advance(sp.peek())
        counts[policy] = len(calls) - after_open
        sp.sync()
        sp.close()
    assert counts["always"] >= 40  # every frame and every ack
    assert 1 <= counts["batch"] <= 6  # the new segment (+ directory), then at most once a second
    assert counts["never"] == 0


def test_meta_is_written_for_replay(tmp_path):
    sp = open_spool(tmp_path / "exp", meta={"exporter": "mlflow", "class": "m:C", "config": {"project": "p"}})
    sp.append(batch(1), 1)
    meta = files.read_meta(str(tmp_path / "exp"))
    assert meta["exporter"] == "mlflow" and meta["config"] == {"project": "p"} and meta["pid"] == os.getpid()
    sp.close()


def test_frame_format_is_what_the_docs_say(tmp_path):
    sp = open_spool(tmp_path / "exp")
    payload = batch(3)
    f, _ = sp.append(payload, 1)
    sp.close(remove_if_empty=False)
    data = segments(tmp_path / "exp")[0].read_bytes()
    assert data[:8] == b"OTELRLSP" and struct.unpack_from("<H", data, 8)[0] == 1
    magic, n, crc = struct.unpack_from("<4sII", data, f.offset)
    assert magic == b"\xf5RLF" and n == len(payload)
    import zlib

    assert crc == zlib.crc32(struct.pack("<I", n) + payload)
    assert data[f.offset + 12:] == payload
