"""The delivery thread of a `DeliveryQueue` (otel_rl._delivery): it takes the oldest batch (the spool's
frames first, then the memory queue, gathered), hands it to the exporter, retries it with backoff while the
exporter fails, and acknowledges it once delivered.  `DeliveryThread` is the queue's base class: the
queue's state and its caller side are in `DeliveryQueue`."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from typing import Any

from ._batch import Entry, ExporterStats
from ._isolate import Isolation, log_rejected
from ._memory import RELEASE_BYTES, release_memory
from ._spill import Spiller
from ._values import warn_once
from .exporters.base import DATA_ERRORS, is_data_error

_log = logging.getLogger("otel_rl")
#: an idle queue with unsynced spool writes fsyncs them this often
SYNC_INTERVAL_S = 1.0
_GATHER_MAX_ITEMS = 20_000  # a gathered delivery holds at most this many items (spans + records)
#: a batch read back from the spool takes about this many times its encoded size in memory
SPOOLED_FACTOR = 4


# Errors that say "this data is wrong", not "the tracker is unreachable": a batch that fails
# with one of them POISON_MAX_ATTEMPTS times in a row is delivered in parts until the items the
# exporter rejects are alone; those are dropped (counted, logged), nothing else (otel_rl._isolate).
# Any other error (OSError, ConnectionError, a tracker's own exception) is retried with backoff for
# as long as the process runs.
POISON_ERRORS = DATA_ERRORS
POISON_MAX_ATTEMPTS = 3


class DeliveryThread:
    """What the delivery thread of a `DeliveryQueue` does (`_run`, on its own thread)."""

    # (the queue's state, made by DeliveryQueue.__init__)
    exporter: Any
    name: str
    stats: ExporterStats
    _mem: deque[Entry]
    _mem_items: int
    _mem_bytes: int
    _current: Entry | None
    _cond: threading.Condition
    _io: threading.Lock
    _backoff_max: float
    _stop: bool
    _nudge: bool
    _failing: bool
    _flushing: int
    _spilling: int
    _dropped: int
    _rejected: int
    _undecodable: int
    _spool: Any
    _disk: Spiller | None
    _gather_s: float
    _gather_max_bytes: int
    _max_bytes: int
    _freed: int
    _recovering: bool
    _prepare: Any

    def _spill(self, sync: bool = False) -> bool:  # (DeliveryQueue's)
        raise NotImplementedError

    def _refresh(self) -> None:  # (DeliveryQueue's)
        raise NotImplementedError

    def _run(self) -> None:
        self._recover()
        attempt = 0
        poison_attempts = 0
        while True:
            e = self._next_entry()
            if e is None:
                break
            iso = e.isolating
            try:
                if iso is None:
                    if e.spans and not e.spans_done:
                        self.exporter.export_spans(e.spans)
                        e.spans_done = True
                    if e.records:
                        self.exporter.export_records(e.records)
                else:  # a batch rejected as bad data: its next part
                    kind, part = iso.todo[0]
                    if kind == "spans":
                        self.exporter.export_spans(part)
                    else:
                        self.exporter.export_records(part)
                    iso.todo.popleft()
            except Exception as exc:  # the exporter failed: keep the batch, back off, retry
                self.stats.failed_attempts += 1
                warn_once(
                    f"export-fail:{self.name}:{type(exc).__name__}",
                    "otel-rl: exporter %r failed (%s: %s); the batch is kept and retried",
                    self.name,
                    type(exc).__name__,
                    exc,
                )
                poison = is_data_error(exc)
                if poison and iso is not None:
                    self._refused(e, iso, exc)  # the part is halved, or, one item, dropped
                    continue
                poison_attempts = poison_attempts + 1 if poison else 0
                if poison_attempts >= POISON_MAX_ATTEMPTS:
                    # the same data error every time: the batch goes in parts, until the bad items are alone
                    _log.warning(
                        "otel-rl: exporter %r rejected a batch %d times (%s: %s); delivering its %d items in "
                        "parts to find the bad ones",
                        self.name,
                        poison_attempts,
                        type(exc).__name__,
                        exc,
                        e.n,
                    )
                    e.isolating = Isolation(e.spans, e.records, e.spans_done)
                    self._refused(e, e.isolating, exc)
                    poison_attempts = attempt = 0
                    continue
                if not poison:
                    self._failing = True
                if self._stop:  # shutting down: keep what is left in the spool, or give up (counted)
                    self._give_up()
                    break
                if self._failing and self._spool is not None:
                    self._spill()  # the exporter is down: what waits is made durable now
                delay = min(self._backoff_max, 0.05 * (2 ** min(attempt, 16)))
                attempt += 1
                self.stats.retried += 1
                self._backoff(delay * (0.5 + random.random()))
                continue
            attempt = 0
            poison_attempts = 0
            self._failing = False
            if iso is not None and iso.todo:
                continue  # the next part of a batch rejected as bad data
            self._finish(e)
        self._close()

    def _recover(self) -> None:
        """A spool directory left by an earlier process: deliver its frames first."""
        disk = self._disk
        if disk is None:
            return
        try:
            with self._io:
                disk.recover()
        finally:
            with self._cond:
                self._recovering = False
                self._refresh()
                self._cond.notify_all()

    def _next_entry(self) -> Entry | None:
        """The batch to deliver next (the one in flight if any); None when stopped and idle."""
        disk = self._disk
        while True:
            frame = None
            with self._io:
                with self._cond:
                    if self._current is not None:
                        return self._current
                frames: list = []
                if disk is not None and disk.pending:
                    frame = disk.spool.peek()
                    if frame is not None:
                        entry = disk.take_cached(frame)
                        if entry is not None:
                            with self._cond:
                                self._current = entry
                                self._refresh()
                            return entry
                        frames = self._frames_after(frame)
                    else:
                        with self._cond:
                            self._refresh()
                gather_wait = 0.0
                if frame is None:
                    with self._cond:
                        if self._mem:
                            gather_wait = self._gather_left()
                            if gather_wait <= 0:
                                entry = self._take_memory()
                                self._current = entry
                                self._refresh()
                                return entry
            if gather_wait > 0:
                if self._prepare is not None and self._prepare_gathered():
                    continue  # that took time: look again
                with self._cond:
                    self._cond.wait(gather_wait)
                continue
            if frame is not None and disk is not None:
                entry = self._read_frames(disk, frames)
                if entry is None:  # none can be decoded: skipped (counted)
                    with self._io:
                        for f in frames:
                            disk.spool.advance(f)
                        with self._cond:
                            self._refresh()
                    continue
                with self._cond:
                    self._current = entry
                return entry
            with self._cond:
                if self._mem or self._spilling or (disk is not None and disk.pending):
                    continue
                if self._stop:
                    self._cond.notify_all()
                    return None
                self._cond.notify_all()  # idle: wake wait_idle()
                dirty = disk is not None and disk.dirty
                freed = self._freed >= RELEASE_BYTES
                if freed:
                    self._freed = 0
                else:
                    self._cond.wait(SYNC_INTERVAL_S if dirty else None)
            if freed:
                release_memory()  # a backlog delivered: its memory back to the system
            if dirty and disk is not None:
                with self._io:
                    if disk.dirty:
                        disk.sync()

    def _frames_after(self, first: Any) -> list:
        """The spool's oldest frame `first` and, when this queue gathers, the frames after it that its
        delivery takes too (up to _GATHER_MAX_ITEMS items and the gathered bytes' bound, as from memory):
        a backlog written batch by batch while the exporter was down goes out in as few calls as the
        same batches from memory.  Under _io."""
        frames = [first]
        disk = self._disk
        if self._gather_s <= 0 or disk is None or disk.has_cached:
            return frames
        n = first.n_items
        room_b = (self._gather_max_bytes or (1 << 62)) // SPOOLED_FACTOR - len(first.payload)
        while n < _GATHER_MAX_ITEMS and room_b > 0:
            nxt = disk.spool.peek_next(frames[-1], _GATHER_MAX_ITEMS - n, room_b)
            if nxt is None:
                break
            frames.append(nxt)
            n += nxt.n_items
            room_b -= len(nxt.payload)
        return frames

    def _read_frames(self, disk: Spiller, frames: list) -> Entry | None:
        """One delivery of the spool `frames` (oldest first), decoded; one that cannot be is skipped
        (counted, logged, acknowledged with the others).  None when none can be."""
        spans: list = []
        records: list = []
        n = nbytes = 0
        for f in frames:
            batch = disk.read(f)
            if batch is None:
                with self._cond:
                    self._undecodable += 1
                    self._dropped += f.n_items
                continue
            if len(frames) == 1:
                spans, records = batch
            else:
                spans.extend(batch[0])
                records.extend(batch[1])
            n += f.n_items
            nbytes += len(f.payload) * SPOOLED_FACTOR
        if not n:
            return None
        entry = Entry(spans, records, n, frames[-1], nbytes=nbytes)
        entry.frames = tuple(frames)
        return entry

    def _prepare_gathered(self) -> bool:
        """The exporter's `prepare` for the memory batches that have not had it (while they gather);
        whether there were any.  A failing `prepare` only costs its time: the delivery does the work."""
        prepare = self._prepare
        if prepare is None:
            return False
        with self._cond:
            todo = [e for e in self._mem if not e.prepared and e.records]
            for e in todo:
                e.prepared = True
        for e in todo:
            try:
                prepare(e.records)
            except Exception:
                _log.debug("otel-rl: exporter %r: prepare failed", self.name, exc_info=True)
        return bool(todo)

    def _gather_left(self) -> float:
        """Seconds the delivery thread waits for more batches before the memory queue's oldest goes
        out (0: now).  Under _cond, with batches in memory."""
        if (
            self._gather_s <= 0
            or self._stop
            or self._flushing
            or self._mem_items >= _GATHER_MAX_ITEMS
            or 0 < self._gather_max_bytes <= self._mem_bytes
        ):
            return 0.0
        return self._mem[0].t + self._gather_s - time.monotonic()

    def _take_memory(self) -> Entry:
        """The memory queue's oldest batch, gathered with the ones after it when this queue gathers
        (up to _GATHER_MAX_ITEMS).  Under _cond."""
        entry = self._mem.popleft()
        self._mem_items -= entry.n
        self._mem_bytes -= entry.nbytes
        if self._gather_s <= 0:
            return entry
        parts = [entry]
        n = entry.n
        b = entry.nbytes
        cap_b = self._gather_max_bytes or float("inf")
        while self._mem and n + self._mem[0].n <= _GATHER_MAX_ITEMS and b + self._mem[0].nbytes <= cap_b:
            e = self._mem.popleft()
            self._mem_items -= e.n
            self._mem_bytes -= e.nbytes
            n += e.n
            b += e.nbytes
            parts.append(e)
        return parts[0] if len(parts) == 1 else Entry.gather(parts)

    def _refused(self, e: Entry, iso: Isolation, exc: BaseException) -> None:
        """A part of batch `e` was rejected as bad data: halved, or, a single item, dropped (counted, logged).
        The batch is finished (its spool frame acknowledged) once every part is delivered or dropped."""
        item = iso.refused()
        if item is not None:
            self._rejected += 1
            log_rejected(self.name, item, exc, self._rejected)
        if not iso.todo:
            self._finish(e)

    def _finish(self, e: Entry) -> None:
        with self._io:
            sp = self._spool
            if e.frame is not None and sp is not None:
                for f in e.frames or (e.frame,):
                    sp.advance(f)
            with self._cond:
                self._current = None
                if self._max_bytes:
                    self._freed += e.nbytes
                n = e.n
                if e.isolating is not None:  # items rejected as bad data: dropped
                    n -= e.isolating.rejected
                    self._dropped += e.isolating.rejected
                self.stats.exported += n
                if e.frame is not None:
                    self.stats.replayed += n
                self._refresh()
                self._cond.notify_all()

    def _backoff(self, delay: float) -> None:
        end = time.monotonic() + delay
        disk = self._disk
        with self._cond:
            while not self._stop and not self._nudge:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, SYNC_INTERVAL_S))
                if disk is not None and disk.dirty:
                    self._cond.release()
                    try:
                        with self._io:
                            if disk.dirty:
                                disk.sync()
                    finally:
                        self._cond.acquire()
            self._nudge = False

    def _give_up(self) -> None:
        """Stopping while the exporter fails: the rest goes to the spool, or is dropped (counted)."""
        if self._spool is not None:
            self._spill(sync=True)
        with self._cond:
            cur = self._current
            lost = self._mem_items
            if cur is not None and cur.frame is None:
                iso = cur.isolating
                if iso is None:
                    lost += cur.n
                else:  # in parts: those delivered are, those rejected were dropped
                    left = sum(len(part) for _, part in iso.todo)
                    self.stats.exported += cur.n - iso.rejected - left
                    self._dropped += iso.rejected
                    lost += left
            self._dropped += lost
            self._mem.clear()
            self._mem_items = 0
            self._mem_bytes = 0
            self._current = None
            self._refresh()
            self._cond.notify_all()
        if lost:
            _log.warning("otel-rl: exporter %r still failing at shutdown; %d items not delivered", self.name, lost)

    def _close(self) -> None:
        if self._disk is not None:
            with self._io:
                self._disk.close()
        with self._cond:
            self._refresh()
            self._cond.notify_all()
