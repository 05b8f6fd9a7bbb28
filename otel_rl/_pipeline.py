"""The export pipeline: caller threads enqueue, one worker turns spans into records and hands them to
one delivery queue per exporter (otel_rl._delivery).

Caller-side cost is a deque append (plus, for `log()`, the value coercion done
before it).  Everything else happens here, off the training thread:

    submit() ──► deque ──► pipeline worker: log items → spans, materialise,
                                            spans → records, instruments
                                 │
                                 ├──► DeliveryQueue(console) ──► exporter
                                 ├──► DeliveryQueue(otlp)    ──► exporter
                                 └──► ...

Every span the worker gets is a `ReadableSpan`: otel-rl's light spans (otel_rl._lightspan), whose
deferred work (the ops' copies, token2text jobs) it does before anything outside otel-rl reads them
(`materialise`), or leaves to the export process along with the spans; and the SDK's own spans.
The worker's collaborators: the item types it takes (otel_rl._items), the rollout deferral that
leaves its batches queued while trajectories are open (otel_rl._rollouts), the tokenizers of the
token2text jobs that travel to the export process (otel_rl._token2text.DecodeJobs), and the record
overflow file that takes `log()` records beyond the queue's bound (otel_rl._overflow).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from . import semconv as sc
from ._delivery import DeliveryQueue, wait_all_idle
from ._items import (
    AddQueue,
    FlushMarker,
    GenerationsItem,
    LogItem,
    OverflowStart,
    TrajectoryStat,
    generations_span,
    log_span,
)
from ._lightspan import _new_context, materialise, new_span_id, new_trace_id
from ._rollouts import RolloutDeferral
from ._token2text import DecodeJobs
from ._values import warn_once
from ._wire import pack
from .export_process.receiver import Receiver
from .records import Record, RecordBuilder, Trajectory, is_record_span, records_for

_log = logging.getLogger("otel_rl")
#: while the worker leaves batches queued for open rollouts, it looks in this often (not woken by their end)
_LOOK_S = 0.05
#: while records come from the overflow, the queue gives this many items between two of its chunks
_QUEUE_TURN = 4096


def make_overflow(config: Any) -> Any:
    """The spill file for records beyond `queue_size`, in the spool directory (None with the spool off)."""
    from ._overflow import Overflow
    from .spool import OFF_VALUES, default_root, safe_name

    raw = getattr(config, "spool_dir", None)
    if isinstance(raw, str) and raw.strip().lower() in OFF_VALUES:
        return None
    if raw:
        return Overflow(os.path.abspath(os.path.expanduser(raw)))
    return Overflow(os.path.join(default_root(), safe_name(str(getattr(config, "run_id", "") or "run"))))


class Pipeline:
    def __init__(
        self,
        config: Any,
        resource: Any,
        exporters: Sequence[Any],
        instruments: Any | None,
        scope: InstrumentationScope,
        remote: Any = None,
        others: Any = None,
        builder: RecordBuilder | None = None,
    ):
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
        self._builder = builder if builder is not None else RecordBuilder()
        # the builder and the queues' order of records: the worker's, or a caller's of `build_now`
        self._build_lock = threading.Lock()
        self._takeover: Receiver | None = None
        self._resource_attrs = dict(resource.attributes) if resource is not None else {}
        self.decodes = DecodeJobs()  # the tokenizers of token2text jobs that travel with their spans
        self.queues = [
            DeliveryQueue(e, config.queue_size, config=config)
            for e in exporters
            if e.wants_records or e.wants_spans or e.wants_trajectories
        ]
        # exporters in the export process (otel_rl.export_process): records go there in one message per batch
        self.remote = remote
        if remote is not None:
            self.queues = self.queues + list(remote.queues)
        self._stopping = False
        # rollouts: while a trajectory is open (`rollouts.started` .. `ended`) the worker leaves what
        # is submitted queued, for up to `rollout_defer_s` from the first one's start (docs/configuration.md)
        self.rollouts = RolloutDeferral(float(getattr(config, "rollout_defer_s", 0.0) or 0.0))
        self._defer_max_items = max(self._batch_wake, self._max_items // 2)
        self._urgent_lock = threading.Lock()
        self._urgent = 0  # flush requests and added exporters queued: no deferral until they are taken
        # records that did not fit in `_items` (record_overflow, docs/delivery.md), and spans shed by kind
        self.record_overflow = str(getattr(config, "record_overflow", "spill") or "spill")
        self._overflow = make_overflow(config) if self.record_overflow == "spill" else None
        self._ovf_items: deque = deque()  # records taken from the overflow, for the worker
        self._ovf_ready = False  # the worker has taken every item queued before the overflow's first record
        self._queue_turn = 0  # items the queue may give before the overflow's next chunk
        self._ovf_done = 0  # records of the overflow the worker has handled
        self._held: list[FlushMarker] = []  # flush requests waiting for overflow records put before them
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
        self._items.append(AddQueue(q))  # attached by the worker, after what was submitted before
        self._wake.set()

    def adopt(self, remote: Any, exporters: Sequence[Any]) -> Receiver:
        """Replace the export process `remote` by in-process queues for `exporters` (its death).  They
        keep getting what the export process got: records, and packed spans that the returned
        `Receiver` turns into trajectories, as the export process did."""
        made = {e.name: DeliveryQueue(e, self.config.queue_size, config=self.config) for e in exporters}
        for q in made.values():
            q.adopted = True
        self._takeover = Receiver(made, tokenizers=self.decodes.tokenizers, max_chars=self.config.max_value_chars)
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

    def build_now(self, spans: Sequence[ReadableSpan]) -> None:
        """Records from `spans` (received ones, in order) built on the calling thread and put in the exporters'
        queues, instead of by the worker: the bridge builds a request's spans on the thread that decoded
        them, while they are in that core's cache, with no hand-over to another thread.  The queues are not
        waited on here (`DeliveryQueue.wait_room`): a caller refuses new work while they are behind, as the
        bridge does.  An error is logged, never raised (the caller is answering a sender)."""
        try:
            with self._build_lock:
                self._handle_spans(list(spans), [], wait=False)
        except Exception:
            _log.exception("otel-rl: error while building records")

    @staticmethod
    def _kind(item: Any) -> str:
        if type(item) is TrajectoryStat:
            return "trajectory_stat"
        attrs = item.attributes if isinstance(item, ReadableSpan) else None
        return str((attrs or {}).get(sc.RL_SPAN_KIND) or "other")

    def _shed(self, item: Any) -> None:
        """The queue is full: a span (or a trajectory's statistics) is dropped, counted by its kind."""
        kind = self._kind(item)
        self.shed[kind] = self.shed.get(kind, 0) + 1
        self.dropped += 1
        warn_once(
            "pipeline-full",
            "otel-rl: telemetry queue full (%d items); shedding spans (counted per kind in "
            "stats()['shed']); log() records are kept (record_overflow=%s)",
            self._max_items,
            self.record_overflow,
        )

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
                    self._items.append(OverflowStart())  # (one item past the bound)
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
        marker = FlushMarker(ovf.put_total if ovf is not None else 0)
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

    def _hurry(self) -> None:
        with self._urgent_lock:
            self._urgent += 1

    def _defer_left(self) -> float:
        """Seconds the worker may still leave what is queued for the open rollouts (0: take it now;
        otel_rl._rollouts says why).  Never for a flush, an added exporter or shutdown, nor beyond
        `rollout_defer_s` of one stretch of open rollouts, nor past half the queue."""
        if self._urgent or self._stopping or len(self._items) >= self._defer_max_items:
            return 0.0
        return self.rollouts.left()

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
                self.rollouts.deferrals += 1
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
                    with self._build_lock:
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
            added: AddQueue | None = None
            empty = False
            items = self._items
            while len(spans) < 4096:
                if items and not self._ovf_ready and not self._ovf_items:
                    item = items.popleft()  # (what `_next_item` gives while no overflow is being read)
                    self._queue_turn -= 1
                    if type(item) is ReadableSpan:
                        spans.append(item)  # (an SDK span: one that other tracers ended)
                        continue
                else:
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
                if isinstance(item, ReadableSpan):
                    spans.append(item)
                elif isinstance(item, (LogItem, GenerationsItem)):
                    span = self._record_span(item)
                    if item.only is not None:
                        routed = (span, item.only)
                        break  # delivered right after what came before it, to its exporters only
                    spans.append(span)
                elif isinstance(item, TrajectoryStat):
                    stats.append(item)
                elif isinstance(item, FlushMarker):
                    markers.append(item)
                    self._hurried()
                    break  # deliver what came before the flush request first
                elif isinstance(item, AddQueue):
                    added = item
                    self._hurried()
                    break  # what came before is not for the new exporter
                elif type(item) is OverflowStart:
                    self._ovf_ready = True
            with self._build_lock:
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

    def _record_span(self, item: LogItem | GenerationsItem) -> ReadableSpan:
        """The `rl.log` / `rl.generations` span of `item`, started and ended here (the span processors
        outside otel-rl see it start on this thread)."""
        if isinstance(item, LogItem):
            parent = item.parent
            ctx = _new_context(parent.trace_id if parent is not None else new_trace_id(), new_span_id())
            span = log_span(item, ctx, self.resource, self.scope)
        else:
            span = generations_span(item, _new_context(new_trace_id(), new_span_id()), self.resource, self.scope)
        others = self.others
        if others is not None and others.active:
            others.on_start(span)
        return span

    def _handle_spans(self, spans: list, stats: list, wait: bool = True) -> None:
        """Records from the spans of one batch, for the exporters here; the spans themselves, packed, for
        the export process (or the queues that took over from it), which builds its trajectories.  A span
        is materialised before anything here reads it; those that travel only are materialised there."""
        ship = self._ship()
        others = self.others
        feed = others is not None and others.active
        local = feed or self._local_wants_spans()
        limit = self.config.max_value_chars
        wire = None
        if ship:
            # the parts of trajectories (not a log() call, a generations table, the run start)
            parts = [s for s in spans if not is_record_span(s)]
            jobs = None
            if local:
                materialise(spans, limit)  # for the consumers here; the spans travel materialised
            else:
                jobs = self.decodes.travelling(parts, self.remote)  # decoded where the trajectories are built
                materialise([s for s in parts if getattr(s, "_decode", None) is not None], limit)  # the others
            wire = [pack(s) for s in parts] if jobs is None else [pack(s, j) for s, j in zip(parts, jobs)]
        if local:
            if not ship:
                materialise(spans, limit)
            out = spans
            records = self._builder.build(out)
            if feed:
                others.on_end(out)
        else:
            out = [s for s in spans if is_record_span(s)]  # the record spans
            records = self._builder.build(out)
        self._process(records, out, stats, wire=wire, wait=wait)

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

    def _process(
        self,
        records: list[Record],
        spans: list,
        stats: Sequence[TrajectoryStat] = (),
        only: frozenset[str] | None = None,
        wire: list | None = None,
        wait: bool = True,
    ) -> None:
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
            if recs and wait:
                q.wait_room()  # records are not dropped: a queue over its bound holds the pipeline back


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
