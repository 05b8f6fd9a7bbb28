"""Spans -> typed records, once, for every exporter.

The pipeline turns each batch of finished spans into:

- `RunStart`     run identity + config (from the `rl.run` span)
- `StepMetrics`  the exact (key, value) pairs of one `log()` call at a step
- `Generations`  validation generations of a step, rows of (input, output, score)
- `Trajectory`   one sampled trajectory: the whole span tree of its trace

Records carry their `RunIdentity` (from resource attributes), so an exporter
keeps one tracker run per identity.  The builder reads spans through `ReadableSpan`'s
public fields only, so the same code serves otel-rl's own light spans (in the training
process and in the export process) and spans decoded from OTLP by the bridge.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, KeysView, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from opentelemetry.trace import StatusCode
from opentelemetry.util.types import AttributeValue

from . import semconv as sc
from .redact import scrub_secrets

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

    from .exporters.base import Exporter


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    project: str
    experiment: str
    run_id: str

    @classmethod
    def from_attributes(cls, attrs: Mapping[str, object] | None) -> RunIdentity:
        attrs = attrs or {}
        return cls(
            str(attrs.get(sc.RL_PROJECT_NAME, "")),
            str(attrs.get(sc.RL_EXPERIMENT_NAME, "")),
            str(attrs.get(sc.RL_RUN_ID, "")),
        )


@dataclasses.dataclass
class RunStart:
    run: RunIdentity
    config: dict[str, object]
    rank: int
    time_ns: int


@dataclasses.dataclass
class StepMetrics:
    run: RunIdentity
    step: int
    values: dict[str, float | int | bool]
    time_ns: int


@dataclasses.dataclass
class Generations:
    run: RunIdentity
    step: int
    rows: list[tuple[str, str, float]]
    time_ns: int


class SpanEvent(TypedDict):
    """One event of a span (an exception, a message): its name, time and attributes."""

    name: str
    time_ns: int
    attributes: dict[str, AttributeValue]


@dataclasses.dataclass(slots=True)  # (one per span of every trajectory: smaller, quicker to fill)
class SpanNode:
    name: str
    kind: str
    span_id: int
    parent_id: int | None
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue]
    inputs: str | None
    output: str | None
    status: str  # "OK" | "ERROR" | "UNSET"
    status_message: str | None
    events: list[SpanEvent]
    children: list[SpanNode] = dataclasses.field(default_factory=list)

    def walk(self) -> Iterable[SpanNode]:
        yield self
        for c in self.children:
            yield from c.walk()

    def find(self, name: str) -> list[SpanNode]:
        return [n for n in self.walk() if n.name == name]


@dataclasses.dataclass
class Trajectory:
    run: RunIdentity
    trace_id: int
    step: int | None
    sample_index: int | None
    rollout_n: int | None
    validate: bool
    name: str
    root: SpanNode
    complete: bool = True  # False when flushed without its root span (partial)

    @property
    def status(self) -> str:
        return self.root.status

    def tags(self) -> dict[str, str]:
        """The tags trackers attach, e.g. MLflow's `tags.step = '1'`."""
        out = {sc.TAG_EXPERIMENT_NAME: self.run.experiment, sc.TAG_VALIDATE: str(self.validate)}
        if self.step is not None:
            out[sc.TAG_STEP] = str(self.step)
        if self.sample_index is not None:
            out[sc.TAG_SAMPLE_INDEX] = str(self.sample_index)
        if self.rollout_n is not None:
            out[sc.TAG_ROLLOUT_N] = str(self.rollout_n)
        reward = self.reward
        if reward is not None:
            out[sc.TAG_REWARD] = str(reward)
        return out

    @property
    def reward(self) -> float | None:
        """The reward set on the trajectory (`set_reward`), else the number its last REWARD op returned."""
        value = self.root.attributes.get(sc.RL_REWARD)
        if value is None:
            for node in reversed([n for n in self.root.walk() if n.kind == sc.KIND_REWARD]):
                value = _number(_parsed(node.output))
                if value is not None:
                    break
        return _number(value)

    def rollout_inputs(self) -> dict[str, object] | None:
        """What the trajectory's root shows as its inputs: the prompt, then the rollout's coordinates
        (step, sample_index, rollout_n, validate); None when its root has inputs of its own."""
        if self.root.inputs is not None:
            return None
        out: dict[str, Any] = {}
        prompt = _prompt(self.root)
        if prompt is not None:
            out["prompt"] = prompt
        for key, value in (
            (sc.TAG_STEP, self.step),
            (sc.TAG_SAMPLE_INDEX, self.sample_index),
            (sc.TAG_ROLLOUT_N, self.rollout_n),
        ):
            if value is not None:
                out[key] = value
        out[sc.TAG_VALIDATE] = self.validate
        return out

    def rollout_outputs(self) -> dict[str, object] | None:
        """What the trajectory's root shows as its output: the final response and the reward; None when
        its root has an output of its own, or there is neither."""
        if self.root.output is not None:
            return None
        out: dict[str, Any] = {}
        response = _response(self.root)
        if response is not None:
            out["response"] = response
        reward = self.reward
        if reward is not None:
            out[sc.TAG_REWARD] = reward
        return out or None


Record = RunStart | StepMetrics | Generations | Trajectory

#: characters of the prompt and of the response a trajectory's root repeats (the whole texts stay on
#: their LLM spans)
ROLLOUT_TEXT_CHARS = 1000


def _parsed(text: Any) -> Any:
    """An op's inputs/output JSON text as a value; text that is not JSON (cut short) as it is."""
    if isinstance(text, str):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def int_or_none(value: object) -> int | None:
    """An attribute value as `int()` reads it (a number, a bool, or the text of an integer); None for
    None and for anything `int()` would refuse (other text, NaN, infinity, arrays, bytes, mappings)."""
    if isinstance(value, (int, float, str)):
        try:
            return int(value)
        except (ValueError, OverflowError):
            return None
    return None


def float_or_none(value: object) -> float | None:
    """An attribute value as `float()` reads it (a number, a bool, or the text of a number); None for
    None and for anything `float()` would refuse."""
    if isinstance(value, (int, float, str)):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _array(value: object) -> Sequence[object]:
    """The items of an array attribute; none when the value is absent or not an array."""
    if isinstance(value, (tuple, list)):
        return value
    return ()


def _short(value: Any) -> Any:
    if isinstance(value, str) and len(value) > ROLLOUT_TEXT_CHARS:
        return value[: ROLLOUT_TEXT_CHARS - 3] + "..."
    return value


def _content_text(content: Any) -> str | None:
    """The text of a chat message's content: a string, or the first text part of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                return part
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return part["text"]
    return None


def _llm_nodes(root: SpanNode) -> list[SpanNode]:
    return sorted((n for n in root.walk() if n.kind == sc.KIND_LLM and n is not root), key=lambda n: n.start_ns)


def _prompt(root: SpanNode) -> Any:
    """The first LLM call's prompt: its first user message, the text token2text decoded, or a `prompt`
    argument; else that call's (or the first op's) inputs as they are."""
    llm = _llm_nodes(root)
    first = llm[0] if llm else next((n for n in root.walk() if n is not root and n.inputs is not None), None)
    if first is None:
        return None
    inputs = _parsed(first.inputs)
    if isinstance(inputs, dict):
        messages = inputs.get("messages")
        if isinstance(messages, list):
            for m in messages:
                if isinstance(m, dict) and m.get("role") == "user":
                    text = _content_text(m.get("content"))
                    if text is not None:
                        return _short(text)
        output = _parsed(first.output)
        if llm and isinstance(output, dict) and isinstance(output.get(sc.PROMPT_TEXT), str):
            return _short(output[sc.PROMPT_TEXT])
        for key in ("prompt", "text", "input"):
            if isinstance(inputs.get(key), str):
                return _short(inputs[key])
        for ids in (inputs, output):
            if isinstance(ids, dict) and ids.get(sc.PROMPT_IDS) is not None:
                return ids[sc.PROMPT_IDS]
    return _short(inputs) if isinstance(inputs, str) else inputs


def _response(root: SpanNode) -> Any:
    """The last LLM call's response: the text token2text decoded, a chat message's content, a `text` /
    `content` / `response` field; else that call's output as it is."""
    llm = _llm_nodes(root)
    if not llm:
        return None
    last = max(llm, key=lambda n: (n.end_ns, n.start_ns))
    output = _parsed(last.output)
    if isinstance(output, dict):
        if isinstance(output.get(sc.RESPONSE_TEXT), str):
            return _short(output[sc.RESPONSE_TEXT])
        choices = output.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message")
            text = _content_text(message.get("content")) if isinstance(message, dict) else choices[0].get("text")
            if isinstance(text, str):
                return _short(text)
        for key in ("content", "text", "response"):
            text = _content_text(output.get(key))
            if text is not None:
                return _short(text)
        if output.get(sc.RESPONSE_IDS) is not None:
            return output[sc.RESPONSE_IDS]
    return _short(output) if isinstance(output, str) else output


_UNSET, _OK, _ERROR = StatusCode.UNSET, StatusCode.OK, StatusCode.ERROR


def _status_name(code: StatusCode) -> str:
    # (compared by identity: an enum member's hash is a Python call)
    return "UNSET" if code is _UNSET else "OK" if code is _OK else "ERROR" if code is _ERROR else code.name


def metrics_from_attributes(attrs: Mapping[str, AttributeValue]) -> dict[str, float | int | bool]:
    """Rebuild one log() call's dict, in call order, with exact ints and bools.

    A key array or value array that is not an array counts as empty, and a value that is not a number
    is left out with its key (the bridge refuses such spans; only a hand-made span can hold one)."""
    values: dict[str, float | int | bool] = {}
    for k, v in zip(_array(attrs.get(sc.RL_METRICS_KEYS)), _array(attrs.get(sc.RL_METRICS_VALUES))):
        if type(k) is str and type(v) is float:  # as otel-rl writes them
            values[k] = v
        elif (f := float_or_none(v)) is not None:
            values[str(k)] = f
    for k, v in zip(_array(attrs.get(sc.RL_METRICS_INT_KEYS)), _array(attrs.get(sc.RL_METRICS_INT_VALUES))):
        if type(k) is str and type(v) is int:
            values[k] = v
        elif (i := int_or_none(v)) is not None:
            values[str(k)] = i
    for k, v in zip(_array(attrs.get(sc.RL_METRICS_BOOL_KEYS)), _array(attrs.get(sc.RL_METRICS_BOOL_VALUES))):
        values[str(k)] = bool(v)
    return values


def _copy(attrs: Any) -> dict[str, AttributeValue]:
    """A span's attributes as a dict of its own.  (`ReadableSpan.attributes` is a read-only proxy: its
    `copy()` copies the dict behind it, where `dict(proxy)` would read it key by key.)"""
    if not attrs:
        return {}
    try:
        out = attrs.copy()
    except AttributeError:
        return dict(attrs)
    return out if type(out) is dict else dict(out)


def _node(span: ReadableSpan, attributes: Any = None) -> SpanNode:
    """`span` as a node (`attributes`: its attributes, when the caller has read them already)."""
    attrs = _copy(span.attributes if attributes is None else attributes)
    st = span.status
    parent = span.parent
    kind = attrs.get(sc.RL_SPAN_KIND, sc.KIND_CHAIN)
    inputs = attrs.pop(sc.RL_OP_INPUTS, None)
    output = attrs.pop(sc.RL_OP_OUTPUT, None)
    events = span.events
    code = st.status_code
    # (positional: this runs for every span of every trajectory)
    return SpanNode(
        span.name,
        kind if type(kind) is str else str(kind),
        span.context.span_id,
        parent.span_id if parent is not None else None,
        span.start_time or 0,
        span.end_time or 0,
        attrs,
        inputs if inputs is None or type(inputs) is str else str(inputs),
        output if output is None or type(output) is str else str(output),
        "OK" if code is _OK else "UNSET" if code is _UNSET else _status_name(code),
        st.description,
        [{"name": e.name, "time_ns": e.timestamp, "attributes": _copy(e.attributes)} for e in events] if events else [],
        [],
    )


def _start(node: SpanNode) -> int:
    return node.start_ns


def _tree(nodes: Sequence[SpanNode], root: SpanNode | None) -> tuple[SpanNode, bool]:
    """The nodes of one trace as a tree under `root` (None: partial, the earliest orphan stands in)."""
    by_id = {n.span_id: n for n in nodes}  # a span received twice (a sender's retry) counts once
    if root is not None:
        by_id[root.span_id] = root
    orphans = []
    for n in sorted(by_id.values(), key=_start):
        if n is root:
            continue
        pid = n.parent_id
        parent = by_id.get(pid) if pid is not None else None
        if parent is not None and parent is not n:
            parent.children.append(n)
        else:
            orphans.append(n)
    complete = root is not None
    if root is None:
        root = orphans.pop(0)
    root.children.extend(orphans)
    return root, complete


class _Held:
    """The spans of a trace whose root has not ended, as nodes (made on arrival, while the span is fresh
    in memory), and the resource of the first (the run of a partial trajectory)."""

    __slots__ = ("resource", "nodes", "since")

    def __init__(self, resource: Any, since: float):
        self.resource = resource
        self.nodes: list[SpanNode] = []
        self.since = since  # (time.monotonic() when its first span came)


def _rank(value: object) -> int:
    """The worker rank a resource names (0 when it names none, or none that reads as a number)."""
    return int_or_none(value) or 0


def _score(value: object) -> float:
    f = float_or_none(value)
    return math.nan if f is None else f


def _config(text: AttributeValue | None) -> dict[str, object]:
    """The run config a `rl.run.config` JSON text holds; empty when there is none, or none that reads as a
    JSON object."""
    if not isinstance(text, str):
        return {}
    try:
        config = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


#: names of the spans that can be records by themselves (a log() call, a generations table, the run start)
RECORD_SPAN_NAMES = frozenset({sc.SPAN_LOG, sc.SPAN_GENERATIONS, sc.SPAN_RUN})


def is_record_span(span: ReadableSpan) -> bool:
    """A span that `RecordBuilder` turns into a record of its own (a log() call, a generations table,
    the run start) rather than a part of a trajectory."""
    name = span.name
    if name == sc.SPAN_LOG or name == sc.SPAN_GENERATIONS:
        return sc.RL_STEP in (span.attributes or {})
    return name == sc.SPAN_RUN and span.parent is None


class RecordBuilder:
    """Stateful: spans of a trajectory are held until its root span ends."""

    def __init__(
        self,
        max_pending_traces: int = 10_000,
        min_age_s: float = 0.0,
        node: Callable[[ReadableSpan], SpanNode] | None = None,
    ):
        """Beyond `max_pending_traces` traces waiting for their root, the oldest is emitted as a partial
        trajectory -- once it has waited `min_age_s` (where roots are known to come late: the bridge
        holds them for its root grace), or at ten times the bound whatever its age.  `node`: what makes
        a span's node, `_node` by default (the bridge's C decoder has one for the spans it makes)."""
        self._node = node if node is not None else _node
        self._pending: OrderedDict[int, _Held] = OrderedDict()
        self._max_pending = max_pending_traces
        self._min_age_s = min_age_s
        self._hard_max = max_pending_traces * 10 if min_age_s > 0 else max_pending_traces
        self._runs: dict[int, tuple[Any, RunIdentity]] = {}  # id(resource) -> (resource, its run)

    def _run(self, resource: Any) -> RunIdentity:
        """The run a resource names (a resource is immutable and every span of a run shares one: read once)."""
        got = self._runs.get(id(resource))
        if got is not None and got[0] is resource:
            return got[1]
        run = RunIdentity.from_attributes(resource.attributes)
        if len(self._runs) >= 1024:
            self._runs.clear()
        self._runs[id(resource)] = (resource, run)
        return run

    def build(self, spans: Iterable[ReadableSpan]) -> list[Record]:
        """The records these spans complete.

        Attribute values are read by their type: the bridge refuses received spans whose record
        attributes have the wrong type (`bridge.validate`), so only a hand-made span can hold one, and
        then a log() or generations span whose step is no integer makes no record, a metric that is no
        number is left out, a score that is no number reads as NaN, and a run config that is no JSON
        object reads as empty."""
        out: list[Record] = []
        node = self._node
        pending = self._pending
        for span in spans:
            name = span.name
            if name in RECORD_SPAN_NAMES and self._record(span, name, out):
                continue
            n = node(span)
            kind = n.kind
            tid = span.context.trace_id
            if n.parent_id is None:
                group = pending.pop(tid, None)
                if kind == sc.KIND_STEP or kind == sc.KIND_TIMER:
                    continue  # a step's waterfall is not a trajectory; ops under it are dropped here
                nodes = group.nodes if group is not None else []
                nodes.append(n)
                out.append(self._trajectory(nodes, n, span.resource, tid))
                continue
            if kind == sc.KIND_TIMER:
                continue
            held = pending.get(tid)
            if held is None:
                held = pending[tid] = _Held(span.resource, time.monotonic())
                if len(pending) > self._max_pending:
                    self._evict(out)
            held.nodes.append(n)
        return out

    def _record(self, span: ReadableSpan, name: str, out: list[Record]) -> bool:
        """Whether `span` is a record span (a log() call, a generations table, the run start); its record,
        if it makes one, appended to `out`."""
        attrs: Mapping[str, AttributeValue] = span.attributes or {}
        if name == sc.SPAN_LOG:
            if sc.RL_STEP not in attrs:
                return False
            step = int_or_none(attrs[sc.RL_STEP])
            if step is not None:
                out.append(
                    StepMetrics(
                        self._run(span.resource),
                        step,
                        metrics_from_attributes(attrs),
                        span.end_time or time.time_ns(),
                    )
                )
            return True
        if name == sc.SPAN_GENERATIONS:
            if sc.RL_STEP not in attrs:
                return False
            step = int_or_none(attrs[sc.RL_STEP])
            rows = zip(
                _array(attrs.get(sc.RL_GENERATIONS_INPUTS)),
                _array(attrs.get(sc.RL_GENERATIONS_OUTPUTS)),
                _array(attrs.get(sc.RL_GENERATIONS_SCORES)),
            )
            if step is not None:
                out.append(
                    Generations(
                        self._run(span.resource),
                        step,
                        [(str(i), str(o), _score(s)) for i, o, s in rows],
                        span.end_time or 0,
                    )
                )
            return True
        if span.parent is not None:  # (an `rl.run` span under another is part of its trajectory)
            return False
        # redacted again: a sender (another program, an older otel-rl) may not have done it
        config = scrub_secrets(_config(attrs.get(sc.RL_RUN_CONFIG)))
        out.append(
            RunStart(
                self._run(span.resource),
                config,
                _rank(span.resource.attributes.get(sc.RL_WORKER_RANK)),
                span.start_time or 0,
            )
        )
        return True

    def _evict(self, out: list[Record]) -> None:
        pending = self._pending
        now = time.monotonic()
        while len(pending) > self._max_pending:
            tid = next(iter(pending))
            if len(pending) <= self._hard_max and now - pending[tid].since < self._min_age_s:
                return
            out.extend(self._partial(tid, pending.pop(tid)))

    def pending(self) -> list[list[SpanNode]]:
        """The spans held for trajectories whose root has not ended, as nodes, per trace (oldest first)."""
        return [h.nodes for h in self._pending.values()]

    def pending_traces(self) -> KeysView[int]:
        """The trace ids of `pending` (a live view)."""
        return self._pending.keys()

    def flush_partial(self) -> list[Record]:
        """Traces whose root never ended (process ending): emit what there is."""
        out: list[Record] = []
        while self._pending:
            tid, group = self._pending.popitem(last=False)
            out.extend(self._partial(tid, group))
        return out

    def _partial(self, trace_id: int, group: _Held) -> list[Record]:
        return [self._trajectory(group.nodes, None, group.resource, trace_id)] if group.nodes else []

    def _trajectory(
        self, nodes: list[SpanNode], root_node: SpanNode | None, resource: Any, trace_id: int
    ) -> Trajectory:
        root, complete = _tree(nodes, root_node)
        a = root.attributes
        step = a.get(sc.RL_STEP)
        si = a.get(sc.RL_SAMPLE_INDEX)
        rn = a.get(sc.RL_ROLLOUT_N)
        return Trajectory(
            run=self._run(resource),
            trace_id=trace_id,
            step=int_or_none(step),
            sample_index=int_or_none(si),
            rollout_n=int_or_none(rn),
            validate=bool(a.get(sc.RL_VALIDATE, False)),
            name=str(a.get(sc.RL_TRAJECTORY_NAME, root.name)),
            root=root,
            complete=complete,
        )


def merge_step_metrics(records: Iterable[Record]) -> list[StepMetrics]:
    """All StepMetrics of one (run, step) merged into one row, later values winning.

    Rows keep the order in which their step first appeared.  For trackers that
    keep one row per step (SwanLab keeps only the first value logged at a step).
    """
    merged: OrderedDict[tuple[RunIdentity, int], StepMetrics] = OrderedDict()
    for r in records:
        if isinstance(r, StepMetrics):
            key = (r.run, r.step)
            cur = merged.get(key)
            if cur is None:
                merged[key] = StepMetrics(r.run, r.step, dict(r.values), r.time_ns)
            else:
                cur.values.update(r.values)
                cur.time_ns = max(cur.time_ns, r.time_ns)
    return list(merged.values())


def records_for(exporter: Exporter, records: Sequence[Record]) -> list[Record]:
    """The records of a batch that `exporter` takes (a new list): trajectories only when it wants them."""
    if exporter.wants_trajectories:
        return list(records)
    return [r for r in records if not isinstance(r, Trajectory)]


def finite_or_none(value: float | int | bool) -> float | int | bool | None:
    if type(value) is float and not math.isfinite(value):
        return None
    return value
