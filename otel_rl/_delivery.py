"""Delivery to one exporter: `DeliveryQueue` keeps its batches in order, hands them over on its own
thread (otel_rl._delivery_thread), retries a failed one with exponential backoff and jitter, and gathers
batches that come close together into one delivery.  A slow exporter only grows its own queue (bounded).

A queue with a spool (tracker exporters by default; otel_rl.spool, docs/delivery.md) has a `Spiller`
(otel_rl._spill) that writes to append-only files on disk what the exporter fails to take or falls
behind on, and reads back what an earlier process left; what it spooled survives a crash.  Without one,
an overflowing queue sheds the spans of its oldest batches (counted); records are never dropped here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ._batch import Entry, ExporterStats, gather_runs
from ._delivery_thread import (
    _GATHER_MAX_ITEMS,
    POISON_ERRORS,
    POISON_MAX_ATTEMPTS,
    SPOOLED_FACTOR,
    SYNC_INTERVAL_S,
    DeliveryThread,
)
from ._memory import ITEM_BYTES
from ._spill import Spiller, make_spool
from ._values import warn_once

__all__ = [
    "POISON_ERRORS",
    "POISON_MAX_ATTEMPTS",
    "SPOOLED_FACTOR",
    "SYNC_INTERVAL_S",
    "DeliveryQueue",
    "wait_all_idle",
]

_log = logging.getLogger("otel_rl")


class DeliveryQueue(DeliveryThread):
    """One exporter's batches, delivered in order on its own thread.

    With a spool (``spool=`` options or a `Spool`, or ``config=`` to derive them; see
    `otel_rl.spool.options_for` and docs/delivery.md) the in-memory queue spills to disk:
    when the exporter fails (everything in memory, then every new batch, until a delivery
    succeeds), when memory holds more than `max_items` items or `max_bytes` bytes (`queue_max_bytes`:
    a stalled exporter, whose call neither returns nor fails, costs memory only up to it), when
    `wait_idle` times out (a flush) and at shutdown.  Batches are always delivered oldest first: the
    spool's frames, then the memory queue.  Without a spool, an overflowing queue drops its oldest batch (counted).
    """

    remote = False  # see otel_rl.export_process.client.RemoteQueue
    adopted = False  # took over from the export process (Pipeline.adopt)

    def __init__(
        self,
        exporter: Any,
        max_items: int,
        backoff_max_s: float = 30.0,
        *,
        spool: Any = None,
        config: Any = None,
        gather_s: float | None = None,
        max_bytes: int | None = None,
    ):
        self.exporter = exporter
        # export_interval_s: an exporter that gathers (trackers, console, JSONL) gets the batches queued within
        # this time of the oldest one in one delivery: fewer calls and transactions, the same data
        if gather_s is None:
            gather_s = (
                float(getattr(config, "export_interval_s", 0.0) or 0.0) if getattr(exporter, "gathers", False) else 0.0
            )
        self._gather_s = max(0.0, gather_s)
        # the exporter's work ahead of a delivery, done while the delivery gathers (Exporter.prepare)
        prepare = getattr(exporter, "prepare", None)
        self._prepare = prepare if self._gather_s > 0 and callable(prepare) else None
        self._flushing = 0  # wait_idle() calls waiting: no gathering then
        self.name = exporter.name
        self.stats = ExporterStats()
        self._mem: deque[Entry] = deque()  # memory-only batches, all newer than the spool's frames
        self._mem_items = 0
        self._mem_bytes = 0  # estimated (Entry.nbytes)
        self._current: Entry | None = None  # the batch being delivered
        self._cond = threading.Condition()
        self._io = threading.Lock()  # spool file state; taken before _cond, never while holding it
        self._max_items = max_items
        self._backoff_max = backoff_max_s
        self._stop = False
        self._nudge = False  # wait_idle() asks for a retry now instead of at the end of the backoff
        self._failing = False  # the last attempt failed with a delivery (not a data) error
        self._spilling = 0
        self._dropped = 0  # dropped here (the spool counts its own cap drops)
        self._rejected = 0  # items rejected as bad data alone, dropped here (otel_rl._isolate)
        self._stalled_at = -1  # `exported` when wait_room gave up waiting for this exporter
        self._undecodable = 0
        self._spool = make_spool(spool, config, exporter)
        self._disk = Spiller(self._spool, self.name, max_items) if self._spool is not None else None
        self._inner = getattr(exporter, "inner", exporter)  # the bridge's wrapper: the exporter it delivers to
        self._write_through = bool(self._disk is not None and self._disk.write_through)
        # queue_max_bytes: memory a spooled queue holds before its batches go to the spool; a gathered
        # delivery (in flight as long as the exporter's call lasts) takes at most half of it
        if max_bytes is None:
            max_bytes = int(getattr(config, "queue_max_bytes", 0) or 0)
        self._max_bytes = max(0, max_bytes) if self._spool is not None else 0
        self._gather_max_bytes = self._max_bytes // 2
        self._freed = 0  # bytes delivered since memory was last given back to the system
        self._recovering = self._spool is not None  # until the thread has looked at what an earlier run left
        self._thread = threading.Thread(target=self._run, name=f"otel-rl-export-{self.name}", daemon=True)
        self._thread.start()

    @property
    def spool(self) -> Any:
        """The `otel_rl.spool.Spool` of this queue, or None."""
        return self._spool

    @property
    def _batches(self) -> deque:  # the memory queue (benchmarks look at it)
        return self._mem

    # -- caller side (pipeline worker, bridge) -------------------------------------------
    def put(self, spans: list, records: list, seq: int = 0, nbytes: int = 0) -> bool:
        """Queue one batch.  Never waits for the exporter.  Returns False only when a write-through
        queue could not write the batch to its spool (it is then kept in memory).  `seq`: the number
        of the export process's batch it came in (`oldest_unsafe_seq`); `nbytes`: what the batch takes
        in memory, when the caller knows it better than the estimate by its items."""
        n = len(spans) + len(records)
        if not n:
            return True
        entry = Entry(spans, records, n, seq=seq, nbytes=nbytes or n * ITEM_BYTES)
        with self._cond:
            self._mem.append(entry)
            self._mem_items += n
            self._mem_bytes += entry.nbytes
            spill = self._spool is not None and (
                self._write_through
                or self._failing
                or self._mem_items > self._max_items
                or 0 < self._max_bytes < self._mem_bytes
            )
            if not spill:
                self._drop_overflow()
                self._refresh()
                if len(self._mem) <= 1 or self._prepare is not None or self._gather_left() <= 0:
                    # (a gathering delivery thread that already has batches waits for the oldest one's
                    # time whatever comes after it: waking it for each batch would only cost the
                    # training thread a switch of the interpreter lock every time; unless it has the
                    # exporter's work on this batch to do meanwhile)
                    self._cond.notify()
                return True
        ok = self._spill()
        if not ok:
            with self._cond:
                self._cond.notify()
        return ok or not self._write_through

    def oldest_unsafe_seq(self) -> int | None:
        """The `seq` of the oldest batch held only in memory (not delivered, not in the spool), or None
        when there is none: what the export process tells the training process it may forget (batches
        put with seq 0 count as older than any)."""
        with self._cond:
            if self._spilling:
                return 0  # batches on their way to the spool are in neither place for a moment
            cur = self._current
            if cur is not None and cur.frame is None:
                return cur.seq  # delivered in order: what is queued behind it is newer
            for e in self._mem:  # memory-only batches, oldest first
                if e.frame is None:
                    return e.seq
            return None

    def _drop_overflow(self) -> None:
        """Memory over its bound and no usable spool: shed the spans of the oldest batches (counted).
        Records are never dropped here: the pipeline waits for room instead (`wait_room`).  Under _cond."""
        if self._mem_items <= self._max_items or len(self._mem) <= 1:
            return
        shed = 0
        for e in list(self._mem)[:-1]:  # (the newest batch is kept whole)
            if e.spans and not e.spans_done:
                n = len(e.spans)
                e.spans = []
                gone = e.nbytes * n // e.n
                e.nbytes -= gone
                self._mem_bytes -= gone
                e.n -= n
                self._mem_items -= n
                shed += n
                if not e.n:
                    self._mem.remove(e)
                if self._mem_items <= self._max_items:
                    break
        if shed:
            self._dropped += shed
            self.stats.shed += shed
            _log.warning(
                "otel-rl: exporter %r is behind; shed the %d spans of its oldest batches (queue limit %d; "
                "records are kept)",
                self.name,
                shed,
                self._max_items,
            )

    def wait_room(self, stall_s: float = 10.0) -> None:
        """The pipeline worker, after a `put`: while the memory queue holds more than its bound (records,
        which are never dropped, with no spool to take them), wait for the exporter to deliver, so that
        the pipeline's own queue fills and spills instead.  Not longer than `stall_s` without a delivery
        (an exporter stuck in a call: the records stay in memory, with a warning)."""
        with self._cond:
            if self._mem_items <= self._max_items or self._stop or self._stalled_at == self.stats.exported:
                return  # (stalled: not waited for again until it delivers something)
            seen = self.stats.exported
            until = time.monotonic() + stall_s
            while self._mem_items > self._max_items and not self._stop:
                now = time.monotonic()
                if self.stats.exported != seen:
                    seen, until = self.stats.exported, now + stall_s
                elif now >= until:
                    self._stalled_at = seen
                    warn_once(
                        f"queue-stalled:{self.name}",
                        "otel-rl: exporter %r delivered nothing for %.0f s with "
                        "%d items queued in memory; its records are kept there",
                        self.name,
                        stall_s,
                        self._mem_items,
                    )
                    return
                self._cond.wait(min(0.05, until - now))

    def _spill(self, sync: bool = False) -> bool:
        """Write the memory queue (and the batch in flight, when it is only in memory) to the spool,
        oldest first.  Any thread.  True when nothing is left only in memory."""
        disk = self._disk
        if disk is None:
            return False
        with self._io:
            with self._cond:
                cur = self._current
                anything = bool(self._mem) or (cur is not None and cur.frame is None and not cur.unspoolable)
            if not anything:
                if sync and disk.spool.opened:
                    disk.sync()
                return True
            ready = disk.ready()  # may create and recover the directory: not under _cond
            with self._cond:
                if not ready:
                    self._drop_overflow()
                    self._refresh()
                    return False
                cur = self._current
                if cur is not None and cur.frame is None and not cur.unspoolable and disk.pending:
                    # opening the spool just recovered older frames: the batch in flight cannot go
                    # behind them (it would be delivered twice); it stays memory-only
                    cur.unspoolable = True
                if cur is not None and (cur.frame is not None or cur.unspoolable):
                    cur = None
                todo = ([cur] if cur is not None else []) + list(self._mem)
                self._mem.clear()
                self._mem_items = 0
                self._mem_bytes = 0
                self._spilling += 1
            if self._gather_s > 0:
                todo = gather_runs(todo, cur, _GATHER_MAX_ITEMS, self._gather_max_bytes)
            back: list[Entry] = []
            written = 0
            try:
                written, dropped, back = disk.write(todo, cur)
                self._dropped += dropped
                if sync:
                    disk.sync()
            finally:
                with self._cond:
                    self._spilling -= 1
                    if back:
                        self._mem.extendleft(reversed(back))
                        self._mem_items += sum(x.n for x in back)
                        self._mem_bytes += sum(x.nbytes for x in back)
                        self._drop_overflow()
                    self.stats.spooled += written
                    self._refresh()
                    self._cond.notify_all()
        return not back

    def _refresh(self) -> None:
        """Recompute the derived stats.  Under _cond."""
        st = self.stats
        sp = self._spool
        cur = self._current
        mem = self._mem_items + (cur.n if cur is not None and cur.frame is None else 0)
        pending = sp.pending_items if sp is not None else 0
        st.in_memory = mem
        st.queued = mem + pending
        st.spool_pending = pending
        st.spool_bytes = sp.bytes if sp is not None and sp.opened else 0
        st.corrupt_frames = (sp.corrupt_frames if sp is not None else 0) + self._undecodable
        st.dropped = self._dropped + (sp.dropped_items if sp is not None else 0)
        st.rejected = getattr(self._inner, "rejected", 0) + self._rejected

    def _idle(self) -> bool:
        disk = self._disk
        return (
            not self._mem
            and self._current is None
            and not self._spilling
            and not self._recovering
            and not (disk is not None and disk.spool.pending_frames)
        )

    # -- control -------------------------------------------------------------------------------
    def hold_flush(self) -> None:
        """What is gathering goes out now, and later batches too, until `release_flush` (see
        `wait_all_idle`: the queues of a flush deliver at once, not one after the other)."""
        with self._cond:
            self._flushing += 1
            if not self._idle():
                self._nudge = True  # a flush: retry now rather than at the end of the backoff
                self._cond.notify_all()

    def release_flush(self) -> None:
        with self._cond:
            self._flushing -= 1

    def wait_idle(self, timeout_s: float) -> bool:
        """True once everything queued is delivered.  On timeout, what is left is written to the
        spool (when there is one) and fsynced before returning False: after `wait_idle` returns,
        every batch put before it is delivered or acknowledged in the spool."""
        deadline = time.monotonic() + timeout_s
        with self._cond:  # (a reentrant lock: hold_flush and release_flush take it again)
            self.hold_flush()
            try:
                while not self._idle():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                idle = self._idle()
            finally:
                self.release_flush()
        disk = self._disk
        if not idle:
            if disk is not None:
                self._spill(sync=True)
            return False
        if disk is not None and disk.dirty:
            with self._io:
                if disk.spool.opened:
                    disk.sync()
        return True

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.wait_idle(timeout_s)
        self.request_stop()
        self.join(max(0.0, deadline - time.monotonic()))

    def request_stop(self) -> None:
        """Deliver what is queued; on failure keep it in the spool (or drop it, counted); then end."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        disk = self._disk
        if disk is not None and self._thread.is_alive():
            # the exporter is stuck in a call: make what waits durable from here
            self._spill(sync=True)
            with self._cond:
                pending = self.stats.spool_pending
            if pending:
                disk.log_left(pending, disk.spool.bytes, disk.spool.path)


def wait_all_idle(queues: Sequence[Any], timeout_s: float) -> bool:
    """`wait_idle` of each of `queues` within `timeout_s` overall.  Every queue that gathers stops
    gathering first, so all of them deliver at the same time: waiting for them one after the other
    would leave each one gathering until the ones before it are done.  The export process's queue
    (which has no `hold_flush`) is waited for first: its flush is the long one."""
    deadline = time.monotonic() + timeout_s
    held = []
    try:
        for q in queues:
            hold = getattr(q, "hold_flush", None)
            if hold is not None:
                hold()
                held.append(q)
        ok = True
        for q in [q for q in queues if q not in held] + held:
            ok = q.wait_idle(max(0.0, deadline - time.monotonic())) and ok
        return ok
    finally:
        for q in held:
            q.release_flush()
