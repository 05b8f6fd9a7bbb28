"""Shared base of the tracker exporters (MLflow, WandB, SwanLab, Weave).

A tracker exporter is a thin sink: it opens one tracker run per run identity
and maps records to the tracker's API.  This base does the part every tracker
needs the same way:

- groups a batch by run identity, in order;
- opens the run lazily (on its `RunStart` when it comes first, else on the
  first record; the config of a later `RunStart` is handed to `update_config`);
- splits the records by type and calls `write_metrics`, `write_generations`,
  `write_trajectories` once per run per batch;
- makes a retried batch idempotent: records of a batch already written are not
  written again when the batch is retried after a failure of a later part, nor
  when its queue hands it over in parts (a batch it kept rejecting as bad data);
- isolates bad data: a write that fails with a data error (`is_data_error`) is
  split in halves until the records it is about are alone, and only those are
  rejected (a step's metrics point by point: the other keys of the step go
  through), each with one warning naming it; everything else is delivered.
  Any other error (the tracker is down) goes to the queue, which retries.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..records import Generations, Record, RunIdentity, RunStart, StepMetrics, Trajectory
from .base import Exporter, is_data_error

if TYPE_CHECKING:
    from ..config import Config

#: a tracker's handle on one open run (what `open_run` returns and the other hooks are given)
RunHandle = TypeVar("RunHandle")
#: an uncaught exception's (type, value, traceback), as `sys.excepthook` is given it
ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]

_log = logging.getLogger("otel_rl")
#: rejected records logged one by one up to this many per exporter, then one line per this many more
REJECTS_LOGGED = 20
#: every tracker stores a step as a signed 64-bit int
STEP_LIMIT = 1 << 63


class TrackerExporter(Exporter, Generic[RunHandle]):
    #: the name users write in trainer.logger / trace.backend
    tracker_name: str = ""
    #: receives trajectories only when it is the configured trace backend
    traces_only_as_backend: bool = True
    #: can export trajectories at all (WandB's trace backend is Weave; SwanLab has no trace view)
    exports_trajectories: bool = True
    #: may run in the export process (``export_process``, otel_rl/export_process)
    out_of_process: bool = True
    #: ... and goes there with ``export_process=auto`` when its library is not imported at init()
    export_process_auto: bool = True
    #: deliveries gathered over `export_interval_s` (docs/delivery.md)
    gathers = True
    #: its runs record the console of the process that opened them: in the export process they get the
    #: training process's instead (`write_console`, `otel_rl._console`)
    captures_console = False
    #: console text kept for a run not open yet, at most (characters)
    console_pending_max = 1 << 20

    @classmethod
    def routing(cls, config: object) -> bool:
        """Whether an exporter of this class made with `config` takes trajectories."""
        if not cls.exports_trajectories:
            return False
        return getattr(config, "trace_backend", None) == cls.tracker_name if cls.traces_only_as_backend else True

    def __init__(self, config: Config):
        self.config = config
        self.runs: dict[RunIdentity, RunHandle] = {}
        # id(record) -> record, for the records of the batch in flight already written (or rejected),
        # kept referenced so that an id cannot be reused by a later record while it is here (a batch
        # dropped while being retried leaves its ids behind until the next batch)
        self._written: dict[int, Any] = {}
        self._inflight: Any = None  # the batch being retried; a different batch resets the progress
        self._inflight_ids: set[int] | None = None  # ids of its records, once a part of it is delivered alone
        self._points: dict[int, tuple[Any, list[StepMetrics]]] = {}  # id(record) -> its points, one per key
        self.rejected = 0  # records (or a step's points) refused by the tracker as bad data
        self.wants_trajectories = type(self).routing(config)
        # held while the training process's console output goes to a run: a plug-in that writes a run's
        # console itself (its last lines when the run closes) takes it too
        self.console_lock = threading.Lock()
        self._console_pending: list[tuple[str, str]] = []
        self._console_pending_chars = 0
        self._console_dropped = 0

    # -- to implement ----------------------------------------------------------------
    def open_run(self, run: RunIdentity, start: RunStart | None) -> RunHandle:
        raise NotImplementedError

    def update_config(self, handle: RunHandle, start: RunStart) -> None:
        return None

    def write_metrics(self, handle: RunHandle, metrics: list[StepMetrics]) -> None:
        return None

    def write_generations(self, handle: RunHandle, generations: list[Generations]) -> None:
        return None

    def write_trajectories(self, handle: RunHandle, trajectories: list[Trajectory]) -> None:
        return None

    def close_run(self, handle: RunHandle) -> None:
        return None

    def console_to_run(self, handle: RunHandle, chunks: list[tuple[str, str]]) -> None:
        """Add the training process's console output (``("stdout" | "stderr", text)`` in order) to the
        run `handle`, as the tracker's own console capture would (`captures_console` trackers)."""
        return None

    # -- console (export process) ------------------------------------------------------------
    def write_console(self, chunks: list[tuple[str, str]]) -> None:
        """The training process's console output, from the export process's main thread: to every open
        run, or kept (up to `console_pending_max` characters) for the first run to open."""
        if not self.captures_console or not chunks:
            return
        with self.console_lock:
            handles = list(self.runs.values())
            if not handles or self._console_pending:
                for stream, text in chunks:
                    if self._console_pending_chars + len(text) > self.console_pending_max:
                        self._console_dropped += len(text)
                        continue
                    self._console_pending.append((stream, text))
                    self._console_pending_chars += len(text)
                if not handles:
                    return
                chunks = self._take_console_pending()
            for h in handles:
                self.console_to_run(h, chunks)

    def _take_console_pending(self) -> list[tuple[str, str]]:
        chunks, self._console_pending, self._console_pending_chars = self._console_pending, [], 0
        if self._console_dropped:
            chunks.append(
                (
                    "stderr",
                    f"otel-rl: {self._console_dropped} characters of the training process's console "
                    f"output, printed before this run opened, are missing here (more than "
                    f"{self.console_pending_max} were waiting)\n",
                )
            )
            self._console_dropped = 0
        return chunks

    def _run_opened(self, handle: RunHandle) -> None:
        if not self._console_pending and not self._console_dropped:
            return
        with self.console_lock:
            chunks = self._take_console_pending()
            if chunks:
                self.console_to_run(handle, chunks)

    # -- machinery -------------------------------------------------------------------------
    def export_records(self, records: Sequence[Record]) -> None:
        if records is not self._inflight and (self._inflight is None or not self._part_of_inflight(records)):
            # a new batch (the previous one was delivered or given up): forget partial progress
            self._written.clear()
            self._points.clear()
            self._inflight = records
            self._inflight_ids = None
        groups: OrderedDict[RunIdentity, list[Any]] = OrderedDict()
        for r in records:
            if (
                isinstance(r, (StepMetrics, Generations))
                and not -STEP_LIMIT <= r.step < STEP_LIMIT
                and id(r) not in self._written
            ):
                # (log() refuses these; a spool of an older version or another sender may hold one)
                self.reject_record(r, ValueError("a step outside the signed 64-bit range trackers store"))
                self._written[id(r)] = r
            groups.setdefault(r.run, []).append(r)
        for ident, recs in groups.items():
            starts = [r for r in recs if isinstance(r, RunStart)]
            handle = self.runs.get(ident)
            if handle is None:
                handle = self._open_tracked(ident, starts[0] if starts else None)
                starts = starts[1:]
            for s in starts:
                self._write_isolated(handle, [s], lambda h, part: self.update_config(h, part[0]))
            parts = (
                (StepMetrics, self.write_metrics),
                (Generations, self.write_generations),
                (Trajectory, self.write_trajectories),
            )
            for cls, write in parts:
                items = [r for r in recs if isinstance(r, cls)]
                if items:
                    self._write_isolated(handle, items, write)
        if records is self._inflight:  # the whole batch is delivered (else one part of it: the rest may follow)
            self._written.clear()
            self._points.clear()
            self._inflight = None
            self._inflight_ids = None

    def _part_of_inflight(self, records: Sequence[Record]) -> bool:
        """Whether `records` are all of the batch in flight: a part of it, which its delivery queue hands over
        alone after the batch was rejected as bad data (otel_rl._isolate); what the batch's attempts wrote
        is not written again.  (The batch in flight keeps its records referenced: their ids are theirs.)"""
        ids = self._inflight_ids
        if ids is None:
            ids = self._inflight_ids = {id(r) for r in self._inflight}
        return all(id(r) in ids for r in records)

    def _open_tracked(self, ident: RunIdentity, start: RunStart | None) -> Any:
        try:
            handle = self.open_run(ident, start)
        except Exception as exc:
            if start is None or not is_data_error(exc):
                raise
            # the run's config is what the tracker refuses: open the run without it, then reject the config
            handle = self.open_run(ident, None)
            self.runs[ident] = handle
            self._run_opened(handle)
            self._write_isolated(handle, [start], lambda h, part: self.update_config(h, part[0]))
            return handle
        self.runs[ident] = handle
        self._run_opened(handle)
        if start is not None:
            self._written[id(start)] = start
        return handle

    def _write_isolated(self, handle: Any, items: list[Any], write: Any) -> None:
        """``write(handle, items)`` for the items not written yet; on a data error, halves of them until the
        bad records are alone, which are rejected (a step's metrics: point by point)."""
        written = self._written
        items = [r for r in items if id(r) not in written]
        if not items:
            return
        try:
            write(handle, items)
        except Exception as exc:
            if not is_data_error(exc):
                raise
            if len(items) > 1:
                mid = len(items) // 2
                self._write_isolated(handle, items[:mid], write)
                self._write_isolated(handle, items[mid:], write)
                return
            one = items[0]
            if isinstance(one, StepMetrics) and len(one.values) > 1:
                self._write_isolated(handle, self._split_points(one), write)
            else:
                self.reject_record(one, exc)
        for r in items:
            written[id(r)] = r

    def _split_points(self, r: StepMetrics) -> list[StepMetrics]:
        """One record per key of `r` (the same objects on a retry, so that written ones are known)."""
        known = self._points.get(id(r))
        if known is None:
            known = self._points[id(r)] = (r, [dataclasses.replace(r, values={k: v}) for k, v in r.values.items()])
        return known[1]

    def reject_record(self, r: Record, exc: BaseException) -> None:
        """Count `r` as refused by the tracker as bad data (``stats()["rejected"]``) and log it (the first
        ones each, then one in a thousand).  A plug-in that isolates bad records itself calls it for each."""
        self.rejected += 1
        n = self.rejected
        if n > REJECTS_LOGGED and n % 1000:
            return
        if isinstance(r, StepMetrics):
            what = f"metric {', '.join(map(repr, r.values))} at step {r.step}"
        elif isinstance(r, Generations):
            what = f"the generations table ({len(r.rows)} rows) at step {r.step}"
        elif isinstance(r, Trajectory):
            what = f"trajectory {r.name!r} (trace {r.trace_id:032x}) at step {r.step}"
        elif isinstance(r, RunStart):
            what = f"the config of run {r.run.run_id!r}"
        else:
            what = type(r).__name__
        more = "" if n <= REJECTS_LOGGED else f" ({n} rejected so far; not every one is logged)"
        _log.warning(
            "otel-rl: exporter %r: the tracker refused %s (%s: %s); rejected, the rest is delivered%s",
            self.name,
            what,
            type(exc).__name__,
            str(exc)[:300],
            more,
        )

    def shutdown(self) -> None:
        for handle in list(self.runs.values()):
            self.close_run(handle)
        self.runs.clear()


def flatten_config(params: Mapping[str, object] | None, sep: str = "/") -> dict[str, object]:
    """Flatten a config the way verl logs it to MLflow params.

    Nested keys are joined by `sep`; a list becomes ``list_len`` plus one key per
    index; dataclasses become dicts, paths and enums their value.
    """
    import dataclasses
    import enum
    import os

    out: dict[str, object] = {}

    def walk(prefix: str, x: Any) -> None:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            x = dataclasses.asdict(x)
        if isinstance(x, dict):
            if not x and prefix:
                out[prefix] = "{}"
            for k, v in x.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif isinstance(x, (list, tuple)):
            walk(f"{prefix}{sep}list_len" if prefix else "list_len", len(x))
            for i, v in enumerate(x):
                walk(f"{prefix}{sep}{i}" if prefix else str(i), v)
        elif isinstance(x, enum.Enum):
            out[prefix] = x.value
        elif isinstance(x, os.PathLike):
            out[prefix] = os.fspath(x)
        else:
            out[prefix] = x

    if params is not None:
        walk("", params)
    return out


# -- uncaught exceptions ----------------------------------------------------------------------------

_uncaught_hooks: list[ExceptHook] = []


def on_uncaught_exception(fn: ExceptHook) -> None:
    """Call ``fn(type, value, traceback)`` when this process ends with an uncaught exception, before the
    excepthook that was in place when the first such function was registered.  Once per function; an
    error in `fn` never masks the original one."""
    import sys

    if fn in _uncaught_hooks:
        return
    _uncaught_hooks.append(fn)
    if len(_uncaught_hooks) > 1:
        return
    previous = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        for hook in list(_uncaught_hooks):
            try:
                hook(tp, value, tb)
            except Exception:  # pragma: no cover - never mask the original error
                pass
        previous(tp, value, tb)

    sys.excepthook = excepthook


def run_failure(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> tuple[str, str] | None:
    """How an uncaught exception ends a tracker run: ("aborted" for Ctrl-C, else "crashed", the traceback).
    None in an interactive session, which goes on after it."""
    import sys
    import traceback

    if hasattr(sys, "ps1") or sys.flags.interactive:
        return None
    state = "aborted" if isinstance(tp, type) and issubclass(tp, KeyboardInterrupt) else "crashed"
    return state, "".join(traceback.format_exception(tp, value, tb))
