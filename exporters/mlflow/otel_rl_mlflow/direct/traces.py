"""Traces into a sqlite tracking store: MLflow's rows, one transaction per batch.

MLflow's ``log_spans`` writes each *new* trace of a batch with about forty ORM statements
(a flush per trace, a SELECT + INSERT per tag, an UPDATE per trace): about 10 ms of CPU per
trajectory on a sqlite store.  A run that traces 32 trajectories per step (verl's
``max_samples_per_step_per_worker=4`` with ``rollout.n=8``) then spends more CPU storing
traces than training.  `BulkTraceWriter` stores the same rows with one ``executemany`` per
table, 10-20x cheaper.

What it writes is derived with MLflow's own functions, the same ones ``log_spans`` calls:
``translate_span_when_storing`` and ``TraceJSONEncoder`` for each span's content,
``_get_truncated_preview`` for the request/response previews, MLflow's token-usage and cost
aggregation, its tag and trace-name validation, the artifact-location tag of the experiment.  A
span of the exporter's own attributes skips the translation where it was seen to change nothing
(`BulkTraceWriter._content`); the pure helpers called for every span or trace with values that
repeat (JSON-text parsing, the tag check) are remembered, and the artifact location is made from one
call per experiment (`BulkTraceWriter._trace_artifact_location`).  The spans come as
`otel_rl_mlflow._traces.RowSpan`s; MLflow `Span` objects are made only for MLflow's own calls.

It checks itself against MLflow before it is trusted, on the store it writes to:

- of each trajectory *shape* (span names, types, statuses, attribute keys, event names, model)
  it has not seen yet, one trace is written by MLflow (``log_spans`` + ``link_traces_to_run``);
  then the rows MLflow wrote for it, in every table that has a trace-id column, are read back
  and compared with the rows this writer computes for it.  Equal: the shape is verified and the
  other trajectories of that shape (in the same call and later) take the fast path.  Different: the fast
  path is off for the rest of the process (one warning) and MLflow writes everything;
- a trace that already exists in the store (a re-delivered batch) goes through MLflow, which
  merges it;
- stores where it is not used: anything but sqlite, MLflow's opt-in SQL trace rollups, an
  MLflow without one of the functions named above, ``OTEL_RL_MLFLOW_BULK_TRACES=false``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from . import switched_on
from .rows import ID_COLUMNS, RowMaker, Rows, compare
from .sqlite import SqliteWriter, mlflow_version, sqlite_store_path
from .translation import _shape, quick_sanitize, stored_attribute, unpriced_models_remembered, writer_translation

__all__ = [
    "ENV_BULK",
    "BulkTraceWriter",
    "Rows",
    "SqliteWriter",
    "compare",
    "enabled_by_env",
    "quick_sanitize",
    "sqlite_store_path",
    "stored_attribute",
    "unpriced_models_remembered",
    "writer_translation",
]

_log = logging.getLogger("otel_rl")

ENV_BULK = "OTEL_RL_MLFLOW_BULK_TRACES"
#: traces whose rows `prepare` keeps at most (more: they were never delivered, and are forgotten)
_AHEAD_MAX = 10_000


def enabled_by_env() -> bool:
    return switched_on(ENV_BULK)


class BulkTraceWriter(SqliteWriter, RowMaker):
    """Writes new MLflow traces of a sqlite tracking store directly (see the module doc)."""

    def __init__(self, store: Any, db_path: str, helpers: dict[str, Any]):
        SqliteWriter.__init__(self, db_path)
        RowMaker.__init__(self, store, helpers)
        self.state = "probing"  # -> "on" after a verified shape; "off" after a mismatch
        self.verified: set[Any] = set()
        self.mismatch: str | None = None
        self.fast_traces = 0  # written here
        self.mlflow_traces = 0  # written by MLflow (probes, re-deliveries, after a mismatch)
        self._id_tables: dict[str, list[str]] | None = None
        # rows computed ahead of their delivery (`prepare`): trace id -> (experiment id, run id, rows)
        self._ahead: dict[str, tuple[str, str, Rows]] = {}
        self.prepared_traces = 0  # of fast_traces, written from rows computed ahead

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def for_store(cls, store: Any) -> BulkTraceWriter | None:
        """A writer for `store`, or None when the fast path does not apply to it."""
        if not enabled_by_env():
            return None
        try:
            from mlflow.store.tracking import sqlalchemy_store as m

            db = sqlite_store_path(store)
            if db is None:
                return None
            if m.rollups_enabled():
                return None  # log_spans also queues rollup rebuilds: left to MLflow
            helpers = {
                name: getattr(m, name)
                for name in (
                    "translate_span_when_storing",
                    "TraceJSONEncoder",
                    "_span_aggregation_node",
                    "aggregate_usage_from_span_nodes",
                    "aggregate_cost_from_span_nodes",
                    "validate_session_id",
                    "_try_parse_json_string",
                    "bounded_model_dimension",
                    "finite_float_or_none",
                    "token_count_or_none",
                    "TOKEN_COLUMN_BY_KEY",
                    "COST_COLUMN_BY_KEY",
                    "_validate_trace_tag",
                    "validate_trace_name",
                    "append_to_uri_path",
                    "SpanAttributeKey",
                    "GenAiSemconvKey",
                    "TraceTagKey",
                    "TraceMetadataKey",
                    "SpansLocation",
                    "TraceState",
                    "MLFLOW_ARTIFACT_LOCATION",
                    "SqlTraceInfo",
                )
            }
            if not callable(getattr(store, "_update_trace_info_attributes", None)):
                return None
            from mlflow.entities.entity_type import EntityAssociationType
            from mlflow.utils.time import get_current_time_millis

            helpers["translate_span_when_storing"] = writer_translation(helpers["translate_span_when_storing"])
            helpers["EntityAssociationType"] = EntityAssociationType
            helpers["now_ms"] = get_current_time_millis
            default = m.SqlTraceInfo.__table__.c.db_payload_generation.server_default
            helpers["generation"] = int(str(getattr(default, "arg", "0")).strip("'\"") or 0) + 1
        except Exception as exc:  # an MLflow without these parts: MLflow writes the traces
            _log.debug("otel-rl: MLflow bulk trace writes not available: %s", exc)
            return None
        return cls(store, db, helpers)

    # -- the entry point -------------------------------------------------------------------
    def log(
        self,
        experiment_id: str,
        run_id: str,
        traces: Sequence[tuple[str, list[Any]]],
        mlflow_write: Callable[[list[Any], list[str]], None],
        max_per_call: int = 100,
    ) -> None:
        """Store `traces` ((MLflow trace id, its spans as `otel_rl_mlflow._traces.RowSpan`s) each) of one
        experiment, linked to `run_id`.
        `mlflow_write(spans, trace_ids)` is MLflow's own way (log_spans + link_traces_to_run), called
        with at most `max_per_call` traces at a time; the direct writer takes all of its traces in one
        transaction."""
        existing = self._existing([tid for tid, _ in traces])
        fast: list[tuple[str, list[Any]]] = []
        probe: list[tuple[str, list[Any], Any]] = []
        slow: list[tuple[str, list[Any]]] = []
        for tid, spans in traces:
            if tid in existing or self.state == "off":
                self._ahead.pop(tid, None)
                slow.append((tid, spans))
                continue
            if tid in self._ahead:  # its shape was verified when its rows were computed
                fast.append((tid, spans))
                continue
            shape = _shape(spans)
            if shape in self.verified:
                fast.append((tid, spans))
            else:
                probe.append((tid, spans, shape))
        if fast:
            rows, todo = Rows(), []
            for tid, spans in fast:
                ahead = self._ahead.pop(tid, None)
                if ahead is not None and ahead[0] == experiment_id and ahead[1] == run_id:
                    rows.extend(ahead[2])
                    self.prepared_traces += 1
                else:
                    todo.append((tid, spans))
            if todo:
                rows.extend(self._rows(experiment_id, run_id, todo))
            self._write(rows)
            self.fast_traces += len(fast)
        step = max(1, max_per_call)
        if probe:
            # one trace of each new shape goes through MLflow and is compared with the rows computed
            # here; the others of a shape found equal are written directly, the rest by MLflow
            first: dict[Any, tuple[str, list[Any], Any]] = {}
            later: list[tuple[str, list[Any], Any]] = []
            for item in probe:
                if item[2] in first:
                    later.append(item)
                else:
                    first[item[2]] = item
            probes = list(first.values())
            for i in range(0, len(probes), step):
                part = probes[i : i + step]
                self._by_mlflow([(tid, spans) for tid, spans, _ in part], mlflow_write)
                self._verify(experiment_id, run_id, part)
            direct: list[tuple[str, list[Any]]] = []
            for tid, spans, shape in later:
                (direct if self.state == "on" and shape in self.verified else slow).append((tid, spans))
            if direct:
                self._write(self._rows(experiment_id, run_id, direct))
                self.fast_traces += len(direct)
        for i in range(0, len(slow), step):
            self._by_mlflow(slow[i : i + step], mlflow_write)

    def prepare(self, experiment_id: str, run_id: str, traces: Sequence[tuple[str, list[Any]]]) -> None:
        """Compute the rows of `traces` (as `log` takes them) ahead of their delivery: `log` then only
        writes them.  Only traces of a verified shape, while the direct path is on; a trace that turns
        out to exist already at `log` goes through MLflow as always (its rows computed here are dropped)."""
        if self.state != "on":
            return
        if len(self._ahead) > _AHEAD_MAX:  # never delivered (dropped batches): start over
            self._ahead.clear()
        for tid, spans in traces:
            if tid in self._ahead or _shape(spans) not in self.verified:
                continue
            self._ahead[tid] = (experiment_id, run_id, self._rows(experiment_id, run_id, [(tid, spans)]))

    def _by_mlflow(
        self, traces: Sequence[tuple[str, list[Any]]], mlflow_write: Callable[[list[Any], list[str]], None]
    ) -> None:
        mlflow_write([s.mlflow() for _, spans in traces for s in spans], [tid for tid, _ in traces])
        self.mlflow_traces += len(traces)

    # -- sqlite ------------------------------------------------------------------------------
    def _existing(self, trace_ids: list[str]) -> set[str]:
        if not trace_ids:
            return set()
        with self._lock:
            con = self._connection()
            found: set[str] = set()
            for i in range(0, len(trace_ids), 500):
                part = trace_ids[i : i + 500]
                q = f"SELECT request_id FROM trace_info WHERE request_id IN ({','.join('?' * len(part))})"
                found.update(r[0] for r in con.execute(q, part))
            return found

    def _write(self, rows: Rows) -> None:
        with self._lock:
            con = self._connection()
            con.execute("BEGIN IMMEDIATE")
            try:
                for table in ("trace_info", "trace_tags", "trace_request_metadata", "spans", "entity_associations"):
                    items = rows.tables[table]
                    if not items:
                        continue
                    cols = list(items[0])
                    sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(':' + c for c in cols)})"
                    con.executemany(sql, items)
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    # -- verification ------------------------------------------------------------------------
    def _tables_with_ids(self, con: sqlite3.Connection) -> dict[str, list[str]]:
        if self._id_tables is None:
            found: dict[str, list[str]] = {}
            for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
                cols = [r[1] for r in con.execute(f"PRAGMA table_info('{table}')")]
                idc = [c for c in cols if c in ID_COLUMNS]
                if idc:
                    found[table] = idc
            self._id_tables = found
        return self._id_tables

    def stored_rows(self, trace_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Every row of the store that refers to one of `trace_ids`, per table (the verification's view)."""
        with self._lock:
            con = self._connection()
            out: dict[str, list[dict[str, Any]]] = {}
            marks = ",".join("?" * len(trace_ids))
            for table, idc in self._tables_with_ids(con).items():
                where = " OR ".join(f"{c} IN ({marks})" for c in idc)
                cur = con.execute(f"SELECT * FROM '{table}' WHERE {where}", list(trace_ids) * len(idc))
                names = [d[0] for d in cur.description]
                rows = [dict(zip(names, r)) for r in cur.fetchall()]
                if rows:
                    out[table] = rows
            return out

    def _verify(self, experiment_id: str, run_id: str, probe: Sequence[tuple[str, list[Any], Any]]) -> None:
        if self.state == "off":
            return
        try:
            ids = [tid for tid, _, _ in probe]
            expected = self._rows(experiment_id, run_id, [(tid, spans) for tid, spans, _ in probe])
            diff = compare(expected, self.stored_rows(ids))
        except Exception as exc:  # cannot tell: stay on MLflow's path
            diff = f"{type(exc).__name__}: {exc}"
        if diff is None:
            self.verified.update(shape for _, _, shape in probe)
            self.state = "on"
            return
        self.state = "off"
        self.mismatch = diff
        _log.warning(
            "otel-rl: MLflow store %s: the direct trace writer does not write what MLflow %s writes (%s); "
            "MLflow writes the traces (slower)",
            self.path,
            mlflow_version(),
            diff,
        )
