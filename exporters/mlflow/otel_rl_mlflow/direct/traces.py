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

import base64
import json
import logging
import os
import re
import sqlite3
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from otel_rl import semconv as sc

from .. import _traces
from . import switched_on

_log = logging.getLogger("otel_rl")

ENV_BULK = "OTEL_RL_MLFLOW_BULK_TRACES"
#: columns that hold a trace id: rows keyed by one of them are compared at verification
_ID_COLUMNS = ("request_id", "trace_id", "source_id", "destination_id")
#: entity_associations columns MLflow fills with a fresh uuid / the current time
_VOLATILE = {"entity_associations": ("association_id", "created_time")}
#: traces whose rows `prepare` keeps at most (more: they were never delivered, and are forgotten)
_AHEAD_MAX = 10_000
#: entries each memo of MLflow's pure helpers keeps at most (`BulkTraceWriter._parsed`, `._validate_tag`)
_MEMO_MAX = 4096
_HEX = re.compile(r"[0-9a-f]{32}")


class _Stub:
    """What ``SqlAlchemyStore._update_trace_info_attributes`` reads of a new trace info."""

    request_preview = None
    response_preview = None


class Rows:
    """The rows of some traces, per table, as column -> value dicts."""

    __slots__ = ("tables",)

    def __init__(self) -> None:
        self.tables: dict[str, list[dict[str, Any]]] = {
            "trace_info": [],
            "trace_tags": [],
            "trace_request_metadata": [],
            "spans": [],
            "entity_associations": [],
        }

    def extend(self, other: Rows) -> None:
        for table, rows in other.tables.items():
            self.tables[table].extend(rows)


def enabled_by_env() -> bool:
    return switched_on(ENV_BULK)


def sqlite_store_path(store: Any) -> str | None:
    """The local sqlite file of an MLflow ``SqlAlchemyStore``; None for other stores, in-memory or missing files."""
    from mlflow.store.tracking import sqlalchemy_store as m

    if not isinstance(store, m.SqlAlchemyStore) or store.db_type != "sqlite":
        return None
    db = store.engine.url.database
    if not db or db == ":memory:" or not os.path.exists(db):
        return None
    return os.path.abspath(db)


class SqliteWriter:
    """A direct writer's own connection to a sqlite store file (autocommit; transactions are explicit)."""

    def __init__(self, db_path: str):
        self.path = db_path
        self._con: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        if self._con is None:
            self._con = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
            # room for a large transaction's pages: with sqlite's default 2 MiB cache, a transaction of a
            # few thousand spans spills pages to the database file before its commit (more syncs, pages
            # written twice)
            self._con.execute("PRAGMA cache_size=-32768")
        return self._con

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                try:
                    self._con.close()
                except sqlite3.Error:
                    pass
                self._con = None


class BulkTraceWriter(SqliteWriter):
    """Writes new MLflow traces of a sqlite tracking store directly (see the module doc)."""

    def __init__(self, store: Any, db_path: str, helpers: dict[str, Any]):
        super().__init__(db_path)
        self.store = store
        self.h = helpers
        self.state = "probing"  # -> "on" after a verified shape; "off" after a mismatch
        self.verified: set[Any] = set()
        self.mismatch: str | None = None
        self.fast_traces = 0  # written here
        self.mlflow_traces = 0  # written by MLflow (probes, re-deliveries, after a mismatch)
        self._locations: dict[str, Callable[[str], str]] = {}  # experiment id -> `_trace_artifact_location`
        self._parse_memo: dict[str, Any] = {}  # `_parsed`
        self._tag_memo: dict[tuple[str, str], Any] = {}  # `_validate_tag`
        self._id_tables: dict[str, list[str]] | None = None
        # rows computed ahead of their delivery (`prepare`): trace id -> (experiment id, run id, rows)
        self._ahead: dict[str, tuple[str, str, Rows]] = {}
        self.prepared_traces = 0  # of fast_traces, written from rows computed ahead
        # span signature (`_signature`) -> whether MLflow's translation leaves such spans as they are
        self._unchanged: dict[tuple, bool] = {}
        self.untranslated_spans = 0  # spans whose content was taken as it is (see `_content`)
        # the models MLflow's cost lookup found no price for (filled as the translation runs)
        self._unpriced: set[str] = getattr(helpers["translate_span_when_storing"], "unpriced", set())

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

    # -- rows --------------------------------------------------------------------------------
    def _rows(self, experiment_id: str, run_id: str, traces: Sequence[tuple[str, list[Any]]]) -> Rows:
        h = self.h
        out = Rows()
        key = h["SpanAttributeKey"]
        tag_key = h["TraceTagKey"]
        translate = h["translate_span_when_storing"]
        encoder = h["TraceJSONEncoder"]
        node = h["_span_aggregation_node"]
        parse = h["_try_parse_json_string"]
        bounded = h["bounded_model_dimension"]
        finite = h["finite_float_or_none"]
        count = h["token_count_or_none"]
        validate_tag = self._validate_tag
        text_of = self._parsed
        exp_int = int(experiment_id)
        artifact_location = self._trace_artifact_location(experiment_id)
        prefix = key.TRACE_TAG_PREFIX
        now = h["now_ms"]()
        state = h["TraceState"]
        for tid, spans in traces:
            min_start_ms = min(s.start_ns for s in spans) // 1_000_000
            ends = [s.end_ns for s in spans if s.end_ns is not None]
            max_end_ms = max(ends) // 1_000_000 if ends else None
            root = next((s for s in spans if s.parent_span_id is None), None)  # as MLflow reads the status
            root_status = (
                None if root is None else (state.ERROR.value if root.status_code == "ERROR" else state.OK.value)
            )
            usage_nodes, cost_nodes = [], []
            session_id = user_id = root_dict = None
            user_tags: dict[str, str] = {}
            for span in spans:
                d = self._content(span, translate)
                if d is None:
                    m = span.mlflow()
                    d = translate(m)
                    sid, pid, stype = m.span_id, m.parent_id, m.span_type
                    status = _status_text(m.status.status_code)
                    content = json.dumps(d, cls=encoder, ensure_ascii=False)
                else:
                    sid = "%016x" % span.span_id
                    pid = None if span.parent_span_id is None else "%016x" % span.parent_span_id
                    stype = text_of(d["attributes"][_SPAN_TYPE])
                    status = span.status_code
                    content = _plain_dumps(d)  # only JSON types in it: what TraceJSONEncoder gives
                attrs = d.get("attributes", {})
                usage_nodes.append(node(sid, pid, attrs, key.CHAT_USAGE))
                cost_nodes.append(node(sid, pid, attrs, key.LLM_COST))
                span_cost = None
                if attrs:
                    if session_id is None and (
                        sess := (attrs.get(key.SESSION_ID) or attrs.get(h["GenAiSemconvKey"].CONVERSATION_ID))
                    ):
                        session_id = h["validate_session_id"](parse(sess))
                    if user_id is None and (uid := attrs.get("user.id")):
                        user_id = parse(uid)
                    span_cost = attrs.get(key.LLM_COST)
                costs: dict[str, Any] = {}
                if span_cost:
                    try:
                        costs = json.loads(span_cost)
                    except (TypeError, ValueError):
                        costs = {}
                out.tables["spans"].append(
                    {
                        "trace_id": tid,
                        "experiment_id": exp_int,
                        "span_id": sid,
                        "parent_span_id": pid,
                        "name": d["name"],
                        "type": stype,
                        "status": status,
                        "start_time_unix_nano": d["start_time_unix_nano"],
                        "end_time_unix_nano": d["end_time_unix_nano"],
                        "content": content,
                        "input_cost": finite(costs.get("input_cost")),
                        "output_cost": finite(costs.get("output_cost")),
                        "total_cost": finite(costs.get("total_cost")),
                        "model_name": bounded(text_of(attrs.get(key.MODEL))),
                        "model_provider": bounded(text_of(attrs.get(key.MODEL_PROVIDER))),
                    }
                )
                if pid is None:
                    root_dict = d
                    for k, v in attrs.items():
                        if k.startswith(prefix):
                            tk, tv = k[len(prefix) :], str(text_of(v))
                            try:
                                tk, tv = validate_tag(tk, tv)
                            except Exception:
                                continue
                            if tk == tag_key.TRACE_NAME:
                                tv = h["validate_trace_name"](tv)
                            user_tags[tk] = tv
            status = root_status or h["TraceState"].IN_PROGRESS.value
            info: dict[str, Any] = {
                "request_id": tid,
                "experiment_id": exp_int,
                "timestamp_ms": min_start_ms,
                "execution_time_ms": (max_end_ms - min_start_ms) if max_end_ms else None,
                "status": status,
                "client_request_id": None,
                "request_preview": None,
                "response_preview": None,
                "db_payload_generation": h["generation"],
                "trace_name": user_tags.get(tag_key.TRACE_NAME),
                "session_id": session_id,
            }
            for column in h["TOKEN_COLUMN_BY_KEY"].values():
                info[column] = None
            for column in h["COST_COLUMN_BY_KEY"].values():
                info[column] = None
            if root_dict is not None:
                for col, value in self.store._update_trace_info_attributes(_Stub(), root_dict).items():
                    info[getattr(col, "key", str(col))] = value
            usage = h["aggregate_usage_from_span_nodes"](usage_nodes) or {}
            for k, column in h["TOKEN_COLUMN_BY_KEY"].items():
                if usage and (v := count(usage.get(k))) is not None:
                    info[column] = v
            cost = h["aggregate_cost_from_span_nodes"](cost_nodes) or {}
            for k, column in h["COST_COLUMN_BY_KEY"].items():
                if cost and (v := finite(cost.get(k))) is not None:
                    info[column] = v
            out.tables["trace_info"].append(info)
            tags = {
                h["MLFLOW_ARTIFACT_LOCATION"]: artifact_location(tid),
                tag_key.SPANS_LOCATION: h["SpansLocation"].TRACKING_STORE.value,
            }
            # (log_spans also stores the OTel resource attributes of the spans as tags: the exporter's
            # MLflow spans have none, see otel_rl_mlflow._traces.SpanBuilder)
            for k, v in user_tags.items():
                if k != tag_key.TRACE_NAME:
                    tags[k] = v
            out.tables["trace_tags"].extend({"key": k, "value": v, "request_id": tid} for k, v in tags.items())
            if user_id:
                out.tables["trace_request_metadata"].append(
                    {"key": h["TraceMetadataKey"].TRACE_USER, "value": user_id, "request_id": tid}
                )
            et = h["EntityAssociationType"]
            out.tables["entity_associations"].append(
                {
                    "association_id": uuid.uuid4().hex,
                    "source_type": et.TRACE,
                    "source_id": tid,
                    "destination_type": et.RUN,
                    "destination_id": run_id,
                    "created_time": now,
                }
            )
        return out

    def _trace_artifact_location(self, experiment_id: str) -> Callable[[str], str]:
        """trace id -> the artifact location MLflow gives a trace of experiment `experiment_id`
        (``append_to_uri_path(<its artifact location>, "traces", <trace id>, "artifacts")``): MLflow's
        function called once per experiment with a stand-in id, whose place in the result the real ids
        take (ids of the writer's own form, ``tr-`` and hex digits, which the function leaves as they
        are); any other id, or a result without exactly one stand-in, goes to the function itself."""
        cached = self._locations.get(experiment_id)
        if cached is not None:
            return cached
        append = self.h["append_to_uri_path"]
        root = self.store.get_experiment(experiment_id).artifact_location
        stand_in = "tr-" + "0" * 32
        try:
            parts = append(root, "traces", stand_in, "artifacts").split(stand_in)
        except Exception:
            parts = []
        head, end = (parts[0], parts[1]) if len(parts) == 2 else (None, "")

        def made(tid: str) -> str:
            if head is not None and len(tid) == 35 and tid.startswith("tr-") and _HEX.fullmatch(tid, 3):
                return head + tid + end
            return append(root, "traces", tid, "artifacts")

        self._locations[experiment_id] = made
        return made

    def _parsed(self, value: Any) -> Any:
        """MLflow's ``_try_parse_json_string(value)`` (a text's decoded string, else the value itself),
        remembered for the short texts that repeat from span to span (span types, model names, tag values)."""
        if type(value) is not str or len(value) > 256:
            return self.h["_try_parse_json_string"](value)
        memo = self._parse_memo
        try:
            return memo[value]
        except KeyError:
            pass
        out = self.h["_try_parse_json_string"](value)  # (a text gives a text)
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        memo[value] = out
        return out

    def _validate_tag(self, key: str, value: str) -> tuple[str, str]:
        """MLflow's ``_validate_trace_tag(key, value)``, remembered for the tags that repeat from trace to
        trace (a failure is not kept: it is raised again each time)."""
        memo = self._tag_memo
        pair = (key, value)
        out = memo.get(pair)
        if out is None:
            out = self.h["_validate_trace_tag"](key, value)
            if len(value) <= 256:
                if len(memo) >= _MEMO_MAX:
                    memo.clear()
                memo[pair] = out
        return out

    def _content(self, span: Any, translate: Callable[[Any], dict[str, Any]]) -> dict[str, Any] | None:
        """The span's dict as ``translate_span_when_storing`` returns it, built without it where the
        translation is known to change nothing; None where it must run.

        Only for spans whose attribute keys are all ones this exporter writes itself (`_OWN_KEYS`,
        ``rl.*``, ``mlflow.traceTag.*``), without events, of a known span type -- the
        translation then has nothing to add: the exporter already wrote the inputs, outputs, token
        usage and model MLflow would derive.  What is left that depends on values is checked on each
        span: a model name MLflow would find in the inputs or outputs (when the span names none), and
        a cost MLflow would compute (a model with token usage: only a model MLflow found no price for).
        The first span of each signature (keys, type, model, the GenAI names) is translated all the
        same and compared; a signature whose translation changed anything is always translated."""
        attrs = span.attributes
        if not attrs or span.events:
            return None
        sig = _signature(attrs)
        if sig is None:
            return None
        known = self._unchanged.get(sig)
        if known is False:
            return None
        if _MODEL in attrs:
            if _USAGE in attrs and self.h["_try_parse_json_string"](attrs[_MODEL]) not in self._unpriced:
                return None  # MLflow may price it
        elif "model" in (attrs.get(_INPUTS) or "") or "model" in (attrs.get(_OUTPUTS) or ""):
            return None  # MLflow may take a model name from them
        parent = span.parent_span_id
        d = {
            "trace_id": _b64(span.trace_id.to_bytes(16, "big")).decode(),
            "span_id": _b64(span.span_id.to_bytes(8, "big")).decode(),
            "parent_span_id": None if parent is None else _b64(parent.to_bytes(8, "big")).decode(),
            "name": span.name,
            "start_time_unix_nano": span.start_ns,
            "end_time_unix_nano": span.end_ns,
            "events": [],
            "status": {"code": "STATUS_CODE_" + span.status_code, "message": span.status_message or ""},
            "attributes": quick_sanitize(attrs),
            "links": [],
        }
        if known is None:
            try:
                same = translate(span.mlflow()) == d
            except Exception:
                same = False
            self._unchanged[sig] = same
            if not same:
                return None
        self.untranslated_spans += 1
        return d

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
                idc = [c for c in cols if c in _ID_COLUMNS]
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
            _mlflow_version(),
            diff,
        )


def compare(expected: Rows, stored: dict[str, list[dict[str, Any]]]) -> str | None:
    """None when `stored` holds exactly the rows of `expected` (volatile columns aside); else what differs."""
    for table in set(expected.tables) | set(stored):
        want = expected.tables.get(table, [])
        have = stored.get(table, [])
        if not want and not have:
            continue
        skip = _VOLATILE.get(table, ())
        cols = sorted({c for r in want for c in r} - set(skip))
        extra = sorted({c for r in have for c in r} - set(cols) - set(skip) - {"duration_ns"})
        for c in extra:  # a column MLflow fills that this writer leaves to its default
            if any(r.get(c) is not None for r in have):
                return f"{table}.{c} is set by MLflow"

        def key(r: dict[str, Any], cols: list[str] = cols) -> tuple:
            return tuple(repr(r.get(c)) for c in cols)

        a = sorted(key(r) for r in want)
        b = sorted(key(r) for r in have)
        if a != b:
            missing = [dict(zip(cols, k)) for k in a if k not in b][:1]
            unexpected = [dict(zip(cols, k)) for k in b if k not in a][:1]
            return (
                f"{table}: {len(want)} rows computed, {len(have)} stored; first differing computed "
                f"{_short(missing)}, stored {_short(unexpected)}"
            )
    return None


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 400 else s[:400] + "..."


def stored_attribute(value: Any) -> Any:
    """One span attribute value as MLflow's ``sanitize_attributes`` stores it, without parsing the
    values it leaves alone.  The rule: a JSON text that decodes to a string, which itself decodes to
    a string, an object or an array, is stored decoded once (a value encoded twice); any other value
    as it is.  A JSON text decodes to a string only when its first non-blank character is a quote,
    and to a string, an object or an array only when that character is one of ``"{[`` -- what every
    other value (most of them: objects, numbers, short texts) is told apart by, before any parse."""
    if type(value) is str:
        head = value[:2]
        if head[:1].isspace():  # (rare: the copy lstrip makes is left to these)
            head = value.lstrip()[:2]
        if head[:1] != '"':
            return value
        second = head[1:]
        if second and second not in '"{[\\' and not second.isspace():
            # a JSON text '"x...' whose x is none of these is a string that does not begin with a
            # quote, a brace or a bracket, or no JSON at all: stored as it is, either way (most
            # attribute values: names and kinds, JSON-encoded)
            return value
    try:
        once = json.loads(value)
    except (json.JSONDecodeError, TypeError):
        return value
    if not isinstance(once, str) or once.lstrip()[:1] not in ('"', "{", "["):
        return value
    try:
        twice = json.loads(once)
    except json.JSONDecodeError:
        return value
    return once if isinstance(twice, (str, dict, list)) else value


def quick_sanitize(attributes: dict[str, Any]) -> dict[str, Any]:
    """`stored_attribute` of each value, in a new dict (MLflow's ``sanitize_attributes``, same result)."""
    return {k: stored_attribute(v) for k, v in attributes.items()}


def unpriced_models_remembered(calculate: Callable[..., Any]) -> Callable[..., Any]:
    """MLflow's ``calculate_cost_by_model_and_token_usage``, remembering the models it finds no price
    for.  Each call looks the model up again, and where litellm is not installed it first tries to
    import it -- a failed import searches ``sys.path`` anew every time: ~100 µs per LLM span, the
    largest single part of the writer's translation for a model without a price (a local policy,
    a fine-tuned checkpoint).  Without a provider, MLflow looks a model up in its bundled price
    lists: a model it found no price for there (with tokens to price) has none at any token count,
    and is not looked up again.  With a provider (given, or ``databricks`` from the model's name)
    MLflow may fetch the provider's list over the network: such calls are left alone."""
    unpriced: set[str] = set()

    def calculate_cost(model_name: Any, usage: Any, model_provider: Any = None) -> Any:
        memo = (
            not model_provider
            and type(model_name) is str
            and model_name != ""
            and not model_name.startswith(("databricks-", "databricks/"))
        )
        if memo and model_name in unpriced:
            return None
        cost = calculate(model_name, usage, model_provider)
        if (
            cost is None
            and memo
            and isinstance(usage, dict)
            and (usage.get("input_tokens") or usage.get("output_tokens"))
        ):
            unpriced.add(model_name)
        return cost

    calculate_cost.unpriced = unpriced  # type: ignore[attr-defined]
    return calculate_cost


def writer_translation(translate: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """MLflow's ``translate_span_when_storing`` for this writer only (MLflow's own writes keep the
    original), with two of the functions it calls replaced by ones that give the same results faster:
    `quick_sanitize` for ``sanitize_attributes``, which parses every attribute value, and again when
    the first parse gives a string (~40 % of the cost of the translation for the writer's spans); and
    `unpriced_models_remembered` around ``calculate_cost_by_model_and_token_usage``.  The verification
    compares the rows with MLflow's own, so an MLflow whose rules differ turns the writer off."""
    import types

    code = getattr(translate, "__code__", None)
    if code is None or "sanitize_attributes" not in code.co_names or translate.__closure__:
        return translate
    scope = dict(translate.__globals__)
    scope["sanitize_attributes"] = quick_sanitize
    calculate = scope.get("calculate_cost_by_model_and_token_usage")
    remembered = None
    if "calculate_cost_by_model_and_token_usage" in code.co_names and callable(calculate):
        remembered = scope["calculate_cost_by_model_and_token_usage"] = unpriced_models_remembered(calculate)
    fn = types.FunctionType(code, scope, translate.__name__, translate.__defaults__)
    if remembered is not None:
        fn.unpriced = remembered.unpriced  # type: ignore[attr-defined]
    return fn


# -- spans whose translation changes nothing (`BulkTraceWriter._content`) -----------------------------
_SPAN_TYPE = _traces.ATTR_SPAN_TYPE
_INPUTS = _traces.ATTR_INPUTS
_OUTPUTS = _traces.ATTR_OUTPUTS
_USAGE = _traces.ATTR_TOKEN_USAGE
_MODEL = _traces.ATTR_MODEL
#: the attribute keys the exporter writes (otel_rl_mlflow._traces) besides rl.* and mlflow.traceTag.*
_OWN_KEYS = frozenset(
    {
        _traces.ATTR_REQUEST_ID,
        _SPAN_TYPE,
        _INPUTS,
        _OUTPUTS,
        _USAGE,
        _MODEL,
        sc.GEN_AI_OPERATION_NAME,
        sc.GEN_AI_REQUEST_MODEL,
        sc.GEN_AI_RESPONSE_MODEL,
        sc.GEN_AI_USAGE_INPUT_TOKENS,
        sc.GEN_AI_USAGE_OUTPUT_TOKENS,
        sc.GEN_AI_TOOL_NAME,
        sc.GEN_AI_TOOL_TYPE,
        sc.GEN_AI_TOOL_CALL_ID,
    }
)
#: GenAI attributes whose values (names, not counts or ids) are part of a span's signature
_NAMED = (
    sc.GEN_AI_OPERATION_NAME,
    sc.GEN_AI_REQUEST_MODEL,
    sc.GEN_AI_RESPONSE_MODEL,
    sc.GEN_AI_TOOL_NAME,
    sc.GEN_AI_TOOL_TYPE,
)
_b64 = base64.b64encode
_loads = json.loads
_plain_dumps = json.JSONEncoder(ensure_ascii=False).encode


def _signature(attrs: Any) -> tuple | None:
    """What MLflow's translation of a span of the exporter's own keys depends on, or None for a span
    with other keys (or no span type, or an unknown one: MLflow would look for one)."""
    for k in attrs:
        if k not in _OWN_KEYS and not k.startswith(("rl.", "mlflow.traceTag.")):
            return None
    stype = attrs.get(_SPAN_TYPE)
    if not stype or stype == '"UNKNOWN"':
        return None
    return (tuple(attrs), stype, attrs.get(_MODEL), *(attrs.get(k) for k in _NAMED))


def _status_text(code: Any) -> str:
    return getattr(code, "value", code)


def _shape(spans: Sequence[Any]) -> frozenset:
    """What makes MLflow's treatment of a trajectory differ: its spans' kinds, statuses, attribute keys,
    event names and models (values of other attributes only become JSON text), as a multiset (the
    order of the spans does not matter)."""
    parts: dict[tuple, int] = {}
    for s in spans:
        attrs = s.attributes
        part = (
            s.name,
            s.parent_span_id is None,
            attrs.get(_SPAN_TYPE),
            s.status_code,
            frozenset(attrs),
            tuple(e[0] for e in s.events),
            attrs.get(_MODEL),
            attrs.get("mlflow.llm.provider"),
        )
        parts[part] = parts.get(part, 0) + 1
    return frozenset(parts.items())


def _mlflow_version() -> str:
    try:
        import mlflow

        return mlflow.__version__
    except Exception:  # pragma: no cover
        return "?"
