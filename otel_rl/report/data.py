"""What a report shows, read from a run's JSONL file or from an MLflow run.

`RunData` holds the metric series (key -> step -> value, the last value logged at a step winning, as
trackers show it), the run's config (flat ``a/b/c`` keys) and a few sample trajectories.  JSONL files
hold metrics only (verl's file logger format); the config and trajectories come from the MLflow run
when one is given.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from .. import semconv as sc
from ..redact import REDACTED, is_secret_key
from ..serialize import parse_json_float

#: trajectories shown per chosen step: the best, the worst and up to this many failed ones
MAX_FAILED_PER_STEP = 2
#: steps whose trajectories are shown (first, middle, last of the traced training steps)
SAMPLE_STEPS = 3


@dataclasses.dataclass
class Turn:
    kind: str  # LLM | TOOL | EVALUATOR | ... (MLflow span type)
    name: str
    inputs: str
    output: str
    status: str  # OK | ERROR | UNSET
    error: str = ""


@dataclasses.dataclass
class TrajectoryView:
    step: int | None
    label: str  # best | worst | failed
    reward: float | None
    sample_index: str
    validate: bool
    trace_id: str
    status: str
    turns: list[Turn]
    error: str = ""  # why a failed trajectory failed (its root span's exception or status)


@dataclasses.dataclass
class RunData:
    title: str
    source: str
    metrics: dict[str, dict[int, float | None]]  # key -> step -> value (None: NaN / +-Inf / not a number)
    config: dict[str, str] = dataclasses.field(default_factory=dict)
    trajectories: list[TrajectoryView] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted({s for series in self.metrics.values() for s in series})


def plot_value(v: Any) -> float | None:
    """A logged value as a chart point: numbers and bools as floats; NaN, +-Inf and text as None (a gap)."""
    if isinstance(v, str):
        v = parse_json_float(v)
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    return None


def read_jsonl(path: str) -> RunData:
    """Metrics from verl's JSONL format (``{"step": N, "data": {...}}`` per line).  Lines that do not parse are
    counted in the notes, not fatal."""
    metrics: dict[str, dict[int, float | None]] = {}
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
                data = rec["data"]
                if not isinstance(data, dict):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            for k, v in data.items():
                metrics.setdefault(str(k), {})[step] = plot_value(v)
    name = os.path.splitext(os.path.basename(path))[0]
    project = os.path.basename(os.path.dirname(os.path.abspath(path)))
    out = RunData(f"{project}/{name}", os.path.abspath(path), metrics)
    if bad:
        out.notes.append(f"{bad} line(s) of {path} are not verl JSONL records and were skipped")
    return out


def flat_config(params: dict[str, str]) -> dict[str, str]:
    """Params as logged, values of secret-looking keys replaced (they are scrubbed at logging already)."""
    return {k: (REDACTED if is_secret_key(k.rsplit("/", 1)[-1]) else v) for k, v in sorted(params.items())}


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as ``a/b/c`` keys."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}/"))
    else:
        out[prefix.rstrip("/")] = obj if isinstance(obj, str) else json.dumps(obj)
    return out


# ----------------------------------------------------------------------------- MLflow


def mlflow_client(tracking_uri: str | None = None) -> Any:
    from ..exporters.registry import store_client

    return store_client("mlflow", tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:////tmp/mlruns.db")


def find_mlflow_run(client: Any, experiment: str, otel_run_id: str) -> str | None:
    """The MLflow run of an otel-rl run (its ``rl.run.id`` tag) in the experiment named `experiment`."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{sc.RL_RUN_ID}` = '{otel_run_id}'", max_results=1
    )
    return runs[0].info.run_id if runs else None


def read_mlflow(client: Any, run_id: str, metrics: bool = True) -> RunData:
    run = client.get_run(run_id)
    exp = client.get_experiment(run.info.experiment_id)
    series: dict[str, dict[int, float | None]] = {}
    if metrics:
        for key in run.data.metrics:
            points = client.get_metric_history(run_id, key)
            for m in sorted(points, key=lambda m: (m.step, m.timestamp)):
                series.setdefault(key, {})[int(m.step)] = plot_value(m.value) if abs(m.value) < 1.7e308 else None
    data = RunData(
        f"{exp.name}/{run.info.run_name}",
        f"MLflow run {run_id} ({client.tracking_uri})",
        series,
        flat_config(dict(run.data.params)),
    )
    data.trajectories = sample_trajectories(client, run.info.experiment_id, run_id)
    return data


def _reward(trace: Any) -> float | None:
    for span in trace.data.spans:
        if span.parent_id is None:
            v = span.attributes.get(sc.RL_REWARD)
            return plot_value(v) if v is not None else None
    return None


def _short(value: Any, limit: int = 600) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def _error_of(span: Any) -> str:
    """The exception a span recorded (``Type: message``), else its error status' description."""
    for e in getattr(span, "events", None) or []:
        if e.name == sc.EVENT_EXCEPTION:
            a = e.attributes or {}
            return f"{a.get(sc.EXCEPTION_TYPE, '')}: {a.get(sc.EXCEPTION_MESSAGE, '')}".strip(": ")
    status = getattr(getattr(span, "status", None), "status_code", "UNSET")
    if str(getattr(status, "value", status)) == "ERROR":
        return getattr(span.status, "description", "") or "error"
    return ""


def _turns(trace: Any) -> list[Turn]:
    out = []
    spans = sorted(trace.data.spans, key=lambda s: s.start_time_ns or 0)
    for s in spans:
        if s.parent_id is None:
            continue
        status = getattr(getattr(s, "status", None), "status_code", "UNSET")
        status = getattr(status, "value", status)
        error = _error_of(s)
        inputs, output = s.inputs, s.outputs
        if isinstance(output, dict) and (sc.RESPONSE_TEXT in output or sc.PROMPT_TEXT in output):
            inputs = output.get(sc.PROMPT_TEXT, inputs)
            output = output.get(sc.RESPONSE_TEXT, output)
        out.append(Turn(str(s.span_type or ""), s.name, _short(inputs), _short(output), str(status), error))
    return out


def _view(trace: Any, label: str) -> TrajectoryView:
    tags = trace.info.tags
    state = str(getattr(trace.info.state, "value", trace.info.state))
    step = tags.get(sc.TAG_STEP)
    root = next((s for s in trace.data.spans if s.parent_id is None), None)
    return TrajectoryView(
        int(step) if step and step.lstrip("-").isdigit() else None,
        label,
        _reward(trace),
        tags.get(sc.TAG_SAMPLE_INDEX, ""),
        tags.get(sc.TAG_VALIDATE) == "True",
        trace.info.trace_id,
        state,
        _turns(trace),
        _error_of(root) if root is not None and state == "ERROR" else "",
    )


def _search(client: Any, experiment_id: str, run_id: str, filter_string: str | None, spans: bool) -> list[Any]:
    out: list[Any] = []
    token = None
    while True:
        page = client.search_traces(
            locations=[experiment_id],
            run_id=run_id,
            filter_string=filter_string,
            max_results=500,
            include_spans=spans,
            page_token=token,
        )
        out.extend(page)
        token = page.token
        if not token:
            return out


def sample_trajectories(client: Any, experiment_id: str, run_id: str) -> list[TrajectoryView]:
    """Best, worst and failed trajectories of the first, middle and last traced training step."""
    infos = _search(client, experiment_id, run_id, None, spans=False)
    train = sorted(
        {
            int(t.info.tags[sc.TAG_STEP])
            for t in infos
            if t.info.tags.get(sc.TAG_VALIDATE) != "True" and t.info.tags.get(sc.TAG_STEP, "").isdigit()
        }
    )
    if not train:
        return []
    picks = sorted({train[0], train[len(train) // 2], train[-1]})[:SAMPLE_STEPS]
    out: list[TrajectoryView] = []
    for step in picks:
        traces = _search(
            client,
            experiment_id,
            run_id,
            f"tags.{sc.TAG_STEP} = '{step}' AND tags.{sc.TAG_VALIDATE} = 'False'",
            spans=True,
        )
        failed = [t for t in traces if str(getattr(t.info.state, "value", t.info.state)) == "ERROR"]
        scored = [(r, t) for t in traces if t not in failed and (r := _reward(t)) is not None]
        scored.sort(key=lambda rt: rt[0])
        if scored:
            out.append(_view(scored[-1][1], "best"))
            if len(scored) > 1:
                out.append(_view(scored[0][1], "worst"))
        out += [_view(t, "failed") for t in failed[:MAX_FAILED_PER_STEP]]
    return out


def load(jsonl: str | None = None, mlflow_run_id: str | None = None, tracking_uri: str | None = None) -> RunData:
    """Metrics from the JSONL file when given (else from MLflow); config and trajectories from MLflow."""
    if not mlflow_run_id:
        if not jsonl:
            raise ValueError("give a run's JSONL file or --mlflow-run-id")
        data = read_jsonl(jsonl)
        data.notes.append("the JSONL file holds metrics only: give --mlflow-run-id for the config and trajectories")
        return data
    from_jsonl = read_jsonl(jsonl) if jsonl else None
    ml = read_mlflow(mlflow_client(tracking_uri), mlflow_run_id, metrics=from_jsonl is None)
    if from_jsonl is None:
        return ml
    from_jsonl.config, from_jsonl.trajectories = ml.config, ml.trajectories
    from_jsonl.source += f"; config and trajectories from {ml.source}"
    return from_jsonl
