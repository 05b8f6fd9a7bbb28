"""Shared base of the tracker exporters (MLflow, WandB, SwanLab, Weave).

A tracker exporter is a thin sink: it opens one tracker run per run identity
and maps records to the tracker's API.  This base does the part every tracker
needs the same way:

- groups a batch by run identity, in order;
- opens the run lazily (on its `RunStart` when it comes first, else on the
  first record; the config of a later `RunStart` is handed to `update_config`);
- splits the records by type and calls `write_metrics`, `write_generations`,
  `write_trajectories` once per run per batch;
- makes a retried batch idempotent: parts of a batch already written are not
  written again when the batch is retried after a failure of a later part.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..records import Generations, RunIdentity, RunStart, StepMetrics, Trajectory
from .base import Exporter


class TrackerExporter(Exporter):
    #: the name users write in trainer.logger / trace.backend
    tracker_name: str = ""
    #: receives trajectories only when it is the configured trace backend
    traces_only_as_backend: bool = True
    #: can export trajectories at all (WandB's trace backend is Weave; SwanLab has no trace view)
    exports_trajectories: bool = True
    #: may run in the export process (``export_process``, otel_rl/_sidecar.py)
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
    def routing(cls, config: Any) -> bool:
        """Whether an exporter of this class made with `config` takes trajectories."""
        if not cls.exports_trajectories:
            return False
        return getattr(config, "trace_backend", None) == cls.tracker_name if cls.traces_only_as_backend else True

    def __init__(self, config: Any):
        self.config = config
        self.runs: dict[RunIdentity, Any] = {}
        # (id(batch part), part) already delivered -> the part's record, kept referenced so that
        # its id cannot be reused by a later record while the key is here (a batch dropped
        # while being retried leaves its keys behind until the next delivered batch)
        self._written: dict[tuple[int, str], Any] = {}
        self._inflight: Any = None  # the batch being retried; a different batch resets the progress
        self.wants_trajectories = type(self).routing(config)
        self._console_lock = threading.Lock()
        self._console_pending: list[tuple[str, str]] = []
        self._console_pending_chars = 0
        self._console_dropped = 0

    # -- to implement ----------------------------------------------------------------
    def open_run(self, run: RunIdentity, start: RunStart | None) -> Any:
        raise NotImplementedError

    def update_config(self, handle: Any, start: RunStart) -> None:
        return None

    def write_metrics(self, handle: Any, metrics: list[StepMetrics]) -> None:
        return None

    def write_generations(self, handle: Any, generations: list[Generations]) -> None:
        return None

    def write_trajectories(self, handle: Any, trajectories: list[Trajectory]) -> None:
        return None

    def close_run(self, handle: Any) -> None:
        return None

    def console_to_run(self, handle: Any, chunks: list[tuple[str, str]]) -> None:
        """Add the training process's console output (``("stdout" | "stderr", text)`` in order) to the
        run `handle`, as the tracker's own console capture would (`captures_console` trackers)."""
        return None

    # -- console (export process) ------------------------------------------------------------
    def write_console(self, chunks: list[tuple[str, str]]) -> None:
        """The training process's console output, from the export process's main thread: to every open
        run, or kept (up to `console_pending_max` characters) for the first run to open."""
        if not self.captures_console or not chunks:
            return
        with self._console_lock:
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
            chunks.append(("stderr", f"otel-rl: {self._console_dropped} characters of the training process's console "
                                     f"output, printed before this run opened, are missing here (more than "
                                     f"{self.console_pending_max} were waiting)\n"))
            self._console_dropped = 0
        return chunks

    def _run_opened(self, handle: Any) -> None:
        if not self._console_pending and not self._console_dropped:
            return
        with self._console_lock:
            chunks = self._take_console_pending()
            if chunks:
                self.console_to_run(handle, chunks)

    # -- machinery -------------------------------------------------------------------------
    def export_records(self, records: Sequence[Any]) -> None:
        if records is not self._inflight:
            # a new batch (the previous one was delivered or given up): forget partial progress
            self._written.clear()
            self._inflight = records
        groups: OrderedDict[RunIdentity, list[Any]] = OrderedDict()
        for r in records:
            groups.setdefault(r.run, []).append(r)
        for ident, recs in groups.items():
            starts = [r for r in recs if isinstance(r, RunStart)]
            handle = self.runs.get(ident)
            if handle is None:
                handle = self.runs[ident] = self.open_run(ident, starts[0] if starts else None)
                starts = starts[1:]
                self._run_opened(handle)
            for s in starts:
                self._once(s, "config", lambda s=s: self.update_config(handle, s))
            parts = (
                ("metrics", StepMetrics, self.write_metrics),
                ("generations", Generations, self.write_generations),
                ("trajectories", Trajectory, self.write_trajectories),
            )
            for label, cls, write in parts:
                items = [r for r in recs if isinstance(r, cls)]
                if items:
                    self._once(items[0], label, lambda w=write, i=items: w(handle, i))
        self._written.clear()  # the whole batch is delivered
        self._inflight = None

    def _once(self, key_obj: Any, label: str, fn: Any) -> None:
        key = (id(key_obj), label)
        if key in self._written:
            return
        fn()
        self._written[key] = key_obj

    def shutdown(self) -> None:
        for handle in list(self.runs.values()):
            self.close_run(handle)
        self.runs.clear()


def flatten_config(params: Any, sep: str = "/") -> dict[str, Any]:
    """Flatten a config the way verl logs it to MLflow params.

    Nested keys are joined by `sep`; a list becomes ``list_len`` plus one key per
    index; dataclasses become dicts, paths and enums their value.
    """
    import dataclasses
    import enum
    import os

    out: dict[str, Any] = {}

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

_uncaught_hooks: list[Any] = []


def on_uncaught_exception(fn: Any) -> None:
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

    def excepthook(tp: Any, value: Any, tb: Any) -> None:
        for hook in list(_uncaught_hooks):
            try:
                hook(tp, value, tb)
            except Exception:  # pragma: no cover - never mask the original error
                pass
        previous(tp, value, tb)

    sys.excepthook = excepthook


def run_failure(tp: Any, value: Any, tb: Any) -> tuple[str, str] | None:
    """How an uncaught exception ends a tracker run: ("aborted" for Ctrl-C, else "crashed", the traceback).
    None in an interactive session, which goes on after it."""
    import sys
    import traceback

    if hasattr(sys, "ps1") or sys.flags.interactive:
        return None
    state = "aborted" if isinstance(tp, type) and issubclass(tp, KeyboardInterrupt) else "crashed"
    return state, "".join(traceback.format_exception(tp, value, tb))
