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
and jitter; a slow exporter only grows its own queue (bounded; overflow drops
the oldest batch, counted and logged).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from . import semconv as sc
from ._values import warn_once
from .records import Record, RecordBuilder, Trajectory

_log = logging.getLogger("otel_rl")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class LogItem:
    __slots__ = ("step", "values", "time_ns", "parent")

    def __init__(self, step: int, values: dict, time_ns: int, parent: SpanContext | None):
        self.step = step
        self.values = values
        self.time_ns = time_ns
        self.parent = parent


class GenerationsItem:
    __slots__ = ("step", "rows", "time_ns")

    def __init__(self, step: int, rows: list, time_ns: int):
        self.step = step
        self.rows = rows
        self.time_ns = time_ns


class TrajectoryStat:
    """Duration/outcome of a trajectory that was not traced (kept for the metrics)."""

    __slots__ = ("duration_s", "validate", "error")

    def __init__(self, duration_s: float, validate: bool, error: bool):
        self.duration_s = duration_s
        self.validate = validate
        self.error = error


class _Marker:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()


class ExporterStats:
    __slots__ = ("exported", "failed_attempts", "dropped", "retried", "queued")

    def __init__(self) -> None:
        self.exported = 0  # items delivered (records + spans)
        self.failed_attempts = 0
        self.dropped = 0
        self.retried = 0
        self.queued = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


# Errors that say "this data is wrong", not "the tracker is unreachable": a batch that fails
# with one of them POISON_MAX_ATTEMPTS times in a row is dropped (counted, logged) so it cannot
# block everything behind it.  Any other error (OSError, ConnectionError, a tracker's own
# exception) is retried with backoff for as long as the process runs.
POISON_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, NotImplementedError)
POISON_MAX_ATTEMPTS = 3


class DeliveryQueue:
    """One exporter's batches, delivered in order on its own thread."""

    def __init__(self, exporter: Any, max_items: int, backoff_max_s: float = 30.0):
        self.exporter = exporter
        self.name = exporter.name
        self.stats = ExporterStats()
        self._batches: deque[tuple[list, list]] = deque()
        self._cond = threading.Condition()
        self._max_items = max_items
        self._backoff_max = backoff_max_s
        self._stop = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=f"otel-rl-export-{self.name}", daemon=True)
        self._thread.start()

    def put(self, spans: list, records: list) -> None:
        n = len(spans) + len(records)
        if not n:
            return
        with self._cond:
            self._batches.append((spans, records))
            self.stats.queued += n
            while self.stats.queued > self._max_items and len(self._batches) > 1:
                old_s, old_r = self._batches.popleft()
                lost = len(old_s) + len(old_r)
                self.stats.queued -= lost
                self.stats.dropped += lost
                _log.warning("otel-rl: exporter %r is behind; dropped its oldest %d items (queue limit %d)",
                             self.name, lost, self._max_items)
            self._cond.notify()

    def _run(self) -> None:
        attempt = 0
        poison_attempts = 0
        spans_done: Any = None
        while True:
            with self._cond:
                while not self._batches and not self._stop:
                    self._busy = False
                    self._cond.notify_all()
                    self._cond.wait()
                if not self._batches and self._stop:
                    self._busy = False
                    self._cond.notify_all()
                    return
                spans, records = self._batches[0]
                self._busy = True
            try:
                if spans and spans_done is not spans:
                    self.exporter.export_spans(spans)
                    spans_done = spans  # a retry after a records failure does not resend the spans
                if records:
                    self.exporter.export_records(records)
            except Exception as exc:  # the exporter failed: keep the batch, back off, retry
                self.stats.failed_attempts += 1
                warn_once(f"export-fail:{self.name}:{type(exc).__name__}",
                          "otel-rl: exporter %r failed (%s: %s); the batch is kept and retried",
                          self.name, type(exc).__name__, exc)
                poison_attempts = poison_attempts + 1 if isinstance(exc, POISON_ERRORS) else 0
                with self._cond:
                    if poison_attempts >= POISON_MAX_ATTEMPTS and self._batches:
                        # the same data error every time: this batch will never go through
                        bad_s, bad_r = self._batches.popleft()
                        lost = len(bad_s) + len(bad_r)
                        self.stats.queued -= lost
                        self.stats.dropped += lost
                        _log.error("otel-rl: exporter %r rejected a batch %d times (%s: %s); dropped its %d items",
                                   self.name, poison_attempts, type(exc).__name__, exc, lost)
                        poison_attempts = 0
                        attempt = 0
                        continue
                    if self._stop:  # shutting down: give up on what is left, counted
                        lost = sum(len(s) + len(r) for s, r in self._batches)
                        self._batches.clear()
                        self.stats.queued = 0
                        self.stats.dropped += lost
                        if lost:
                            _log.warning("otel-rl: exporter %r still failing at shutdown; %d items not delivered",
                                         self.name, lost)
                        continue
                    delay = min(self._backoff_max, 0.05 * (2 ** min(attempt, 16)))
                    attempt += 1
                    self.stats.retried += 1
                    self._cond.wait(delay * (0.5 + random.random()))
                continue
            attempt = 0
            poison_attempts = 0
            with self._cond:
                if self._batches and self._batches[0][0] is spans and self._batches[0][1] is records:
                    self._batches.popleft()
                    n = len(spans) + len(records)
                    self.stats.queued -= n
                    self.stats.exported += n

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._batches or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout_s: float) -> None:
        self.wait_idle(timeout_s)
        self.request_stop()
        self._thread.join(timeout_s)

    def request_stop(self) -> None:
        """Deliver what is queued, but drop (counted) instead of retrying on failure; then end."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class Pipeline:
    def __init__(self, config: Any, resource: Any, exporters: Sequence[Any], instruments: Any | None,
                 scope: InstrumentationScope):
        self.config = config
        self.resource = resource
        self.scope = scope
        self.instruments = instruments
        self._items: deque = deque()
        self._wake = threading.Event()
        self._batch_wake = 512
        self._max_items = config.queue_size
        self.dropped = 0
        self._ids = RandomIdGenerator()
        self._builder = RecordBuilder()
        self.pending_decode: dict[int, tuple] = {}
        self.queues = [DeliveryQueue(e, config.queue_size) for e in exporters
                       if e.wants_records or e.wants_spans or e.wants_trajectories]
        self._stopping = False
        self._worker = threading.Thread(target=self._run, name="otel-rl-pipeline", daemon=True)
        self._worker.start()

    # -- caller side -----------------------------------------------------------------
    def submit(self, item: Any) -> None:
        items = self._items
        if len(items) >= self._max_items:
            self.dropped += 1
            warn_once("pipeline-full", "otel-rl: telemetry queue full (%d items); dropping new items, counted in stats()",
                      self._max_items)
            return
        items.append(item)
        if len(items) == self._batch_wake:
            self._wake.set()

    def on_span_end(self, span: ReadableSpan) -> None:
        self.submit(span)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Everything submitted before this call is delivered (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        marker = _Marker()
        self._items.append(marker)
        self._wake.set()
        if not marker.event.wait(max(0.0, deadline - time.monotonic())):
            return False
        ok = True
        for q in self.queues:
            ok = q.wait_idle(max(0.0, deadline - time.monotonic())) and ok
        return ok

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Deliver what was submitted, within `timeout_s` overall (not per exporter)."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        self._stopping = True
        self._wake.set()
        self._worker.join(max(0.0, deadline - time.monotonic()))
        for q in self.queues:  # all at once: a failing exporter gives up (and counts) in parallel
            q.request_stop()
        for q in self.queues:
            # a small floor lets a queue that was retrying make its last attempt and count the loss
            q.join(max(0.05, deadline - time.monotonic()))

    # -- worker side -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.batch_delay_s)
            self._wake.clear()
            try:
                self._drain()
            except Exception:  # never let the worker die
                _log.exception("otel-rl: pipeline worker error")
            if self._stopping and not self._items:
                try:
                    self._process(self._builder.flush_partial(), [])
                except Exception:
                    _log.exception("otel-rl: pipeline worker error at shutdown")
                return

    def _drain(self) -> None:
        while self._items:
            spans: list = []
            stats: list = []
            markers: list = []
            items = self._items
            while items and len(spans) < 4096:
                item = items.popleft()
                if isinstance(item, ReadableSpan):
                    spans.append(item)
                elif isinstance(item, LogItem):
                    spans.append(self._log_span(item))
                elif isinstance(item, GenerationsItem):
                    spans.append(self._generations_span(item))
                elif isinstance(item, TrajectoryStat):
                    stats.append(item)
                elif isinstance(item, _Marker):
                    markers.append(item)
                    break  # deliver what came before the flush request first
            if self.pending_decode:
                spans = self._token2text(spans)
            records = self._builder.build(spans)
            self._process(records, spans, stats)
            for m in markers:
                m.event.set()

    def _process(self, records: list[Record], spans: list, stats: Sequence[TrajectoryStat] = ()) -> None:
        if self.instruments is not None:
            try:
                self.instruments.update(records, spans, stats)
            except Exception:
                _log.exception("otel-rl: metric instrument update failed")
        if not records and not spans:
            return
        for q in self.queues:
            exp = q.exporter
            recs = [r for r in records if not isinstance(r, Trajectory) or exp.wants_trajectories] \
                if exp.wants_records or exp.wants_trajectories else []
            q.put(list(spans) if exp.wants_spans else [], recs)

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

    def _token2text(self, spans: list) -> list:
        from ._token2text import decode_spans

        return decode_spans(spans, self.pending_decode, self.config.max_value_chars)


def _as_double(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond double range: exact value is in the int array
        return float("inf") if v > 0 else float("-inf")


def make_span_processor(pipeline: Pipeline) -> Any:
    from opentelemetry.sdk.trace import SpanProcessor

    class _PipelineSpanProcessor(SpanProcessor):
        """Hands each ended span to the pipeline (a deque append)."""

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            return None

        def on_end(self, span: ReadableSpan) -> None:
            pipeline.submit(span)

        def shutdown(self) -> None:
            return None

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return pipeline.flush(timeout_millis / 1000)

    return _PipelineSpanProcessor()


def current_span_context() -> SpanContext | None:
    ctx = trace_api.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None
