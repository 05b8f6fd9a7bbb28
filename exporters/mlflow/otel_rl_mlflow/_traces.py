"""`Trajectory` records -> MLflow `Span` entities (one MLflow trace per trajectory).

An MLflow `Span` wraps an OpenTelemetry `ReadableSpan` whose attribute values are
JSON text (``mlflow.spanInputs`` holds the JSON of the inputs, and so on).  We
build those read-only spans straight from the record's `SpanNode` tree, with the
original ids, times, status and events, so the store's batch span ingestion
(`log_spans`, the path MLflow's own OTLP endpoint uses) can take many traces in
one call:

- span type from ``rl.span.kind`` (`SPAN_TYPES`);
- inputs / output: the op's JSON as it is (read back parsed); a value that is
  not valid JSON (a truncated one) is stored as a JSON string;
- ``gen_ai.usage.input_tokens`` / ``output_tokens`` -> ``mlflow.chat.tokenUsage``
  (MLflow sums it into the trace's token usage);
- ``gen_ai.request.model`` / ``gen_ai.response.model`` -> ``mlflow.llm.model``;
- the trajectory's root (which has no inputs or output of its own) gets the rollout's
  (`Trajectory.rollout_inputs` / `rollout_outputs`: the prompt and the step,
  sample_index, rollout_n and validate; the final response and the reward): MLflow
  makes the trace's request / response previews, the trace list's Input and Output
  columns, from them;
- trace tags (``step``, ``sample_index``, ``rollout_n``, ``validate``, ``reward``,
  ``experiment_name``) and the trace name as ``mlflow.traceTag.*`` attributes
  of the root span, which the store turns into trace tags;
- every other attribute and every event (``exception`` with type, message and
  stack trace) kept as it is.

The MLflow trace id is ``tr-<32 hex of the OTel trace id>``, as MLflow derives it
for spans it ingests over OTLP, so a retried batch updates the same traces.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from otel_rl import semconv as sc
from otel_rl.records import SpanNode, Trajectory, int_or_none

from ._keys import MAX_TAG_VALUE_CHARS, MAX_TRACE_NAME_CHARS, truncate

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

# rl.span.kind -> mlflow.entities.SpanType (plain strings: SpanType is a namespace of str constants)
SPAN_TYPES: dict[str, str] = {
    sc.KIND_AGENT: "AGENT",
    sc.KIND_CHAIN: "CHAIN",
    sc.KIND_LLM: "LLM",
    sc.KIND_TOOL: "TOOL",
    sc.KIND_REWARD: "EVALUATOR",
    sc.KIND_STEP: "WORKFLOW",
    sc.KIND_TIMER: "TASK",
    sc.KIND_METRICS: "UNKNOWN",
}

# MLflow's reserved span attribute keys (mlflow.tracing.constant.SpanAttributeKey), spelled
# out so that building spans does not import the tracing module's heavier parts.
ATTR_REQUEST_ID = "mlflow.traceRequestId"
ATTR_SPAN_TYPE = "mlflow.spanType"
ATTR_INPUTS = "mlflow.spanInputs"
ATTR_OUTPUTS = "mlflow.spanOutputs"
ATTR_TOKEN_USAGE = "mlflow.chat.tokenUsage"
ATTR_MODEL = "mlflow.llm.model"
ATTR_TRACE_TAG_PREFIX = "mlflow.traceTag."
TAG_TRACE_NAME = "mlflow.traceName"

_dumps = json.JSONEncoder(ensure_ascii=False).encode
_loads = json.loads


def mlflow_trace_id(otel_trace_id: int) -> str:
    return "tr-%032x" % otel_trace_id


#: JSON texts of short scalar values, which repeat from span to span (kinds, names, models, steps)
_SCALARS: dict[tuple[type, Any], str] = {}
_SCALARS_MAX = 4096


def _attr(value: Any) -> str:
    t = type(value)
    if t is str and len(value) <= 64 or t is int or t is bool:
        key = (t, value)
        text = _SCALARS.get(key)
        if text is None:
            if len(_SCALARS) >= _SCALARS_MAX:
                _SCALARS.clear()
            text = _SCALARS[key] = _dumps(value)
        return text
    if t is tuple:
        value = list(value)
    try:
        return _dumps(value)
    except (TypeError, ValueError):
        return _dumps(repr(value))


def _json_text(text: Any) -> str:
    """Our inputs/outputs are JSON text already; keep it unless it does not parse."""
    if isinstance(text, str):
        try:
            _loads(text)
            return text
        except ValueError:
            pass
    return _attr(text)


def trace_tags(t: Trajectory) -> dict[str, str]:
    tags = {k: truncate(v, MAX_TAG_VALUE_CHARS)[0] for k, v in t.tags().items()}
    tags[TAG_TRACE_NAME] = truncate(str(t.name), MAX_TRACE_NAME_CHARS)[0]
    return tags


class RowSpan:
    """One span of a trajectory as the MLflow exporter stores it: its ids, times, status, events and its
    attributes already in MLflow's form (JSON texts).  The direct trace writer (`otel_rl_mlflow.direct.traces`)
    reads these fields; `mlflow()` makes the MLflow `Span` that MLflow's own calls take."""

    __slots__ = (
        "builder",
        "trace_id",
        "span_id",
        "parent_span_id",
        "name",
        "attributes",
        "events",
        "status_code",
        "status_message",
        "start_ns",
        "end_ns",
        "_mlflow",
    )

    def __init__(
        self,
        builder: SpanBuilder,
        trace_id: int,
        span_id: int,
        parent_span_id: int | None,
        name: str,
        attributes: dict[str, str],
        events: list[tuple[str, dict[str, AttributeValue], int | None]],
        status_code: str,
        status_message: str | None,
        start_ns: int,
        end_ns: int,
    ):
        self.builder = builder
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.name = name
        self.attributes = attributes
        self.events = events
        self.status_code = status_code  # UNSET, OK or ERROR
        self.status_message = status_message  # kept with ERROR only, as OpenTelemetry's Status does
        self.start_ns = start_ns
        self.end_ns = end_ns
        self._mlflow: Any = None

    def mlflow(self) -> Any:
        """The MLflow `Span` (made once)."""
        if self._mlflow is None:
            self._mlflow = self.builder.mlflow_span(self)
        return self._mlflow


class SpanBuilder:
    """Builds a trajectory's `RowSpan`s, and MLflow `Span`s from them; holds the imported classes
    (imported on first use)."""

    def __init__(self) -> None:
        from mlflow.entities import Span
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

        self._Span = Span
        self._ReadableSpan = ReadableSpan
        self._Event = Event
        self._SpanContext = SpanContext
        self._Status = Status
        self._codes = {"OK": StatusCode.OK, "ERROR": StatusCode.ERROR, "UNSET": StatusCode.UNSET}
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        # no resource attributes: the store would write each one as a tag of every trace
        self._resource = Resource({})

    def spans(self, t: Trajectory) -> list[RowSpan]:
        tid = t.trace_id
        request_id = _dumps(mlflow_trace_id(tid))
        root_tags = {ATTR_TRACE_TAG_PREFIX + k: _dumps(v) for k, v in trace_tags(t).items()}
        out = []
        for node in t.root.walk():
            attrs = self._attributes(node, request_id)
            if node is t.root:
                attrs.update(root_tags)
                rollout_in, rollout_out = t.rollout_inputs(), t.rollout_outputs()
                if rollout_in is not None:
                    attrs[ATTR_INPUTS] = _attr(rollout_in)
                if rollout_out is not None:
                    attrs[ATTR_OUTPUTS] = _attr(rollout_out)
                parent = None  # a partial trajectory's stand-in root has a parent we never saw
            else:
                parent = node.parent_id
            code = node.status if node.status in ("OK", "ERROR") else "UNSET"
            out.append(
                RowSpan(
                    self,
                    tid,
                    node.span_id,
                    parent,
                    node.name,
                    attrs,
                    [(e["name"], e.get("attributes") or {}, e.get("time_ns")) for e in node.events]
                    if node.events
                    else [],
                    code,
                    node.status_message if code == "ERROR" else None,
                    node.start_ns,
                    node.end_ns or node.start_ns,
                )
            )
        return out

    def mlflow_spans(self, t: Trajectory) -> list[Any]:
        return [s.mlflow() for s in self.spans(t)]

    def mlflow_span(self, s: RowSpan) -> Any:
        ctx_cls, flags = self._SpanContext, self._flags
        otel = self._ReadableSpan(
            name=s.name,
            context=ctx_cls(s.trace_id, s.span_id, False, flags),
            parent=ctx_cls(s.trace_id, s.parent_span_id, False, flags) if s.parent_span_id is not None else None,
            resource=self._resource,
            attributes=s.attributes,
            events=[self._Event(name, attrs, time_ns) for name, attrs, time_ns in s.events],
            status=self._Status(self._codes[s.status_code], s.status_message),
            start_time=s.start_ns,
            end_time=s.end_ns,
        )
        return self._Span(otel)

    @staticmethod
    def _attributes(node: SpanNode, request_id: str) -> dict[str, str]:
        a = node.attributes
        attrs = {k: _attr(v) for k, v in a.items()}
        attrs[ATTR_REQUEST_ID] = request_id
        attrs[ATTR_SPAN_TYPE] = _dumps(SPAN_TYPES.get(node.kind, "UNKNOWN"))
        if node.inputs is not None:
            attrs[ATTR_INPUTS] = _json_text(node.inputs)
        if node.output is not None:
            attrs[ATTR_OUTPUTS] = _json_text(node.output)
        tin = int_or_none(a.get(sc.GEN_AI_USAGE_INPUT_TOKENS))
        tout = int_or_none(a.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS))
        if tin is not None or tout is not None:
            usage = {}
            if tin is not None:
                usage["input_tokens"] = tin
            if tout is not None:
                usage["output_tokens"] = tout
            usage["total_tokens"] = (tin or 0) + (tout or 0)
            attrs[ATTR_TOKEN_USAGE] = _dumps(usage)
        model = a.get(sc.GEN_AI_RESPONSE_MODEL) or a.get(sc.GEN_AI_REQUEST_MODEL)
        if model:
            attrs[ATTR_MODEL] = _dumps(str(model))
        return attrs


def size_hint(t: Trajectory) -> int:
    """Rough bytes of a trajectory's spans, for request sizing."""
    n = 0
    for node in t.root.walk():
        n += 300 + len(node.inputs or "") + len(node.output or "")
    return n


def chunks(
    trajectories: Sequence[Trajectory], max_traces: int, max_spans: int, max_bytes: int
) -> list[list[Trajectory]]:
    out: list[list[Trajectory]] = []
    cur: list[Trajectory] = []
    spans = size = 0
    for t in trajectories:
        n = sum(1 for _ in t.root.walk())
        b = size_hint(t)
        if cur and (len(cur) >= max_traces or spans + n > max_spans or size + b > max_bytes):
            out.append(cur)
            cur, spans, size = [], 0, 0
        cur.append(t)
        spans += n
        size += b
    if cur:
        out.append(cur)
    return out


def preview(root: Any, key: str, role: str) -> str | None:
    """A trace's request / response preview from its root span's inputs / outputs, as MLflow makes it
    when it stores spans."""
    text = root._span.attributes.get(key) if root is not None else None
    if not text:
        return None
    try:
        from mlflow.tracing.utils.truncation import _get_truncated_preview

        return _get_truncated_preview(text, role=role)
    except Exception:  # an MLflow without it: the JSON text, cut as MLflow cuts it
        return text if len(text) <= 1000 else text[:997] + "..."


def log_one_by_one(tracing: Any, experiment_id: str, run_id: str, trajs: list[Trajectory], spans: list[Any]) -> None:
    """Stores without span ingestion (file store, servers < 3.4, a server whose backend has none): per
    trace, its info (``mlflow.sourceRun`` metadata, token usage, previews, tags) + its span data artifact."""
    from mlflow.entities import TraceData, TraceInfo, TraceLocation, TraceState

    by_trace: dict[str, list[Any]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    roots = {s.trace_id: s for s in spans if s.parent_id is None}
    for t in trajs:
        tid = mlflow_trace_id(t.trace_id)
        tspans = by_trace.get(tid, [])
        root = t.root
        start_ms = root.start_ns // 1_000_000
        end_ms = max((n.end_ns for n in root.walk()), default=root.end_ns) // 1_000_000
        state = TraceState.ERROR if root.status == "ERROR" else TraceState.OK
        metadata = {"mlflow.sourceRun": run_id, "mlflow.trace_schema.version": "3"}
        tin = sum(int_or_none(n.attributes.get(sc.GEN_AI_USAGE_INPUT_TOKENS)) or 0 for n in root.walk())
        tout = sum(int_or_none(n.attributes.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS)) or 0 for n in root.walk())
        if tin or tout:
            metadata["mlflow.trace.tokenUsage"] = json.dumps(
                {"input_tokens": tin, "output_tokens": tout, "total_tokens": tin + tout}
            )
        info = TraceInfo(
            trace_id=tid,
            trace_location=TraceLocation.from_experiment_id(experiment_id),
            request_time=start_ms,
            state=state,
            execution_duration=max(0, end_ms - start_ms),
            request_preview=preview(roots.get(tid), ATTR_INPUTS, "user"),
            response_preview=preview(roots.get(tid), ATTR_OUTPUTS, "assistant"),
            trace_metadata=metadata,
            tags=trace_tags(t),
        )
        returned = tracing.start_trace(info)
        tracing._upload_trace_data(returned, TraceData(spans=tspans))
