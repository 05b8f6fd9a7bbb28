"""The MLflow exporter's trajectories: one MLflow trace each (the full span tree), linked to the run.

Three ways, by store: a local sqlite file gets the direct writer's rows (`direct.traces`); a tracking
server gets OTLP requests (`_remote`); any other store MLflow's own calls (``log_spans`` +
``link_traces_to_run``, or one trace at a time where the store has no span ingestion).  A delivery is
cut into calls (`_traces.chunks`); a failed delivery remembers how many calls went through and how it
was cut, so that its retry starts after them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from otel_rl.records import Record, Trajectory

from . import _remote, _traces
from ._run import MlflowRun, clear_server_version_cache, data_errors
from .direct import traces as direct_traces

_log = logging.getLogger("otel_rl")

MAX_TRACES_PER_CALL = 100  # MLflow MAX_TRACE_LINKS_PER_REQUEST; also near the sqlite store's sweet spot
_AHEAD_SPANS_MAX = 10_000  # trajectories whose spans `prepare` keeps at most (more: never delivered, forgotten)
MAX_SPANS_PER_CALL = 2000
MAX_BYTES_PER_CALL = 8 << 20
# with the direct sqlite writer on (direct.traces): what one transaction may hold; fewer, larger transactions
# write each index page they touch once instead of once per 100 traces
MAX_TRACES_PER_TXN = 2000
MAX_SPANS_PER_TXN = 20000
MAX_BYTES_PER_TXN = 64 << 20
CALL_LIMITS = (MAX_TRACES_PER_CALL, MAX_SPANS_PER_CALL, MAX_BYTES_PER_CALL)
TXN_LIMITS = (MAX_TRACES_PER_TXN, MAX_SPANS_PER_TXN, MAX_BYTES_PER_TXN)


class TrajectoryWriting:
    """The trajectory part of `MlflowExporter` (a mixin: the state, `_clients`, `_warn_once` and
    `_progress_key` are the exporter's)."""

    tracking_uri: str | None
    _spans: _traces.SpanBuilder | None
    _progress: dict[tuple, int]
    _chunking: dict[tuple, tuple[int, int, int]]
    _log_spans_supported: bool
    _bulk: Any
    _remote: Any
    _ahead: dict[int, list[Any]]
    runs: dict[Any, Any]

    if TYPE_CHECKING:  # the exporter's

        def _clients(self) -> tuple[Any, Any]: ...

        def _warn_once(self, key: str, msg: str, *args: Any) -> None: ...

        def _progress_key(self, part: str, records: Sequence[Any]) -> tuple: ...

    def write_trajectories(self, handle: MlflowRun, trajectories: list[Trajectory]) -> None:
        with data_errors():
            self._write_trajectories(handle, trajectories)

    def _write_trajectories(self, handle: MlflowRun, trajectories: list[Trajectory]) -> None:
        client, tracing = self._clients()
        if self._spans is None:
            self._spans = _traces.SpanBuilder()
        key = self._progress_key("traces", trajectories)
        done = self._progress.get(key, 0)
        # a retry cuts the batch as the failed attempt did (its `done` counts those chunks), even if the
        # direct writer has been turned on since
        limits = self._chunking.get(key)
        remote = self._remote_writer(tracing) if self._log_spans_supported else None
        if limits is None:
            bulk = self._bulk_writer(tracing) if self._log_spans_supported and remote is None else None
            if remote is not None:
                limits = _remote.request_limits(len(trajectories))
            else:
                limits = TXN_LIMITS if bulk is not None and bulk.state == "on" else CALL_LIMITS
        calls = _traces.chunks(trajectories, *limits)
        if remote is not None and done < len(calls):
            try:
                remote.write(handle.experiment_id, handle.run_id, calls[done:], self._row_spans)
                done = len(calls)
            except _remote.Unsupported as exc:  # the rest one trace at a time (`_log_spans`)
                done += remote.done
                self._remote = False
                self._log_spans_supported = False
                self._warn_once(
                    "no-otlp",
                    "otel-rl: the MLflow server at %s does not ingest OTLP spans (%s); logging one trace at a time",
                    self.tracking_uri,
                    exc,
                )
            except Exception:
                self._progress[key] = done + remote.done
                self._chunking[key] = limits
                raise
        for j in range(done, len(calls)):
            try:
                self._log_traces(client, tracing, handle, calls[j])
            except Exception:
                self._progress[key] = j
                self._chunking[key] = limits
                raise
        self._progress.pop(key, None)
        self._chunking.pop(key, None)

    def prepare_trajectories(self, records: Sequence[Record]) -> None:
        """While its queue gathers a delivery: the MLflow spans of its trajectories and the direct
        writer's rows for them, computed ahead, so that the delivery (and a flush at the end of a run)
        only writes them.  Only for runs already open and the direct writer on; never raises."""
        try:
            bulk = self._bulk or None
            if bulk is None or bulk.state != "on" or self._spans is None:
                return
            by_run: dict[Any, list[Trajectory]] = {}
            for r in records:
                if isinstance(r, Trajectory) and r.trace_id not in self._ahead:
                    by_run.setdefault(r.run, []).append(r)
            for ident, trajs in by_run.items():
                handle = self.runs.get(ident)
                if handle is None:
                    continue
                groups = [self._spans.spans(t) for t in trajs]
                for t, g in zip(trajs, groups):
                    self._ahead[t.trace_id] = g
                bulk.prepare(
                    handle.experiment_id,
                    handle.run_id,
                    [(_traces.mlflow_trace_id(t.trace_id), g) for t, g in zip(trajs, groups)],
                )
            if len(self._ahead) > _AHEAD_SPANS_MAX:
                self._ahead.clear()
        except Exception:  # the delivery does the work then
            _log.debug("otel-rl: MLflow exporter: preparing a delivery failed", exc_info=True)

    def _row_spans(self, t: Trajectory) -> list[_traces.RowSpan]:
        spans = self._ahead.pop(t.trace_id, None)
        if spans is None:
            assert self._spans is not None
            spans = self._spans.spans(t)
        return spans

    def _remote_writer(self, tracing: Any) -> Any:
        """The OTLP writer of a tracking server (`_remote`), or None."""
        if self._remote is None:
            try:
                on = os.environ.get(_remote.ENV_OTLP, "true").strip().lower() not in ("0", "false", "no", "off")
                self._remote = (_remote.RemoteTraceWriter.for_store(tracing.store) if on else None) or False
            except Exception:
                self._remote = False
        return self._remote or None

    def _log_traces(self, client: Any, tracing: Any, handle: MlflowRun, trajs: list[Trajectory]) -> None:
        builder = self._spans
        if builder is None:  # (made by _write_trajectories, the caller)
            builder = self._spans = _traces.SpanBuilder()
        ahead = self._ahead
        groups = [ahead.pop(t.trace_id, []) or builder.spans(t) for t in trajs]
        ids = [_traces.mlflow_trace_id(t.trace_id) for t in trajs]
        if self._log_spans_supported:
            bulk = self._bulk_writer(tracing)
            if bulk is not None:
                bulk.log(
                    handle.experiment_id,
                    handle.run_id,
                    list(zip(ids, groups)),
                    lambda spans, tids: self._log_spans(client, tracing, handle, spans, tids, trajs),
                    max_per_call=MAX_TRACES_PER_CALL,
                )
                return
        self._log_spans(client, tracing, handle, [s.mlflow() for g in groups for s in g], ids, trajs)

    def _bulk_writer(self, tracing: Any) -> Any:
        """The direct sqlite trace writer for this store (`direct.traces`), or None."""
        if self._bulk is False:
            return None
        if self._bulk is None:
            try:
                self._bulk = direct_traces.BulkTraceWriter.for_store(tracing.store) or False
            except Exception:
                self._bulk = False
        return self._bulk or None

    def _log_spans(
        self, client: Any, tracing: Any, handle: MlflowRun, spans: list[Any], ids: list[str], trajs: list[Trajectory]
    ) -> None:
        """MLflow's own way: log_spans + link_traces_to_run (one trace at a time where unsupported)."""
        if self._log_spans_supported:
            try:
                tracing.log_spans(handle.experiment_id, spans)
            except NotImplementedError as exc:
                if "could not identify MLflow server version" in str(exc):
                    # the version probe failed (server down) and MLflow caches that answer: forget it, retry
                    clear_server_version_cache()
                    raise RuntimeError(f"MLflow server unreachable: {exc}") from exc
                self._log_spans_supported = False
                self._warn_once(
                    "no-log-spans",
                    "otel-rl: the MLflow store at %s cannot ingest spans in batches (%s); logging one trace at a time",
                    self.tracking_uri,
                    exc,
                )
            else:
                client.link_traces_to_run(ids, handle.run_id)
                return
        wanted = set(ids)
        _traces.log_one_by_one(
            tracing,
            handle.experiment_id,
            handle.run_id,
            [t for t in trajs if _traces.mlflow_trace_id(t.trace_id) in wanted],
            spans,
        )
