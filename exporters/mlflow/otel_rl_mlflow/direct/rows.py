"""The rows MLflow's ``log_spans`` + ``link_traces_to_run`` write for new traces, computed with MLflow's own
functions (`RowMaker`, a base of `otel_rl_mlflow.direct.traces.BulkTraceWriter`), and their comparison
with the rows MLflow stored (`compare`, the writer's verification)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .translation import (
    _INPUTS,
    _MODEL,
    _OUTPUTS,
    _SPAN_TYPE,
    _USAGE,
    _b64,
    _plain_dumps,
    _signature,
    _status_text,
    quick_sanitize,
)

#: columns that hold a trace id: rows keyed by one of them are compared at verification
ID_COLUMNS = ("request_id", "trace_id", "source_id", "destination_id")
#: entity_associations columns MLflow fills with a fresh uuid / the current time
_VOLATILE = {"entity_associations": ("association_id", "created_time")}
#: entries each memo of MLflow's pure helpers keeps at most (`RowMaker._parsed`, `._validate_tag`)
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


class RowMaker:
    """Computes the rows of traces as MLflow would write them (`_rows`), remembering what repeats."""

    def __init__(self, store: Any, helpers: dict[str, Any]):
        self.store = store
        self.h = helpers
        self._locations: dict[str, Callable[[str], str]] = {}  # experiment id -> `_trace_artifact_location`
        self._parse_memo: dict[str, Any] = {}  # `_parsed`
        self._tag_memo: dict[tuple[str, str], Any] = {}  # `_validate_tag`
        # span signature (`_signature`) -> whether MLflow's translation leaves such spans as they are
        self._unchanged: dict[tuple, bool] = {}
        self.untranslated_spans = 0  # spans whose content was taken as it is (see `_content`)
        # the models MLflow's cost lookup found no price for (filled as the translation runs)
        self._unpriced: set[str] = getattr(helpers["translate_span_when_storing"], "unpriced", set())

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
