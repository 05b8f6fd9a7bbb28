"""The export pipeline: caller threads enqueue, one worker turns spans into records,
one delivery thread per exporter hands batches over.

Caller-side cost is a deque append (plus, for `log()`, the value coercion done
before it).  Everything else happens here, off the training thread:

    submit() ──► deque ──► pipeline worker: log items → spans, token2text,
                                            spans → records, instruments
                                 │
                                 ├──► DeliveryQueue(console) ──► exporter
                                 ├──► DeliveryQueue(otlp)    ──► exporter
                                 └──► ...

A delivery queue keeps a failed batch and retries it with exponential backoff
and jitter; a slow exporter only grows its own queue (bounded).  A queue with a
spool (tracker exporters by default; otel_rl.spool, docs/delivery.md) spills to
append-only files on disk when its exporter fails or falls behind, and what it
spooled survives a crash; without one, overflow drops the oldest batch (counted).
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from . import semconv as sc
from ._lightspan import LightSpan, TimeOrderedIds
from ._values import warn_once
from ._wire import pack
from .export_process.receiver import Receiver
from .exporters.base import DATA_ERRORS, is_data_error
from .records import Record, RecordBuilder, Trajectory, is_record_span, records_for

_log = logging.getLogger("otel_rl")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
#: a trajectory that opens within this long of the last one's end goes on with that stretch of rollouts
#: (`rollout_defer_s`)
_REOPEN_S = 0.05
#: while the worker leaves batches queued for open rollouts, it looks in this often (not woken by their end)
_LOOK_S = 0.05
#: while records come from the overflow, the queue gives this many items between two of its chunks
_QUEUE_TURN = 4096


class LogItem:
    # only: names of the exporters this item goes to (None: all of them)
    __slots__ = ("step", "values", "time_ns", "parent", "only")

    def __init__(self, step: int, values: dict, time_ns: int, parent: SpanContext | None,
                 only: frozenset[str] | None = None):
        self.step = step
        self.values = values
        self.time_ns = time_ns
        self.parent = parent
        self.only = only


class GenerationsItem:
    __slots__ = ("step", "rows", "time_ns", "only")

    def __init__(self, step: int, rows: list, time_ns: int, only: frozenset[str] | None = None):
        self.step = step
        self.rows = rows
        self.time_ns = time_ns
        self.only = only


class TrajectoryStat:
    """Duration/outcome of a trajectory that was not traced (kept for the metrics)."""

    __slots__ = ("duration_s", "validate", "error")

    def __init__(self, duration_s: float, validate: bool, error: bool):
        self.duration_s = duration_s
        self.validate = validate
        self.error = error


class _AddQueue:
    """Attach a delivery queue at this point of the item stream (see Pipeline.add_exporter)."""

    __slots__ = ("queue",)

    def __init__(self, queue: Any) -> None:
        self.queue = queue


class _Marker:
    # seq: records put into the pipeline's overflow before this flush request (delivered before it is done)
    __slots__ = ("event", "seq")

    def __init__(self, seq: int = 0) -> None:
        self.event = threading.Event()
        self.seq = seq


class _OverflowStart:
    """Queued after the last item that came before the overflow's first record: from here on the worker
    takes the overflow's records (older ones are all taken)."""

    __slots__ = ()


class ExporterStats:
    __slots__ = ("exported", "failed_attempts", "dropped", "retried", "queued", "in_memory", "spooled",
                 "spool_pending", "spool_bytes", "replayed", "corrupt_frames", "rejected", "shed")

    def __init__(self) -> None:
        self.exported = 0  # items delivered (records + spans)
        self.failed_attempts = 0
        self.dropped = 0  # items given up on: memory overflow without a spool, spool cap, poison batches
        self.retried = 0
        self.queued = 0  # items not delivered yet: in memory + in the spool
        self.in_memory = 0  # of which only in memory (lost if the process dies)
        self.spooled = 0  # items written to the spool (cumulative)
        self.spool_pending = 0  # items in the spool, not delivered yet
        self.spool_bytes = 0  # bytes of the spool's segment files
        self.replayed = 0  # items delivered from the spool (cumulative; part of `exported`)
        self.corrupt_frames = 0  # spool regions skipped as corrupt (checksum, torn tail, unreadable)
        self.rejected = 0  # records (or a step's points) the tracker refused as bad data, each alone
        self.shed = 0  # spans dropped from a memory queue over its bound (part of `dropped`; records never are)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


# Errors that say "this data is wrong", not "the tracker is unreachable": a batch that fails
# with one of them POISON_MAX_ATTEMPTS times in a row is dropped (counted, logged) so it cannot
# block everything behind it.  Any other error (OSError, ConnectionError, a tracker's own
# exception) is retried with backoff for as long as the process runs.
POISON_ERRORS = DATA_ERRORS
POISON_MAX_ATTEMPTS = 3


class _Entry:
    """One batch: in memory, and on disk too once it has a spool frame."""

    __slots__ = ("spans", "records", "n", "frame", "spans_done", "unspoolable", "t", "parts", "alone", "seq",
                 "prepared")

    def __init__(self, spans: list, records: list, n: int, frame: Any = None, seq: int = 0):
        self.spans = spans
        self.records = records
        self.n = n
        self.seq = seq  # the export process's batch number it came in (0: none); see oldest_unsafe_seq
        self.frame = frame  # otel_rl.spool.store.Frame once written to the spool
        self.spans_done = False  # a retry after a records failure does not resend the spans
        self.unspoolable = False  # could not be written (codec error / cap): delivered from memory only
        self.t = time.monotonic()  # when it was queued (export_interval_s counts from the oldest)
        self.parts: list[_Entry] | None = None  # a gathered batch: the batches it was made of
        self.alone = False  # split off a gathered batch that failed: delivered alone
        self.prepared = False  # handed to the exporter's `prepare` while its delivery gathered

    @staticmethod
    def gather(parts: list[_Entry]) -> _Entry:
        """One delivery made of several memory batches, in order (their spans, then their records)."""
        spans = [s for p in parts for s in p.spans]
        records = [r for p in parts for r in p.records]
        e = _Entry(spans, records, sum(p.n for p in parts), seq=parts[0].seq)
        e.t = parts[0].t
        e.parts = parts
        return e


class DeliveryQueue:
    """One exporter's batches, delivered in order on its own thread.

    With a spool (``spool=`` options or a `Spool`, or ``config=`` to derive them; see
    `otel_rl.spool.options_for` and docs/delivery.md) the in-memory queue spills to disk:
    when the exporter fails (everything in memory, then every new batch, until a delivery
    succeeds), when memory holds more than `max_items`, when `wait_idle` times out (a flush)
    and at shutdown.  Batches are always delivered oldest first: the spool's frames, then the
    memory queue.  Without a spool, an overflowing queue drops its oldest batch (counted).
    """

    remote = False  # see otel_rl.export_process.client.RemoteQueue
    adopted = False  # took over from the export process (Pipeline.adopt)

    def __init__(self, exporter: Any, max_items: int, backoff_max_s: float = 30.0, *,
                 spool: Any = None, config: Any = None, gather_s: float | None = None):
        self.exporter = exporter
        # export_interval_s: an exporter that gathers (trackers, console, JSONL) gets the batches queued within
        # this time of the oldest one in one delivery: fewer calls and transactions, the same data
        if gather_s is None:
            gather_s = float(getattr(config, "export_interval_s", 0.0) or 0.0) \
                if getattr(exporter, "gathers", False) else 0.0
        self._gather_s = max(0.0, gather_s)
        # the exporter's work ahead of a delivery, done while the delivery gathers (Exporter.prepare)
        prepare = getattr(exporter, "prepare", None)
        self._prepare = prepare if self._gather_s > 0 and callable(prepare) else None
        self._flushing = 0  # wait_idle() calls waiting: no gathering then
        self.name = exporter.name
        self.stats = ExporterStats()
        self._mem: deque[_Entry] = deque()  # memory-only batches, all newer than the spool's frames
        self._mem_items = 0
        self._current: _Entry | None = None  # the batch being delivered
        self._cond = threading.Condition()
        self._io = threading.Lock()  # spool file state; taken before _cond, never while holding it
        self._max_items = max_items
        self._backoff_max = backoff_max_s
        self._stop = False
        self._nudge = False  # wait_idle() asks for a retry now instead of at the end of the backoff
        self._failing = False  # the last attempt failed with a delivery (not a data) error
        self._spilling = 0
        self._dropped = 0  # dropped here (the spool counts its own cap drops)
        self._stalled_at = -1  # `exported` when wait_room gave up waiting for this exporter
        self._undecodable = 0
        self._spool_retry_at = 0.0
        self._drop_logged_at = 0.0
        self._spool_dropped_seen = 0
        self._left_logged = False
        self._cache: dict[tuple[int, int], _Entry] = {}  # write-through: frames still in memory
        self._cache_items = 0
        self._spool = _make_spool(spool, config, exporter)
        self._inner = getattr(exporter, "inner", exporter)  # the bridge's wrapper: the exporter it delivers to
        self._write_through = bool(self._spool is not None and self._spool.options.write_through)
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
    def put(self, spans: list, records: list, seq: int = 0) -> bool:
        """Queue one batch.  Never waits for the exporter.  Returns False only when a write-through
        queue could not write the batch to its spool (it is then kept in memory).  `seq`: the number
        of the export process's batch it came in (`oldest_unsafe_seq`)."""
        n = len(spans) + len(records)
        if not n:
            return True
        entry = _Entry(spans, records, n, seq=seq)
        with self._cond:
            self._mem.append(entry)
            self._mem_items += n
            spill = self._spool is not None and (self._write_through or self._failing or
                                                 self._mem_items > self._max_items)
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
            for e in self._mem:  # memory-only batches, oldest first (a split batch's parts at the front)
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
            _log.warning("otel-rl: exporter %r is behind; shed the %d spans of its oldest batches (queue limit %d; "
                         "records are kept)", self.name, shed, self._max_items)

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
                    warn_once(f"queue-stalled:{self.name}", "otel-rl: exporter %r delivered nothing for %.0f s with "
                              "%d items queued in memory; its records are kept there", self.name, stall_s,
                              self._mem_items)
                    return
                self._cond.wait(min(0.05, until - now))

    def _spill(self, sync: bool = False) -> bool:
        """Write the memory queue (and the batch in flight, when it is only in memory) to the spool,
        oldest first.  Any thread.  True when nothing is left only in memory."""
        sp = self._spool
        if sp is None:
            return False
        from .spool.codec import CodecError, encode_batch

        with self._io:
            with self._cond:
                cur = self._current
                anything = bool(self._mem) or (cur is not None and cur.frame is None and not cur.unspoolable)
            if not anything:
                if sync and sp.opened:
                    self._sync_spool(sp)
                return True
            ready = self._spool_ready(sp)  # may create and recover the directory: not under _cond
            with self._cond:
                if not ready:
                    self._drop_overflow()
                    self._refresh()
                    return False
                cur = self._current
                if cur is not None and cur.frame is None and not cur.unspoolable and sp.pending_frames:
                    # opening the spool just recovered older frames: the batch in flight cannot go
                    # behind them (it would be delivered twice); it stays memory-only
                    cur.unspoolable = True
                if cur is not None and (cur.frame is not None or cur.unspoolable):
                    cur = None
                todo = ([cur] if cur is not None else []) + list(self._mem)
                self._mem.clear()
                self._mem_items = 0
                self._spilling += 1
            back: list[_Entry] = []
            written = dropped = 0
            try:
                for i, e in enumerate(todo):
                    inflight = e is cur
                    try:
                        payload = encode_batch(e.spans, e.records)
                    except CodecError as exc:
                        if inflight:
                            e.unspoolable = True  # it is being delivered from memory anyway
                        else:
                            self._dropped += e.n
                            _log.error("otel-rl: exporter %r: a batch cannot be written to the spool (%s); "
                                       "dropped its %d items", self.name, exc, e.n)
                        continue
                    try:
                        frame, lost = sp.append(payload, e.n, inflight=inflight)
                    except OSError as exc:
                        back = [x for x in todo[i:] if x is not cur]
                        self._spool_retry_at = time.monotonic() + 10.0
                        warn_once(f"spool-write:{self.name}:{type(exc).__name__}",
                                  "otel-rl: exporter %r: cannot write its spool %s (%s); keeping batches in memory",
                                  self.name, sp.path, exc)
                        break
                    dropped += lost
                    if frame is None:
                        if inflight:
                            e.unspoolable = True
                        continue
                    if inflight:
                        e.frame = frame
                    elif self._write_through and self._cache_items + e.n <= self._max_items:
                        e.frame = frame
                        self._cache[(frame.seq, frame.index)] = e
                        self._cache_items += e.n
                    written += e.n
                if sync:
                    self._sync_spool(sp)
            finally:
                with self._cond:
                    self._spilling -= 1
                    if back:
                        self._mem.extendleft(reversed(back))
                        self._mem_items += sum(x.n for x in back)
                        self._drop_overflow()
                    self.stats.spooled += written
                    self._refresh()
                    self._cond.notify_all()
        if dropped:
            self._log_cap_drop()
        return not back

    def _spool_ready(self, sp: Any) -> bool:
        """Open (create) the spool if needed.  Under _io, not _cond."""
        if sp.opened:
            return True
        if time.monotonic() < self._spool_retry_at:
            return False
        from .spool import SpoolBusy

        try:
            sp.open(create=True)
        except (OSError, SpoolBusy) as exc:
            self._spool_retry_at = time.monotonic() + 10.0
            warn_once(f"spool-open:{self.name}", "otel-rl: exporter %r: cannot use the spool directory %s (%s); "
                      "queueing in memory only", self.name, sp.options.path, exc)
            return False
        return True

    def _sync_spool(self, sp: Any) -> None:
        try:
            sp.sync()
        except OSError as exc:
            warn_once(f"spool-fsync:{self.name}", "otel-rl: exporter %r: fsync of spool %s failed: %s",
                      self.name, sp.path, exc)

    def _log_cap_drop(self) -> None:
        sp = self._spool
        now = time.monotonic()
        total = sp.dropped_items
        if total == self._spool_dropped_seen or now - self._drop_logged_at < 10.0:
            return
        _log.warning("otel-rl: spool of exporter %r is full (spool_max_bytes=%d); dropped %d items so far "
                     "(spool_drop_policy=%s), %d since the last report", self.name, sp.options.max_bytes, total,
                     sp.options.drop_policy, total - self._spool_dropped_seen)
        self._spool_dropped_seen = total
        self._drop_logged_at = now

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
        st.rejected = getattr(self._inner, "rejected", 0)

    def _idle(self) -> bool:
        sp = self._spool
        return (not self._mem and self._current is None and not self._spilling and not self._recovering
                and not (sp is not None and sp.pending_frames))

    # -- delivery thread ---------------------------------------------------------------------
    def _run(self) -> None:
        self._recover()
        attempt = 0
        poison_attempts = 0
        while True:
            e = self._next_entry()
            if e is None:
                break
            try:
                if e.spans and not e.spans_done:
                    self.exporter.export_spans(e.spans)
                    e.spans_done = True
                if e.records:
                    self.exporter.export_records(e.records)
            except Exception as exc:  # the exporter failed: keep the batch, back off, retry
                self.stats.failed_attempts += 1
                warn_once(f"export-fail:{self.name}:{type(exc).__name__}",
                          "otel-rl: exporter %r failed (%s: %s); the batch is kept and retried",
                          self.name, type(exc).__name__, exc)
                poison = is_data_error(exc)
                poison_attempts = poison_attempts + 1 if poison else 0
                if poison_attempts >= POISON_MAX_ATTEMPTS and e.parts and e.frame is None:
                    # a gathered batch: find the bad one among the batches it was made of
                    self._split(e)
                    poison_attempts = attempt = 0
                    continue
                if poison_attempts >= POISON_MAX_ATTEMPTS:
                    # the same data error every time: this batch will never go through
                    _log.error("otel-rl: exporter %r rejected a batch %d times (%s: %s); dropped its %d items",
                               self.name, poison_attempts, type(exc).__name__, exc, e.n)
                    self._finish(e, delivered=False)
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
            self._finish(e, delivered=True)
        self._close()

    def _recover(self) -> None:
        """A spool directory left by an earlier process: deliver its frames first."""
        sp = self._spool
        if sp is None:
            return
        try:
            self._recover_spool(sp)
        finally:
            with self._cond:
                self._recovering = False
                self._refresh()
                self._cond.notify_all()

    def _recover_spool(self, sp: Any) -> None:
        from .spool import SpoolBusy

        with self._io:
            try:
                if not sp.opened and not sp.exists():
                    return
                if not sp.open(create=False):
                    return
            except SpoolBusy:
                return  # another live process owns it; a spill here uses a sibling directory
            except OSError as exc:
                warn_once(f"spool-open:{self.name}", "otel-rl: exporter %r: cannot read the spool %s (%s)",
                          self.name, sp.options.path, exc)
                return
        if sp.recovered_items:
            _log.warning("otel-rl: exporter %r: %d items (%d bytes) left in spool %s by an earlier process; "
                         "delivering them first", self.name, sp.recovered_items, sp.bytes, sp.path)

    def _next_entry(self) -> _Entry | None:
        """The batch to deliver next (the one in flight if any); None when stopped and idle."""
        from .spool.codec import CodecError, decode_batch

        while True:
            frame = None
            with self._io:
                with self._cond:
                    if self._current is not None:
                        return self._current
                sp = self._spool
                if sp is not None and sp.opened and sp.pending_frames:
                    frame = sp.peek()
                    if frame is not None:
                        entry = self._cache_take(frame)
                        if entry is not None:
                            with self._cond:
                                self._current = entry
                                self._refresh()
                            return entry
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
            if frame is not None:
                try:
                    spans, records = decode_batch(frame.payload)
                except CodecError as exc:
                    _log.warning("otel-rl: exporter %r: spool %s frame at %d:%d cannot be read (%s); skipped %d items",
                                 self.name, sp.path, frame.seq, frame.offset, exc, frame.n_items)
                    with self._io:
                        sp.advance(frame)
                        with self._cond:
                            self._undecodable += 1
                            self._dropped += frame.n_items
                            self._refresh()
                    continue
                entry = _Entry(spans, records, frame.n_items, frame)
                with self._cond:
                    self._current = entry
                return entry
            with self._cond:
                if self._mem or self._spilling or (sp is not None and sp.opened and sp.pending_frames):
                    continue
                if self._stop:
                    self._cond.notify_all()
                    return None
                self._cond.notify_all()  # idle: wake wait_idle()
                dirty = sp is not None and sp.opened and sp.dirty
                self._cond.wait(_SYNC_INTERVAL_S if dirty else None)
            if dirty:
                with self._io:
                    if sp.opened and sp.dirty:
                        self._sync_spool(sp)

    def _prepare_gathered(self) -> bool:
        """The exporter's `prepare` for the memory batches that have not had it (while they gather);
        whether there were any.  A failing `prepare` only costs its time: the delivery does the work."""
        with self._cond:
            todo = [e for e in self._mem if not e.prepared and e.records]
            for e in todo:
                e.prepared = True
        for e in todo:
            try:
                self._prepare(e.records)
            except Exception:
                _log.debug("otel-rl: exporter %r: prepare failed", self.name, exc_info=True)
        return bool(todo)

    def _gather_left(self) -> float:
        """Seconds the delivery thread waits for more batches before the memory queue's oldest goes
        out (0: now).  Under _cond, with batches in memory."""
        if (self._gather_s <= 0 or self._stop or self._flushing or self._mem_items >= _GATHER_MAX_ITEMS
                or self._mem[0].alone):
            return 0.0
        return self._mem[0].t + self._gather_s - time.monotonic()

    def _take_memory(self) -> _Entry:
        """The memory queue's oldest batch, gathered with the ones after it when this queue gathers
        (up to _GATHER_MAX_ITEMS; a batch split off a failed gathered one goes alone).  Under _cond."""
        entry = self._mem.popleft()
        self._mem_items -= entry.n
        if self._gather_s <= 0 or entry.alone:
            return entry
        parts = [entry]
        n = entry.n
        while self._mem and not self._mem[0].alone and n + self._mem[0].n <= _GATHER_MAX_ITEMS:
            e = self._mem.popleft()
            self._mem_items -= e.n
            n += e.n
            parts.append(e)
        return parts[0] if len(parts) == 1 else _Entry.gather(parts)

    def _split(self, e: _Entry) -> None:
        """A gathered batch that the exporter rejects as bad data: its batches go back to the front
        of the memory queue, each to be delivered (or rejected) alone."""
        with self._cond:
            for p in reversed(e.parts or []):
                p.alone = True
                p.spans_done = p.spans_done or e.spans_done
                self._mem.appendleft(p)
                self._mem_items += p.n
            self._current = None
            self._refresh()

    def _cache_take(self, frame: Any) -> _Entry | None:
        if not self._cache:
            return None
        key = (frame.seq, frame.index)
        for k in list(self._cache):  # frames before this one were dropped or skipped
            if k >= key:
                break
            self._cache_items -= self._cache.pop(k).n
        e = self._cache.pop(key, None)
        if e is not None:
            self._cache_items -= e.n
            e.frame = frame
        return e

    def _finish(self, e: _Entry, delivered: bool) -> None:
        with self._io:
            sp = self._spool
            if e.frame is not None and sp is not None:
                sp.advance(e.frame)
            with self._cond:
                self._current = None
                if delivered:
                    self.stats.exported += e.n
                    if e.frame is not None:
                        self.stats.replayed += e.n
                else:
                    self._dropped += e.n
                self._refresh()
                self._cond.notify_all()

    def _backoff(self, delay: float) -> None:
        end = time.monotonic() + delay
        sp = self._spool
        with self._cond:
            while not self._stop and not self._nudge:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, _SYNC_INTERVAL_S))
                if sp is not None and sp.opened and sp.dirty:
                    self._cond.release()
                    try:
                        with self._io:
                            if sp.opened and sp.dirty:
                                self._sync_spool(sp)
                    finally:
                        self._cond.acquire()
            self._nudge = False

    def _give_up(self) -> None:
        """Stopping while the exporter fails: the rest goes to the spool, or is dropped (counted)."""
        if self._spool is not None:
            self._spill(sync=True)
        with self._cond:
            cur = self._current
            lost = self._mem_items + (cur.n if cur is not None and cur.frame is None else 0)
            self._dropped += lost
            self._mem.clear()
            self._mem_items = 0
            self._current = None
            self._refresh()
            self._cond.notify_all()
        if lost:
            _log.warning("otel-rl: exporter %r still failing at shutdown; %d items not delivered", self.name, lost)

    def _close(self) -> None:
        sp = self._spool
        if sp is not None:
            with self._io:
                pending, nbytes, path = sp.pending_items, sp.bytes, sp.path
                if sp.opened:
                    sp.close(remove_if_empty=True)
            if pending:
                self._log_left(pending, nbytes, path)
        with self._cond:
            self._refresh()
            self._cond.notify_all()

    def _log_left(self, pending: int, nbytes: int, path: str) -> None:
        if self._left_logged:
            return
        self._left_logged = True
        _log.warning("otel-rl: exporter %r: %d items (%d bytes) kept in spool %s; they are delivered at the next "
                     "start with the same spool directory, or now with `otel-rl replay %s`",
                     self.name, pending, nbytes, path, path)

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
        sp = self._spool
        if not idle:
            if sp is not None:
                self._spill(sync=True)
            return False
        if sp is not None and sp.opened and sp.dirty:
            with self._io:
                if sp.opened:
                    self._sync_spool(sp)
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
        sp = self._spool
        if sp is not None and self._thread.is_alive():
            # the exporter is stuck in a call: make what waits durable from here
            self._spill(sync=True)
            with self._cond:
                pending = self.stats.spool_pending
            if pending:
                self._log_left(pending, sp.bytes, sp.path)


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


_SYNC_INTERVAL_S = 1.0
_GATHER_MAX_ITEMS = 20_000  # a gathered delivery holds at most this many items (spans + records)


def _make_overflow(config: Any) -> Any:
    """The spill file for records beyond `queue_size`, in the spool directory (None with the spool off)."""
    from ._overflow import Overflow
    from .spool import OFF_VALUES, default_root, safe_name

    raw = getattr(config, "spool_dir", None)
    if isinstance(raw, str) and raw.strip().lower() in OFF_VALUES:
        return None
    if raw:
        return Overflow(os.path.abspath(os.path.expanduser(raw)))
    return Overflow(os.path.join(default_root(), safe_name(str(getattr(config, "run_id", "") or "run"))))


def _make_spool(spool: Any, config: Any, exporter: Any) -> Any:
    if spool is None and config is None:
        return None
    from .spool import Spool, SpoolOptions, options_for

    if isinstance(spool, Spool):
        return spool
    try:
        opts = spool if isinstance(spool, SpoolOptions) else options_for(config, exporter)
    except (ValueError, TypeError) as exc:
        _log.warning("otel-rl: exporter %r: spool settings not usable (%s); queueing in memory only",
                     getattr(exporter, "name", "?"), exc)
        return None
    return Spool(opts) if opts is not None else None


class Pipeline:
    def __init__(self, config: Any, resource: Any, exporters: Sequence[Any], instruments: Any | None,
                 scope: InstrumentationScope, remote: Any = None, others: Any = None):
        self.config = config
        self.others = others  # span processors outside otel-rl (otel_rl._processors), fed from this thread
        self.resource = resource
        self.scope = scope
        self.instruments = instruments
        self._items: deque = deque()
        self._wake = threading.Event()
        self._batch_wake = 512
        self._max_items = config.queue_size
        self.dropped = 0
        self._ids = TimeOrderedIds()
        self._builder = RecordBuilder()
        self._takeover: Receiver | None = None
        self._resource_attrs = dict(resource.attributes) if resource is not None else {}
        self.pending_decode: dict[int, tuple] = {}
        # token2text for spans shipped packed: tokenizers that travel (pickled once) get a key; their
        # ids are decoded where the trajectories are built.  id(tokenizer) -> key, or None: decoded here
        # (the tokenizer is kept with its key, so that its id stays its own)
        self._tok_keys: dict[int, tuple[Any, int | None]] = {}
        self.tokenizers: dict[int, Any] = {}  # key -> tokenizer (also the takeover's)
        self.queues = [DeliveryQueue(e, config.queue_size, config=config) for e in exporters
                       if e.wants_records or e.wants_spans or e.wants_trajectories]
        # exporters in the export process (otel_rl.export_process): records go there in one message per batch
        self.remote = remote
        if remote is not None:
            self.queues = self.queues + list(remote.queues)
        self._stopping = False
        # rollouts: while a trajectory is open (`rollout_started` .. `rollout_ended`) the worker leaves what
        # is submitted queued, for up to `rollout_defer_s` from the first one's start (docs/configuration.md)
        self.defer_s = float(getattr(config, "rollout_defer_s", 0.0) or 0.0)
        self._defer_max_items = max(self._batch_wake, self._max_items // 2)
        self._open: deque = deque()  # one entry per open trajectory (a deque's append and pop are atomic)
        self._busy_since = 0.0
        self._last_close = -math.inf  # when the last open trajectory closed
        self._urgent_lock = threading.Lock()
        self._urgent = 0  # flush requests and added exporters queued: no deferral until they are taken
        self.deferrals = 0  # how often the worker looked in and left its batches queued for open rollouts
        # records that did not fit in `_items` (record_overflow, docs/delivery.md), and spans shed by kind
        self.record_overflow = str(getattr(config, "record_overflow", "spill") or "spill")
        self._overflow = _make_overflow(config) if self.record_overflow == "spill" else None
        self._ovf_items: deque = deque()  # records taken from the overflow, for the worker
        self._ovf_ready = False  # the worker has taken every item queued before the overflow's first record
        self._queue_turn = 0  # items the queue may give before the overflow's next chunk
        self._ovf_done = 0  # records of the overflow the worker has handled
        self._held: list[_Marker] = []  # flush requests waiting for overflow records put before them
        self.shed: dict[str, int] = {}
        if instruments is not None:
            instruments.pipeline = self  # the pipeline's own counts (shed spans, spilled records)
        self.waited = 0  # log() calls that waited for room (record_overflow=wait, or no spill file)
        self._worker = threading.Thread(target=self._run, name="otel-rl-pipeline", daemon=True)
        self._worker.start()

    # -- caller side -----------------------------------------------------------------
    def add_exporter(self, exporter: Any, first: Sequence[Any] = ()) -> None:
        """Deliver to `exporter` what is submitted from now on; `first` (records) reach it before that."""
        if not (exporter.wants_records or exporter.wants_spans or exporter.wants_trajectories):
            return
        q = DeliveryQueue(exporter, self.config.queue_size, config=self.config)  # as in __init__
        if first:
            q.put([], list(first))
        self._hurry()
        self._items.append(_AddQueue(q))  # attached by the worker, after what was submitted before
        self._wake.set()

    def adopt(self, remote: Any, exporters: Sequence[Any]) -> Receiver:
        """Replace the export process `remote` by in-process queues for `exporters` (its death).  They
        keep getting what the export process got: records, and packed spans that the returned
        `Receiver` turns into trajectories, as the export process did."""
        made = {e.name: DeliveryQueue(e, self.config.queue_size, config=self.config) for e in exporters}
        for q in made.values():
            q.adopted = True
        self._takeover = Receiver(made, tokenizers=self.tokenizers, max_chars=self.config.max_value_chars)
        self.queues = [q for q in self.queues if not q.remote] + list(made.values())
        if self.remote is remote:
            self.remote = None
        return self._takeover

    def submit(self, item: Any) -> None:
        items = self._items
        t = type(item)
        if t is LogItem or t is GenerationsItem:
            ovf = self._overflow
            if len(items) >= self._max_items or (ovf is not None and ovf.count):
                # a record: never dropped (while the overflow holds any, later ones follow them there)
                self._overflow_record(item)
                return
        elif len(items) >= self._max_items:
            if self._kind(item) == sc.KIND_METRICS:
                self._wait_for_room(item)  # a record as a span (the bridge's rl.log spans): kept too
            else:
                self._shed(item)
            return
        items.append(item)
        n = len(items)
        if n == self._batch_wake or n == self._defer_max_items:
            self._wake.set()

    @staticmethod
    def _kind(item: Any) -> str:
        if type(item) is TrajectoryStat:
            return "trajectory_stat"
        attrs = getattr(item, "_attributes", None) if type(item) is LightSpan else getattr(item, "attributes", None)
        return str((attrs or {}).get(sc.RL_SPAN_KIND) or "other")

    def _shed(self, item: Any) -> None:
        """The queue is full: a span (or a trajectory's statistics) is dropped, counted by its kind."""
        kind = self._kind(item)
        self.shed[kind] = self.shed.get(kind, 0) + 1
        self.dropped += 1
        warn_once("pipeline-full", "otel-rl: telemetry queue full (%d items); shedding spans (counted per kind in "
                  "stats()['shed']); log() records are kept (record_overflow=%s)", self._max_items, self.record_overflow)

    def _overflow_record(self, item: Any) -> None:
        ovf = self._overflow
        if ovf is not None:
            if type(item) is LogItem:
                rec = (0, item.step, item.values, item.time_ns, item.parent, item.only)
            else:
                rec = (1, item.step, item.rows, item.time_ns, None, item.only)
            kept = ovf.put(rec)
            if kept:
                if kept == 2:
                    self._items.append(_OverflowStart())  # (one item past the bound)
                    self._wake.set()
                return
        # record_overflow=wait, or the spill file cannot be written: wait for room, in order
        self._wait_for_room(item)

    def _wait_for_room(self, item: Any) -> None:
        self.waited += 1
        self._wake.set()
        items = self._items
        ovf = self._overflow
        while (len(items) >= self._max_items or (ovf is not None and ovf.count)) and self._worker.is_alive():
            time.sleep(0.001)
        items.append(item)

    def on_span_end(self, span: ReadableSpan) -> None:
        self.submit(span)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Everything submitted before this call is delivered (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        if not self._handed_over(deadline):
            return False
        return self._wait_queues(deadline)

    def _handed_over(self, deadline: float) -> bool:
        """Everything submitted before this call is in the exporters' queues (the worker got there)."""
        ovf = self._overflow
        marker = _Marker(ovf.put_total if ovf is not None else 0)
        self._hurry()
        self._items.append(marker)
        self._wake.set()
        return marker.event.wait(max(0.0, deadline - time.monotonic()))

    def _wait_queues(self, deadline: float, remote: bool = True) -> bool:
        """The queues' `wait_idle` (`remote` False: not the export process's)."""
        ok = True
        waited: set[int] = set() if remote else {id(q) for q in self.queues if getattr(q, "remote", False)}
        while True:  # an export process that dies meanwhile hands its exporters to new queues
            todo = [q for q in self.queues if id(q) not in waited]
            if not todo:
                return ok
            waited.update(id(q) for q in todo)
            ok = wait_all_idle(todo, max(0.0, deadline - time.monotonic())) and ok

    @property
    def open_rollouts(self) -> int:
        return len(self._open)

    def rollout_started(self) -> None:
        """A trajectory opened (the training thread is rolling out): see `_defer_left`.  One that opens
        within `_REOPEN_S` of the last one's end (trajectories run one after another) goes on with that
        stretch of rollouts rather than starting a new one.  No lock: two threads opening the first two
        at once may both see two open, and leave the stretch's start time at the last stretch's, which
        only ends this stretch's deferral early."""
        o = self._open
        o.append(None)
        if len(o) == 1:
            now = time.monotonic()
            if now - self._last_close > _REOPEN_S:
                self._busy_since = now

    def rollout_ended(self) -> None:
        """A trajectory closed (the worker, if it is leaving batches queued, sees the last one's end at
        its next look: `_run`)."""
        o = self._open
        try:
            o.pop()
        except IndexError:
            return
        if not o:
            self._last_close = time.monotonic()

    def _hurry(self) -> None:
        with self._urgent_lock:
            self._urgent += 1

    def _defer_left(self) -> float:
        """Seconds the worker may still leave what is queued for the open rollouts (0: take it now).
        Rollouts are where the training thread runs the most Python per second (agent loops, tools,
        detokenizing): the worker's batches (packing spans, building records, handing them to the
        exporters) would take the interpreter lock from it there.  Deferred, they run after the
        rollouts, while the training thread is mostly in torch, which leaves the lock.  Never for a
        flush, an added exporter or shutdown, nor beyond `rollout_defer_s` of one stretch of open
        rollouts, nor past half the queue."""
        if (self.defer_s <= 0 or not self._open or self._urgent or self._stopping
                or len(self._items) >= self._defer_max_items):
            return 0.0
        return self._busy_since + self.defer_s - time.monotonic()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Deliver what was submitted, within `timeout_s` overall (not per exporter)."""
        deadline = time.monotonic() + timeout_s
        # The export process is not flushed first: its stop delivers everything it was sent, as a flush
        # would, and ends each tracker run as soon as that one's data is in (one round trip, not two, and
        # no exporter waiting for another's delivery).  It is asked to stop as soon as the worker has
        # sent it the last batches; the queues here are flushed meanwhile.
        self._handed_over(deadline)
        self._stopping = True
        self._wake.set()
        self._worker.join(max(0.0, deadline - time.monotonic()))
        if self.remote is not None:
            self.remote.request_stop(max(0.0, deadline - time.monotonic()))
        self._wait_queues(deadline, remote=False)
        stopped: set[int] = set()
        while True:  # again for queues that took over from an export process dying meanwhile
            todo = [q for q in self.queues if id(q) not in stopped]
            if not todo:
                break
            for q in todo:  # all at once: a failing exporter gives up (and counts) in parallel
                q.request_stop()
            for q in todo:
                stopped.add(id(q))
                # a small floor lets a queue that was retrying make its last attempt and count the loss
                q.join(max(0.05, deadline - time.monotonic()))

    # -- worker side -----------------------------------------------------------------
    def _run(self) -> None:
        delay = self.config.batch_delay_s
        wait_s = delay
        while True:
            self._wake.wait(wait_s)
            self._wake.clear()
            wait_s = delay
            left = self._defer_left()
            if left > 0:
                # Not woken by the rollouts' end: where trajectories run one after another that would
                # take the interpreter lock from the training thread at each of them, and right after a
                # rollout comes its scoring, Python as well.  A look every `_LOOK_S` sees the last end that
                # much later at most (a flush still wakes it at once).
                self.deferrals += 1
                wait_s = min(left, _LOOK_S)
                continue
            try:
                self._drain()
                remote = self.remote
                if remote is not None:
                    remote.ship_console()
            except Exception:  # never let the worker die
                _log.exception("otel-rl: pipeline worker error")
            if self._stopping and not self._items and not self._overflow_left():
                try:
                    self._process(self._builder.flush_partial(), [])
                    if self._takeover is not None:
                        self._takeover.flush_partial()
                except Exception:
                    _log.exception("otel-rl: pipeline worker error at shutdown")
                if self._overflow is not None:
                    self._overflow.close()
                return

    def _overflow_left(self) -> bool:
        ovf = self._overflow
        return bool(self._ovf_items or self._held or (ovf is not None and ovf.count))

    def _next_item(self) -> Any:
        """The next item for the worker: the overflow's records (once everything queued before the first
        of them is taken) one chunk at a time, alternating with the queue; None when both are empty."""
        if self._ovf_items:
            return self._ovf_items.popleft()
        ovf = self._overflow
        if self._ovf_ready and ovf is not None and ovf.count and (self._queue_turn <= 0 or not self._items):
            self._queue_turn = _QUEUE_TURN  # then the queue's turn (a flush request must not wait behind a stream)
            try:
                recs, empty = ovf.take()
            except Exception:  # pragma: no cover - an unreadable spill file
                _log.exception("otel-rl: the record spill file cannot be read")
                recs, empty = [], True
            if empty:
                self._ovf_ready = False  # the next overflow starts with its own _OverflowStart
            self._ovf_items.extend(recs)
            if self._ovf_items:
                return self._ovf_items.popleft()
        if self._items:
            self._queue_turn -= 1
            return self._items.popleft()
        return None

    def _drain(self) -> None:
        while self._items or self._overflow_left():
            spans: list = []
            stats: list = []
            markers: list = []
            routed: tuple | None = None  # (span, exporter names) of an item for some exporters only
            added: _AddQueue | None = None
            empty = False
            while len(spans) < 4096:
                item = self._next_item()
                if item is None:
                    empty = True
                    break
                if type(item) is tuple:  # a record from the overflow
                    self._ovf_done += 1
                    if item[0] == 0:
                        item = LogItem(item[1], item[2], item[3], item[4], item[5])
                    else:
                        item = GenerationsItem(item[1], item[2], item[3], item[5])
                if type(item) is LightSpan or isinstance(item, ReadableSpan):
                    spans.append(item)
                elif isinstance(item, LogItem):
                    if item.only is not None:
                        routed = (self._log_span(item), item.only)
                        break  # delivered right after what came before it, to its exporters only
                    spans.append(self._log_span(item))
                elif isinstance(item, GenerationsItem):
                    if item.only is not None:
                        routed = (self._generations_span(item), item.only)
                        break
                    spans.append(self._generations_span(item))
                elif isinstance(item, TrajectoryStat):
                    stats.append(item)
                elif isinstance(item, _Marker):
                    markers.append(item)
                    self._hurried()
                    break  # deliver what came before the flush request first
                elif isinstance(item, _AddQueue):
                    added = item
                    self._hurried()
                    break  # what came before is not for the new exporter
                elif type(item) is _OverflowStart:
                    self._ovf_ready = True
            self._handle_spans(spans, stats)
            if routed is not None:
                self._process(self._builder.build([routed[0]]), [routed[0]], (), routed[1])
                others = self.others
                if others is not None and others.active:
                    others.on_end([routed[0]])
            if added is not None:
                self.queues = self.queues + [added.queue]  # a new list: flush() may be iterating the old one
            self._held.extend(markers)
            if self._held:
                # a flush request is done once the overflow records put before it are handled too
                left = [m for m in self._held if m.seq > self._ovf_done]
                for m in self._held:
                    if m.seq <= self._ovf_done:
                        m.event.set()
                self._held = left
            if empty and not self._items and not self._ovf_items and not (self._ovf_ready and self._overflow_left()):
                break  # (records waiting for their _OverflowStart, or flushes for them, come at the next look)

    def _hurried(self) -> None:
        with self._urgent_lock:
            self._urgent = max(0, self._urgent - 1)

    def _handle_spans(self, spans: list, stats: list) -> None:
        """Records from the spans of one batch, for the exporters here; the spans themselves, packed, for
        the export process (or the queues that took over from it), which builds its trajectories."""
        ship = self._ship()
        others = self.others
        feed = others is not None and others.active
        local = feed or self._local_wants_spans()
        limit = self.config.max_value_chars
        # spans that are parts of trajectories (not a log() call, a generations table, the run start)
        parts = [s for s in spans if type(s) is LightSpan or not is_record_span(s)]
        texts = {}
        jobs = None
        sids: list[int] = []
        if self.pending_decode:
            from ._token2text import decode_fields, drop, span_ids

            sids = span_ids(parts)
            if ship and not local:
                jobs = self._travelling_decodes(sids)  # decoded where the trajectories are built
            if ship or local:
                texts = decode_fields(parts, self.pending_decode, sids)  # (what is left to decode here)
            else:
                drop(parts, self.pending_decode, sids)
        wire = None
        if ship:
            if jobs:
                get = jobs.get
                wire = [pack(s, get(sid)) for s, sid in zip(parts, sids)]
            else:
                wire = [pack(s) for s in parts]
            if texts:
                from ._token2text import merge_texts

                for t in wire:
                    fields = texts.get(t[1])
                    if fields is not None:
                        merge_texts(t[6], fields, limit)
        if local:
            out = [s.readable(limit) if type(s) is LightSpan else s for s in spans]
            if texts:
                from ._token2text import with_texts

                out = [with_texts(s, texts[s.context.span_id], limit) if s.context.span_id in texts else s
                       for s in out]
            records = self._builder.build(out)
            if feed:
                others.on_end(out)
        else:
            out = [s for s in spans if type(s) is not LightSpan and is_record_span(s)]  # the record spans
            records = self._builder.build(out)
        self._process(records, out, stats, wire=wire)

    def _travelling_decodes(self, sids: list[int]) -> dict[int, tuple]:
        """The token2text jobs of the spans `sids` whose tokenizer can travel with them, as span id ->
        (tokenizer key, prompt ids, response ids); they leave `pending_decode`.  The others stay for this
        thread."""
        from ._token2text import _as_list

        pending = self.pending_decode
        jobs: dict[int, tuple] = {}
        for sid in sids:
            entry = pending.get(sid)
            if entry is None:
                continue
            key = self._tokenizer_key(entry[0])
            if key is None:
                continue
            del pending[sid]
            if len(entry) == 2:  # (tokenizer, FROM_OUTPUT): the ids travel in the op's output copy
                jobs[sid] = (key, entry[1])
                continue
            tok, p, r = entry
            try:
                jobs[sid] = (key, None if p is None else _as_list(p), None if r is None else _as_list(r))
            except Exception:  # ids that are not a sequence of ints: nothing to decode
                pass
        return jobs

    def _tokenizer_key(self, tokenizer: Any) -> int | None:
        known = self._tok_keys.get(id(tokenizer))
        if known is not None:
            return known[1]
        key = None
        try:
            import pickle

            blob = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            blob = None  # it stays: decoded in this process
        if blob is not None:
            key = len(self._tok_keys) + 1
            self.tokenizers[key] = tokenizer
            remote = self.remote
            if remote is not None:
                remote.send_tokenizer(key, blob)  # ahead of the batch that first needs it
        self._tok_keys[id(tokenizer)] = (tokenizer, key)
        return key

    def _ship(self) -> bool:
        """Whether the spans go, packed, to exporters that build their trajectories elsewhere."""
        remote = self.remote
        if remote is not None:
            return remote.wants_trajectories()
        t = self._takeover
        return t is not None and any(q.exporter.wants_trajectories for q in t.queues.values())

    def _local_wants_spans(self) -> bool:
        if self.instruments is not None:
            return True
        for q in self.queues:
            if not q.remote and not q.adopted and (q.exporter.wants_spans or q.exporter.wants_trajectories):
                return True
        return False

    def _process(self, records: list[Record], spans: list, stats: Sequence[TrajectoryStat] = (),
                 only: frozenset[str] | None = None, wire: list | None = None) -> None:
        if self.instruments is not None:
            try:
                self.instruments.update(records, spans, stats)
            except Exception:
                _log.exception("otel-rl: metric instrument update failed")
        if not records and not spans and not wire:
            return
        # trajectories for the export process (or its takeover) are built there, from `wire`
        far = [r for r in records if not isinstance(r, Trajectory)] if wire is not None else records
        remote = self.remote
        if remote is not None and (far or wire):
            names = remote.names if only is None else tuple(n for n in remote.names if n in only)
            if names:
                remote.send(far, names, wire, self._resource_attrs)
        t = self._takeover
        if t is not None and (far or wire):
            names = tuple(n for n in t.queues if only is None or n in only)
            if names:
                t.put(far, names, wire, self._resource_attrs)
        for q in self.queues:
            if only is not None and q.name not in only:
                continue
            if q.remote or q.adopted:
                continue
            exp = q.exporter
            recs = records_for(exp, records) if exp.wants_records or exp.wants_trajectories else []
            q.put(list(spans) if exp.wants_spans else [], recs)
            if recs:
                q.wait_room()  # records are not dropped: a queue over its bound holds the pipeline back

    def _new_context(self, parent: SpanContext | None) -> SpanContext:
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        return SpanContext(trace_id, self._ids.generate_span_id(), is_remote=False, trace_flags=_SAMPLED)

    def _log_span(self, item: LogItem) -> ReadableSpan:
        # every key in call order with its value as a double; ints and bools also
        # exactly, in their own typed arrays (see docs/semconv.md)
        keys = tuple(item.values)
        ik, iv, bk, bv = [], [], [], []
        for k, v in item.values.items():
            t = type(v)
            if t is int:
                ik.append(k)
                iv.append(v)
            elif t is bool:
                bk.append(k)
                bv.append(v)
        attrs: dict[str, Any] = {sc.RL_STEP: item.step, sc.RL_SPAN_KIND: sc.KIND_METRICS,
                                 sc.RL_METRICS_KEYS: keys,
                                 sc.RL_METRICS_VALUES: tuple(_as_double(v) for v in item.values.values())}
        if ik:
            attrs[sc.RL_METRICS_INT_KEYS] = tuple(ik)
            attrs[sc.RL_METRICS_INT_VALUES] = tuple(iv)
        if bk:
            attrs[sc.RL_METRICS_BOOL_KEYS] = tuple(bk)
            attrs[sc.RL_METRICS_BOOL_VALUES] = tuple(bv)
        return ReadableSpan(sc.SPAN_LOG, context=self._new_context(item.parent), parent=item.parent,
                            resource=self.resource, attributes=attrs, start_time=item.time_ns,
                            end_time=item.time_ns, instrumentation_scope=self.scope)

    def _generations_span(self, item: GenerationsItem) -> ReadableSpan:
        attrs = {
            sc.RL_STEP: item.step,
            sc.RL_SPAN_KIND: sc.KIND_METRICS,
            sc.RL_GENERATIONS_INPUTS: tuple(r[0] for r in item.rows),
            sc.RL_GENERATIONS_OUTPUTS: tuple(r[1] for r in item.rows),
            sc.RL_GENERATIONS_SCORES: tuple(r[2] for r in item.rows),
        }
        return ReadableSpan(sc.SPAN_GENERATIONS, context=self._new_context(None), resource=self.resource,
                            attributes=attrs, start_time=item.time_ns, end_time=item.time_ns,
                            instrumentation_scope=self.scope)



def _as_double(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond double range: exact value is in the int array
        return float("inf") if v > 0 else float("-inf")


def make_span_processor(pipeline: Pipeline, others: Any) -> Any:
    from opentelemetry.sdk.trace import SpanProcessor

    class _PipelineSpanProcessor(SpanProcessor):
        """Hands each ended span to the pipeline (a deque append); a start to the span processors outside
        otel-rl (their ends come from the pipeline's thread)."""

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            if others.active:
                others.on_start(span, parent_context)

        def on_end(self, span: ReadableSpan) -> None:
            pipeline.submit(span)

        def shutdown(self) -> None:
            others.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            ok = pipeline.flush(timeout_millis / 1000)
            return others.force_flush(timeout_millis) and ok

    return _PipelineSpanProcessor()


def current_span_context() -> SpanContext | None:
    ctx = trace_api.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None
