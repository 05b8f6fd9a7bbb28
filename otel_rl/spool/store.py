"""The on-disk spool of one exporter: append-only segment files of checksummed frames and an
ack file that says how far delivery got.

Directory layout (one directory per exporter queue)::

    lock                      flock()ed by the process that owns the spool (released when it dies)
    meta.json                 exporter name and class, the (secret-scrubbed) config: what replay needs
    ack                       two 32-byte slots, written alternately: (counter, segment, offset) + CRC32
    0000000000000001.seg      segments, oldest first; a new process never appends to an old one
    0000000000000002.seg

Segment file: a 16-byte header (``OTELRLSP``, u16 version, 6 reserved bytes), then frames::

    frame = b"\\xf5RLF" | u32 length | u32 CRC32(length bytes + payload) | payload

The payload is one batch as `codec.encode_batch` writes it.  Reading a segment validates
every frame: a frame with a bad magic, an impossible length or a CRC mismatch starts a
corrupt region, skipped up to the next frame that validates (or to the end: a truncated tail
after a crash mid-write); each region is counted (`corrupt_frames`, `corrupt_bytes`) and logged.

The ack names the next undelivered frame (segment number, byte offset).  It is rewritten after
every delivered frame, in the slot not holding the newest value, so a torn write loses at
most the latest step and never the whole position.  Fully delivered segments are deleted.

Not thread-safe: the delivery queue calls it under its own I/O lock.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Iterator
from typing import Any

from .files import (
    ACK_SLOT_BYTES,
    FRAME_HEADER_BYTES,
    META_FORMAT,
    SEG_HEADER,
    SEGMENT_HEADER_BYTES,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    frame_at,
    frame_bytes,
    fsync_dir,
    write_all,
)
from .options import DROP_POLICIES, FSYNC_POLICIES, Frame, SpoolBusy, SpoolOptions
from .segment import Segment, ack_slot, read_ack, scan_segment

__all__ = ["DROP_POLICIES", "FSYNC_POLICIES", "Frame", "Spool", "SpoolBusy", "SpoolOptions"]

_log = logging.getLogger("otel_rl")

BATCH_FSYNC_INTERVAL_S = 1.0

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
    fcntl = None  # type: ignore[assignment]


_open_spools: weakref.WeakSet[Spool] = weakref.WeakSet()


def _close_in_forked_child() -> None:
    # the child must not write to (or keep alive) the parent's files; closing its copies of the
    # descriptors leaves the parent's flock in place (the lock belongs to the open file description)
    for s in list(_open_spools):
        s._forget_fds()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_forked_child)


class Spool:
    def __init__(self, options: SpoolOptions):
        self.options = options
        self.path = options.path
        self.opened = False
        self._lock_fd = -1
        self._wfd = -1  # append fd of the writer segment
        self._rfd = -1  # read fd and the segment it is open on
        self._rseq = -1
        self._ack_fd = -1
        self._ack_counter = 0
        self._segs: list[Segment] = []
        self._writer: Segment | None = None
        self._next_seq = 1
        #: (seq, index) of the frames being delivered: the oldest one (`peek`) and those gathered after
        #: it (`peek_next`), delivered together
        self._inflight: set[tuple[int, int]] = set()
        #: in-flight frames whose segment the size cap dropped: their items, until `advance()`
        self._detached: dict[tuple[int, int], int] = {}
        self._dirty_seg = False
        self._dirty_ack = False
        self._last_sync = time.monotonic()
        # counters
        self.pending_frames = 0
        self.pending_items = 0
        self.bytes = 0
        self.corrupt_frames = 0
        self.corrupt_bytes = 0
        self.dropped_items = 0  # by the size cap
        self.dropped_frames = 0
        self.recovered_items = 0

    # ------------------------------------------------------------------------- open / recover
    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def open(self, create: bool = True) -> bool:
        """Lock the directory (creating it when `create`) and recover what it holds.

        Returns False when there is nothing to open (no directory and not `create`).  Raises
        SpoolBusy when the directory is locked by another process and the options are `exact`;
        otherwise a locked directory makes this spool use a sibling ``<path>.<pid>[.<n>]``.
        Raises OSError when the directory cannot be created or used.
        """
        if self.opened:
            return True
        base = self.options.path
        candidates = [base] + (
            []
            if self.options.exact
            else [f"{base}.{os.getpid()}"] + [f"{base}.{os.getpid()}.{i}" for i in range(2, 10)]
        )
        for i, path in enumerate(candidates):
            if not os.path.isdir(path):
                if not create:
                    if i == 0:
                        return False
                    continue
                os.makedirs(path, exist_ok=True)
            fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    if self.options.exact:
                        raise SpoolBusy(f"spool {path} is in use by another process") from None
                    continue
            if i:
                _log.warning("otel-rl: spool %s is in use by another process; this one spools to %s", base, path)
            self.path = path
            self._lock_fd = fd
            break
        else:
            raise SpoolBusy(f"spool {base} and its fallbacks are all in use")
        try:
            self._recover()
            self._write_meta()
        except BaseException:
            self._forget_fds()
            raise
        self.opened = True
        _open_spools.add(self)
        return True

    def _write_meta(self) -> None:
        """The owner's exporter and config (replay reads them); a reader without meta keeps the file."""
        if not self.options.meta and os.path.exists(os.path.join(self.path, "meta.json")):
            return
        meta = dict(self.options.meta)
        meta.update({"format": META_FORMAT, "pid": os.getpid(), "updated_ns": time.time_ns()})
        tmp = os.path.join(self.path, f"meta.json.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.path, "meta.json"))

    def _recover(self) -> None:
        self._ack_fd = os.open(os.path.join(self.path, "ack"), os.O_RDWR | os.O_CREAT, 0o644)
        best = read_ack(self._ack_fd)
        ack = None
        if best is not None:
            self._ack_counter = best[0]
            ack = best[1], best[2]
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".seg") and n[:-4].isdigit())
        for name in names:
            seq = int(name[:-4])
            path = os.path.join(self.path, name)
            self._next_seq = max(self._next_seq, seq + 1)
            if ack is not None and seq < ack[0]:
                os.unlink(path)  # delivered before the restart
                continue
            seg = scan_segment(seq, path, self._corrupt)
            if seg is None:
                continue
            if ack is not None and seq == ack[0]:
                i = 0
                while i < len(seg.offs) and seg.offs[i] < ack[1]:
                    i += 1
                seg.next = i
            if seg.next >= len(seg.offs):
                os.unlink(path)
                continue
            self._segs.append(seg)
            self.bytes += seg.size
            self.pending_frames += len(seg.offs) - seg.next
            self.pending_items += seg.pending_items()
        self.recovered_items = self.pending_items

    def _corrupt(self, path: str, offset: int, nbytes: int, what: str) -> None:
        self.corrupt_frames += 1
        self.corrupt_bytes += nbytes
        _log.warning(
            "otel-rl: spool %s: %s at offset %d; skipped %d bytes (corrupt regions so far: %d)",
            path,
            what,
            offset,
            nbytes,
            self.corrupt_frames,
        )

    # ------------------------------------------------------------------------- writing
    def append(self, payload: bytes, n_items: int, inflight: bool = False) -> tuple[Frame | None, int]:
        """Append one batch.  Returns (its frame, or None when the size cap rejected it; items dropped).

        `inflight`: the batch is being delivered from memory right now (it becomes the frame in
        flight); if the cap rejects it, it is not counted as dropped, since it is still delivered.
        """
        data = frame_bytes(payload)
        opts = self.options
        if len(data) + SEGMENT_HEADER_BYTES > opts.max_bytes:  # can never fit
            if not inflight:
                self._count_drop(1, n_items)
            return None, 0 if inflight else n_items

        def need() -> int:
            w = self._writer
            return len(data) + (SEGMENT_HEADER_BYTES if w is None or w.size >= opts.segment_bytes else 0)

        dropped = 0
        while self.bytes + need() > opts.max_bytes:
            if opts.drop_policy == "drop_newest" or not self._segs:
                if inflight:
                    return None, dropped
                self._count_drop(1, n_items)
                return None, dropped + n_items
            dropped += self._drop_oldest_segment()
        if self._writer is None or self._writer.size >= opts.segment_bytes:
            self._roll()
        w = self._writer
        assert w is not None
        off = w.size
        try:
            write_all(self._wfd, data)
        except OSError:
            try:  # leave no partial frame behind
                os.ftruncate(self._wfd, off)
            except OSError:
                pass
            raise
        index = len(w.offs)
        w.offs.append(off)
        w.lens.append(len(data))
        w.items.append(n_items)
        w.size += len(data)
        self.bytes += len(data)
        self.pending_frames += 1
        self.pending_items += n_items
        self._dirty_seg = True
        if opts.fsync == "always":
            os.fsync(self._wfd)
            self._dirty_seg = False
        elif opts.fsync == "batch":
            self._maybe_sync()
        if inflight:
            self._inflight = {(w.seq, index)}
        return Frame(w.seq, index, off, off + len(data), n_items, b""), dropped

    def _count_drop(self, frames: int, items: int) -> None:
        self.dropped_frames += frames
        self.dropped_items += items

    def _roll(self) -> None:
        if self._writer is not None:
            if self.options.fsync != "never" and self._dirty_seg:
                os.fsync(self._wfd)
            self._dirty_seg = False
            os.close(self._wfd)
            self._wfd = -1
            old = self._writer
            self._writer = None
            if old.next >= len(old.offs):  # fully delivered: nothing to keep
                self._delete(old)
        seq = self._next_seq
        self._next_seq += 1
        path = os.path.join(self.path, f"{seq:016d}.seg")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)
        try:
            write_all(fd, SEG_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION))
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        seg = Segment(seq, path, SEGMENT_HEADER_BYTES)
        self._segs.append(seg)
        self.bytes += SEGMENT_HEADER_BYTES
        self._writer = seg
        self._wfd = fd
        if self.options.fsync != "never":
            fsync_dir(self.path)

    def _drop_oldest_segment(self) -> int:
        seg = self._segs[0]
        if seg is self._writer:
            self._roll()  # new appends go to a fresh segment; this one can go
            if not self._segs or self._segs[0] is not seg:
                return 0  # it was fully delivered and deleted by the roll
        lost_frames = len(seg.offs) - seg.next
        lost_items = seg.pending_items()
        for key in sorted(k for k in self._inflight if k[0] == seg.seq and k[1] >= seg.next):
            # the frames being delivered stay with the delivery thread (not lost); they stay counted
            # as pending until `advance()` is called with them
            i = key[1]
            lost_frames -= 1
            lost_items -= seg.items[i]
            self._detached[key] = seg.items[i]
            self._inflight.discard(key)
        self.pending_frames -= lost_frames
        self.pending_items -= lost_items
        self._count_drop(lost_frames, lost_items)
        seg.next = len(seg.offs)
        self._delete(seg)
        self._write_ack()
        return lost_items

    def _delete(self, seg: Segment) -> None:
        if self._rseq == seg.seq:
            os.close(self._rfd)
            self._rfd, self._rseq = -1, -1
        try:
            os.unlink(seg.path)
        except FileNotFoundError:
            pass
        self.bytes -= seg.size
        self._segs.remove(seg)

    # ------------------------------------------------------------------------- reading
    def peek(self) -> Frame | None:
        """The next undelivered frame (the oldest), read and checked; None when there is none.

        Frames that fail their check are skipped, counted and logged.  The frame returned is
        the one in flight until `advance()` is called with it.
        """
        while self._segs:
            seg = self._segs[0]
            if seg.next >= len(seg.offs):
                if seg is self._writer:
                    return None
                self._delete(seg)
                continue
            i = seg.next
            frame = self._read(seg, i)
            if frame is None:
                self._consume(seg, i)
                continue
            self._inflight = {(seg.seq, i)}
            return frame
        return None

    def peek_next(self, frame: Frame, max_items: int, max_bytes: int) -> Frame | None:
        """The undelivered frame right after `frame` (one in flight), read and checked, to be delivered
        with it: it is in flight too until `advance()` is called with it (after `frame`).  None when
        there is none, when it holds more than `max_items` items or `max_bytes` bytes, or when it fails
        its check (`peek` skips it, counted, once it is the oldest)."""
        if (frame.seq, frame.index) not in self._inflight:
            return None
        segs = self._segs
        k = next((j for j, s in enumerate(segs) if s.seq == frame.seq), -1)
        if k < 0:
            return None
        seg = segs[k]
        i = frame.index + 1
        if i >= len(seg.offs):
            if k + 1 >= len(segs):
                return None
            seg = segs[k + 1]
            i = seg.next
            if i >= len(seg.offs):
                return None
        if seg.items[i] > max_items or seg.lens[i] > max_bytes:
            return None
        nxt = self._read(seg, i, quiet=True)
        if nxt is not None:
            self._inflight.add((seg.seq, i))
        return nxt

    def _read(self, seg: Segment, i: int, quiet: bool = False) -> Frame | None:
        """Frame `i` of `seg`, read and checked; None (counted and logged as corrupt unless `quiet`) when
        it fails its check."""
        off = seg.offs[i]
        end = off + seg.lens[i]
        if self._rseq != seg.seq:
            if self._rfd >= 0:
                os.close(self._rfd)
            self._rfd = os.open(seg.path, os.O_RDONLY)
            self._rseq = seg.seq
        data = os.pread(self._rfd, end - off, off)
        n = frame_at(data, 0, len(data))
        if n < 0 or FRAME_HEADER_BYTES + n != len(data):
            if not quiet:
                self._corrupt(seg.path, off, end - off, "frame changed on disk (checksum)")
            return None
        return Frame(seg.seq, i, off, end, seg.items[i], data[FRAME_HEADER_BYTES:])

    def iter_pending(self) -> Iterator[Frame]:
        """Every undelivered frame, oldest first, read-only (the ack does not move; bad frames are skipped)."""
        for seg in list(self._segs):
            with open(seg.path, "rb") as f:
                for i in range(seg.next, len(seg.offs)):
                    f.seek(seg.offs[i])
                    data = f.read(seg.lens[i])
                    n = frame_at(data, 0, len(data))
                    if n >= 0:
                        yield Frame(
                            seg.seq, i, seg.offs[i], seg.offs[i] + seg.lens[i], seg.items[i], data[FRAME_HEADER_BYTES:]
                        )

    def advance(self, frame: Frame) -> None:
        """`frame` is delivered (or given up on): move the ack past it.  Frames delivered together are
        advanced in order."""
        key = (frame.seq, frame.index)
        self._inflight.discard(key)
        items = self._detached.pop(key, None)
        if items is not None:
            self.pending_frames -= 1
            self.pending_items -= items
            return
        for seg in self._segs:
            if seg.seq == frame.seq:
                if seg.next == frame.index:
                    self._consume(seg, frame.index)
                return
        # its segment was dropped by the size cap meanwhile: nothing to move

    def _consume(self, seg: Segment, i: int) -> None:
        seg.next = i + 1
        self.pending_frames -= 1
        self.pending_items -= seg.items[i]
        if seg.next >= len(seg.offs) and seg is not self._writer:
            self._delete(seg)
        self._write_ack()

    def _write_ack(self) -> None:
        if self._ack_fd < 0:
            return
        seg = next((s for s in self._segs if s.next < len(s.offs)), None)
        if seg is not None:
            seq, off = seg.seq, seg.offs[seg.next]
        elif self._writer is not None:
            seq, off = self._writer.seq, self._writer.size
        else:
            seq, off = self._next_seq, 0
        self._ack_counter += 1
        os.pwrite(self._ack_fd, ack_slot(self._ack_counter, seq, off), (self._ack_counter % 2) * ACK_SLOT_BYTES)
        self._dirty_ack = True
        if self.options.fsync == "always":
            os.fsync(self._ack_fd)
            self._dirty_ack = False
        elif self.options.fsync == "batch":
            self._maybe_sync()

    # ------------------------------------------------------------------------- durability / life
    def _maybe_sync(self) -> None:
        if time.monotonic() - self._last_sync >= BATCH_FSYNC_INTERVAL_S:
            self.sync()

    @property
    def dirty(self) -> bool:
        return self._dirty_seg or self._dirty_ack

    def sync(self) -> None:
        """fsync what was written since the last sync (unless the policy is `never`)."""
        if self.options.fsync != "never":
            if self._dirty_seg and self._wfd >= 0:
                os.fsync(self._wfd)
            if self._dirty_ack and self._ack_fd >= 0:
                os.fsync(self._ack_fd)
        self._dirty_seg = self._dirty_ack = False
        self._last_sync = time.monotonic()

    def close(self, remove_if_empty: bool = True) -> bool:
        """Sync and release the spool; remove its directory when nothing is left in it.  True if removed."""
        if not self.opened:
            return False
        removed = False
        try:
            self.sync()
        except OSError as exc:
            _log.warning("otel-rl: spool %s: fsync failed at close: %s", self.path, exc)
        empty = self.pending_frames == 0
        if empty and remove_if_empty:
            for seg in list(self._segs):
                self._delete(seg)
            self._forget_fds(close_lock=False)
            for name in ("ack", "meta.json"):
                try:
                    os.unlink(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass
            try:
                os.unlink(os.path.join(self.path, "lock"))
                os.rmdir(self.path)
                removed = True
                if self.options.remove_parent_if_empty:
                    os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass
        self._forget_fds()
        self.opened = False
        _open_spools.discard(self)
        return removed

    def _forget_fds(self, close_lock: bool = True) -> None:
        names = ["_wfd", "_rfd", "_ack_fd"] + (["_lock_fd"] if close_lock else [])
        for name in names:
            fd = getattr(self, name)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)
        self._rseq = -1

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "pending_frames": self.pending_frames,
            "pending_items": self.pending_items,
            "bytes": self.bytes,
            "segments": len(self._segs),
            "corrupt_frames": self.corrupt_frames,
            "corrupt_bytes": self.corrupt_bytes,
            "dropped_items": self.dropped_items,
        }
