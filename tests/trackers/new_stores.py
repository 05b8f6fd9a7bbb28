"""Read back the TensorBoard, Trackio and ClearML stores with each tracker's own reader, and the values
each one is expected to hold for what otel-rl recorded."""

from __future__ import annotations

import glob
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------- a workload


def workload_steps() -> list[tuple[int, dict[str, Any]]]:
    """(step, one log() call's values) in call order: odd keys, NaN/±Inf, ints, bools, a repeated step
    and an out-of-order one."""
    calls = []
    for n in (1, 2, 3):
        calls.append((n, {"actor/pg_loss": 0.5 / n, "critic/score/mean": float(n), "perf/tokens": 1000 * n,
                          "flag/done": n == 3, "nan/metric": math.nan, "inf/pos": math.inf, "inf/neg": -math.inf,
                          "int/big": 2**53 + n, "指标/损失": 0.1 * n, "plain": n / 7}))
        calls.append((n, {"actor/pg_loss": -0.5 / n, "actor/entropy": 1.0 / n}))  # the same step again
    calls.append((2, {"late/value": 42.0}))  # an earlier step after a later one
    return calls


GENERATIONS = {2: [("What is 1+1?", "2", 1.0), ("写一首诗", "床前明月光", 0.5)], 3: [("q|pipe", "a\nb", 0.0)]}


def run_workload(log: Any, log_generations: Any) -> None:
    for step, values in workload_steps():
        log(values, step)
        if step in GENERATIONS and "late/value" not in values and "actor/entropy" in values:
            log_generations(GENERATIONS[step], step)


def points(calls: list[tuple[int, dict[str, Any]]]) -> list[tuple[str, int, Any]]:
    return [(k, step, v) for step, values in calls for k, v in values.items()]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def assert_same_points(got: list[tuple[str, int, Any]], want: list[tuple[str, int, Any]]) -> None:
    """Equal per key, in order (NaN equal to NaN; types compared)."""
    def by_key(ps: list) -> dict[str, list]:
        out: dict[str, list] = {}
        for k, s, v in ps:
            out.setdefault(k, []).append((s, v))
        return out

    g, w = by_key(got), by_key(want)
    assert sorted(g) == sorted(w), set(g) ^ set(w)
    for k in w:
        assert len(g[k]) == len(w[k]) and all(gs == ws and same(gv, wv) for (gs, gv), (ws, wv) in zip(g[k], w[k])), \
            (k, g[k], w[k])


# ----------------------------------------------------------------------------- TensorBoard


def tb_accumulator(path: str | Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every point
    ea.Reload()
    return ea


def tb_points(path: str | Path) -> list[tuple[str, int, float]]:
    ea = tb_accumulator(path)
    return [(tag, e.step, float(e.value)) for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag)]


def tb_expected(calls: list[tuple[int, dict[str, Any]]]) -> list[tuple[str, int, float]]:
    def f32(v: Any) -> float:
        try:
            x = float(v)
        except OverflowError:
            x = math.inf if v > 0 else -math.inf
        with np.errstate(over="ignore"):
            return float(np.float32(x))
    return [(k, s, f32(v)) for k, s, v in points(calls)]


def tb_texts(path: str | Path, tag: str) -> dict[int, list]:
    ea = tb_accumulator(path)
    out: dict[int, list] = {}
    for e in ea.Tensors(tag):
        proto = e.tensor_proto
        dims = [d.size for d in proto.tensor_shape.dim]
        cells = [b.decode() for b in proto.string_val]
        out.setdefault(e.step, []).append(np.array(cells, dtype=object).reshape(dims).tolist() if dims else cells[0])
    return out


# ----------------------------------------------------------------------------- Trackio


def trackio_rows(project: str, run: str) -> list[dict[str, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run)


def trackio_points(project: str, run: str) -> list[tuple[str, int, Any]]:
    out = []
    for row in trackio_rows(project, run):
        for k, v in row.items():
            if k not in ("step", "timestamp") and not isinstance(v, (dict, list)):
                out.append((k, row["step"], v))
    return out


def trackio_expected(calls: list[tuple[int, dict[str, Any]]]) -> list[tuple[str, int, Any]]:
    return [(k, s, v if isinstance(v, (bool, int)) else float(v)) for k, s, v in points(calls)]


def trackio_traces(project: str, run: str, key: str = "val/generations") -> dict[int, list]:
    """Trackio traces of `key` by step (its traces table, in index order)."""
    from trackio.sqlite_storage import SQLiteStorage

    out: dict[int, list] = {}
    for t in SQLiteStorage.get_traces(project, run):
        if t["key"] == key:
            out.setdefault(t["step"], []).append(t)
    return {step: sorted(ts, key=lambda t: t["index"]) for step, ts in out.items()}


# ----------------------------------------------------------------------------- ClearML


def clearml_sessions(cache_dir: str | Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(os.path.join(str(cache_dir), "offline", "offline-*"))
                  if os.path.isdir(p))


def clearml_events(session: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with open(session / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                events.extend(json.loads(line))
    return events


def clearml_points(session: Path) -> list[tuple[str, int, Any]]:
    """(title/series, iteration, value) of the reported scalars, in report order."""
    out = []
    for ev in clearml_events(session):
        if ev.get("type") == "training_stats_scalar":
            out.append(((ev["metric"], ev["variant"]), ev["iter"], ev["value"]))
    return out


def clearml_expected(calls: list[tuple[int, dict[str, Any]]]) -> list[tuple[Any, int, Any]]:
    from clearml.backend_interface.metrics.events import MetricsEventAdapter
    from otel_rl_clearml import split_key

    def value(v: Any) -> float:
        try:
            x = float(v)
        except OverflowError:
            x = math.inf if v > 0 else -math.inf
        if math.isnan(x):
            return float(MetricsEventAdapter.default_nan_value)
        if math.isinf(x):
            return float(MetricsEventAdapter.default_inf_value)
        return x
    return [(split_key(k), s, value(v)) for k, s, v in points(calls)]


def clearml_task(session: Path) -> dict[str, Any]:
    return json.loads((session / "task.json").read_text())


def clearml_config(session: Path, name: str = "Hyperparameters") -> Any:
    """The connected configuration, parsed back with ClearML's own HOCON reader."""
    from clearml.utilities.pyhocon import ConfigFactory, HOCONConverter

    text = clearml_task(session)["configuration"][name]["value"]
    return json.loads(HOCONConverter.to_json(ConfigFactory.parse_string(text)))


def clearml_tables(session: Path) -> dict[int, list]:
    out: dict[int, list] = {}
    for ev in clearml_events(session):
        if ev.get("type") == "plot":
            plot = json.loads(ev["plot_str"])["data"][0]
            columns = plot["cells"]["values"]
            rows = [list(r) for r in zip(*columns)]
            out.setdefault(ev["iter"], []).append([plot["header"]["values"]] + rows)
    return out
