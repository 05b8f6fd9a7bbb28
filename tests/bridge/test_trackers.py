"""Trainers -> OTLP -> `otel-rl bridge` (a real subprocess) -> MLflow sqlite / wandb offline / SwanLab offline.

One bridge serves three trainer processes, run as a module fixture:

1. ``both``: one execution of the instrumented workload delivered twice: in-process to MLflow + wandb +
   SwanLab stores *A*, and with otel-rl's `otlp` exporter (the SDK's OTLP/HTTP protobuf exporter) to
   the bridge, which writes stores *B* with the same three exporters.  Because it is one execution,
   timer values and timestamps are the same on both paths, so *A* and *B* must be equal except for the
   trackers' own run ids and wall-clock fields: metrics per step (with timestamps), params/config,
   MLflow traces (tags, span trees, inputs/outputs, events), tables.
2. then two trainers at once, same project and experiment, different run ids: one over gRPC (the SDK's
   gRPC exporter), one over OTLP/HTTP JSON (the official JSON encoder when installed; otherwise JSON
   per the spec built from the protobuf) -> two tracker runs, each holding exactly its trainer's data.
3. SIGTERM right after the last trainer's data was acknowledged: exit code 0, and everything above
   was delivered (the stores are read after the bridge exited).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("swanlab")
otel_rl_mlflow = pytest.importorskip("otel_rl_mlflow")
otel_rl_wandb = pytest.importorskip("otel_rl_wandb")
otel_rl_swanlab = pytest.importorskip("otel_rl_swanlab")

from mlflow import MlflowClient  # noqa: E402
from otel_rl_swanlab import KeyMap  # noqa: E402
from otel_rl_swanlab.offline import read_runs  # noqa: E402
from otel_rl_wandb import STEP_METRIC  # noqa: E402
from otel_rl_wandb.reader import find_run_dirs, read_run  # noqa: E402

from .helpers import TRAINER, BridgeProcess, clean_env, official_json_encoder, tracker_env  # noqa: E402

pytestmark = pytest.mark.slow
MLFLOW_MAX = 1.7976931348623157e308
MLFLOW_KEYS = {"val-core/acc@5": "val-core/acc_at_5"}


def _trainer(mode: str, endpoint: str, out: Path, env: dict, cwd: Path, project: str, experiment: str,
             run_id: str) -> subprocess.Popen:
    cmd = [sys.executable, str(TRAINER), mode, endpoint, str(out), "--project", project, "--experiment", experiment,
           "--run-id", run_id]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out.decode(errors='replace')[-4000:]}"


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge-trackers")
    a, b = root / "in-process", root / "bridge"
    a.mkdir()
    b.mkdir()
    bridge = BridgeProcess(["--exporters", "mlflow,wandb,swanlab", "--trace-backend", "mlflow", "--batch-delay",
                            "0.05", "--prometheus-port", "0"], clean_env(**tracker_env(b)), b)
    try:
        eq = SimpleNamespace(project=f"eq-{uuid.uuid4().hex[:6]}", experiment="grpo-eq", run_id="eq-run-1")
        p = _trainer("both", f"http://{bridge.http}", root / "both.json", clean_env(**tracker_env(a)), a,
                     eq.project, eq.experiment, eq.run_id)
        _wait(p, "the in-process + OTLP/HTTP trainer")
        conc = SimpleNamespace(project=f"conc-{uuid.uuid4().hex[:6]}", experiment="grpo")
        procs = [_trainer("grpc", f"http://{bridge.grpc}", root / "grpc.json", clean_env(), root, conc.project,
                          conc.experiment, "conc-grpc"),
                 _trainer("json", f"http://{bridge.http}", root / "json.json", clean_env(), root, conc.project,
                          conc.experiment, "conc-json")]
        for proc, what in zip(procs, ("gRPC trainer", "JSON trainer")):
            _wait(proc, what)
        # every trainer has its data acknowledged: stop the bridge now, with its delivery still going on
        code = bridge.terminate()
    except BaseException:
        bridge.kill()
        raise
    caps = {m: json.loads((root / f"{m}.json").read_text()) for m in ("both", "grpc", "json")}
    return SimpleNamespace(root=root, a=a, b=b, bridge=bridge, exit_code=code, eq=eq, conc=conc, caps=caps)


# ----------------------------------------------------------------------------- expected values


def _val(v: dict) -> Any:
    if "b" in v:
        return v["b"]
    if "i" in v:
        return int(v["i"])
    return float(v["f"])


def _points(cap: dict) -> list[tuple[int, int, dict[str, Any]]]:
    return [(step, t, {k: _val(v) for k, v in values}) for step, values, t in cap["metrics"]]


def _merged(cap: dict) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for step, _, values in _points(cap):
        out.setdefault(step, {}).update(values)
    return out


def norm(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return "<nan>"
    if isinstance(v, (list, tuple)):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    return v


# ----------------------------------------------------------------------------- MLflow


def _mlflow_snapshot(uri: str, project: str) -> dict[str, Any]:
    """What an MLflow store holds for a project, keyed by otel-rl run id (not MLflow's run uuid)."""
    client = MlflowClient(uri)
    mlflow.set_tracking_uri(uri)
    exp = client.get_experiment_by_name(project)
    assert exp is not None, f"no MLflow experiment {project!r} in {uri}"
    out: dict[str, Any] = {}
    for run in client.search_runs([exp.experiment_id]):
        rid = run.data.tags[otel_rl_mlflow.RUN_ID_TAG]
        uuid_ = run.info.run_id
        metrics = {k: sorted((m.step, m.timestamp, repr(m.value)) for m in client.get_metric_history(uuid_, k))
                   for k in run.data.metrics}
        tags = {k: v for k, v in run.data.tags.items()
                if not k.startswith(("mlflow.source.", "mlflow.user", "mlflow.log-model"))}
        tables = {}
        for art in json.loads(tags.get("mlflow.loggedArtifacts", "[]")):
            df = client.load_table(exp.experiment_id, art["path"], run_ids=[uuid_])
            tables[art["path"]] = norm(df.drop(columns=["run_id"], errors="ignore").to_dict("records"))
        traces = {}
        for tr in mlflow.search_traces(locations=[exp.experiment_id], run_id=uuid_, return_type="list",
                                       max_results=1000):
            info = tr.info
            spans = sorted(
                (s.span_id, s.parent_id, s.name, s.start_time_ns, s.end_time_ns, s.span_type,
                 s.status.status_code.value, json.dumps(norm(s.inputs), sort_keys=True, default=str),
                 json.dumps(norm(s.outputs), sort_keys=True, default=str),
                 json.dumps(norm({k: v for k, v in s.attributes.items()}), sort_keys=True, default=str),
                 json.dumps([(e.name, e.timestamp, norm(e.attributes)) for e in s.events], default=str))
                for s in tr.data.spans)
            meta = {k: v for k, v in (info.trace_metadata or {}).items()
                    if k not in ("mlflow.sourceRun", "mlflow.user", "mlflow.source.name", "mlflow.source.type")}
            tags_t = {k: v for k, v in info.tags.items() if k not in ("mlflow.user", "mlflow.artifactLocation")}
            traces[info.trace_id] = {"tags": tags_t,
                                     "state": info.state.value, "meta": meta, "usage": info.token_usage,
                                     "spans": spans}
        out[rid] = {"name": run.info.run_name, "status": run.info.status, "params": dict(run.data.params),
                    "tags": tags, "metrics": metrics, "tables": tables, "traces": traces}
    return out


def _check_mlflow_against_capture(run: dict, cap: dict) -> None:
    want: dict[str, list] = {}
    for step, t, values in _points(cap):
        for k, v in values.items():
            f = float(v)
            f = MLFLOW_MAX if f == math.inf else -MLFLOW_MAX if f == -math.inf else f
            want.setdefault(MLFLOW_KEYS.get(k, k), []).append((step, t // 1_000_000, repr(f)))
    assert run["metrics"] == {k: sorted(v) for k, v in want.items()}
    trajs = {otel_rl_mlflow.mlflow_trace_id(int(t["trace_id"], 16)): t for t in cap["trajectories"]}
    assert set(run["traces"]) == set(trajs)
    for tid, t in trajs.items():
        tr = run["traces"][tid]
        assert tr["tags"]["step"] == str(t["step"]) and tr["tags"]["sample_index"] == str(t["sample_index"])
        assert sorted((s[0], s[1], s[2], s[3], s[4]) for s in tr["spans"]) == \
            sorted((sid, pid if i else None, name, start, end)
                   for i, (sid, pid, name, start, end, _) in enumerate(t["spans"]))
    steps = sorted({g[0] for g in cap["generations"]})
    assert sorted(run["tables"]) == sorted(f"val_generations/step_{n}.json" for n in steps)
    for step, rows in cap["generations"]:
        got = run["tables"][f"val_generations/step_{step}.json"]
        assert [(r["input"], r["output"]) for r in got] == [(i, o) for i, o, _ in rows]
    assert run["params"]["trainer/nested/lr"] == "1e-06" and run["params"]["data/files/1"] == "b.parquet"


# ----------------------------------------------------------------------------- wandb


def _no_artifact_ids(v: Any) -> Any:
    """A logged table's reference without wandb's random client artifact ids (its sha256 stays)."""
    if isinstance(v, dict):
        return {k: _no_artifact_ids(x) for k, x in v.items() if k not in ("artifact_path", "_latest_artifact_path")}
    return v


def _wandb_snapshot(root: Path, run_id: str) -> dict[str, Any]:
    dirs = find_run_dirs(str(root / "wandb"), run_id=run_id)
    assert len(dirs) == 1, dirs
    data = read_run(dirs[0])
    assert data.exit_seen and data.complete
    tables = {k: [norm(v.get("columns")), norm(v.get("data"))] for k, vs in data.tables.items() for v in vs[-1:]}
    summary = {k: v for k, v in data.summary.items() if not k.startswith("_")}
    return {"project": data.project, "name": data.display_name, "config": norm(data.config),
            "rows": _no_artifact_ids(norm(data.rows_by(STEP_METRIC))), "tables": tables,
            "summary": _no_artifact_ids(norm(summary))}


def _same_number(got: Any, want: Any) -> bool:
    if type(want) is bool:
        return got is want
    if isinstance(want, float) and math.isnan(want):
        return got == "<nan>" or isinstance(got, float) and math.isnan(got)
    return got == want


def _check_rows(rows: dict, cap: dict, key_map=lambda k: k, value_map=lambda v: v) -> None:
    want = _merged(cap)
    assert sorted(rows) == sorted(want)
    for step, values in want.items():
        row = {k: v for k, v in rows[step].items() if k not in (STEP_METRIC, "val/generations")}
        expected = {key_map(k): value_map(v) for k, v in values.items()}
        assert set(row) == set(expected), (step, set(row) ^ set(expected))
        bad = {k: (row[k], v) for k, v in expected.items() if not _same_number(row[k], v)}
        assert not bad, (step, bad)


# ----------------------------------------------------------------------------- SwanLab


def _swanlab_runs(root: Path) -> dict[str, list]:
    """SwanLab runs by otel-rl run id, without SwanLab's own system metrics (``__swanlab__.*``)."""
    out: dict[str, list] = {}
    for r in read_runs(root / "swanlog"):
        r.scalars = {step: kept for step, values in r.scalars.items()
                     if (kept := {k: v for k, v in values.items() if not k.startswith("__swanlab__.")})}
        out.setdefault(r.config.get("OTEL_RL_RUN_ID"), []).append(r)
    return out


def _swanlab_snapshot(runs: list) -> dict[str, Any]:
    assert len(runs) == 1, [r.run_dir for r in runs]
    r = runs[0]
    tables = {(k, step): norm(r.table(k, step)) for k, by_step in r.media.items() for step in by_step}
    return {"project": r.project, "name": r.name, "state": r.state, "config": norm(r.config),
            "scalars": norm(r.scalars), "tables": tables}


def _num(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


# ----------------------------------------------------------------------------- tests


def test_sigterm_exits_0_after_delivering_everything(scenario):
    s = scenario
    assert s.exit_code == 0, s.bridge.log()[-3000:]
    summary = s.bridge.stopped
    assert summary is not None, "no final summary"
    sent = sum(cap["stats"]["exporters"][name]["exported"] for cap in s.caps.values()
               for name in ("otlp", "otlp-json") if name in cap["stats"]["exporters"])
    assert summary["spans_accepted"] == sent > 0
    assert summary["spans_rejected"] == 0 and summary["pipeline_dropped"] == 0
    for name in ("mlflow", "wandb", "swanlab"):
        st = summary["exporters"][name]
        assert st["dropped"] == 0 and st["queued"] == 0 and st["exported"] > 0, (name, st)
    assert summary["runs"] == 3
    assert summary["rejected_by_reason"] == {}
    assert summary["metric_points"] > 0  # the trainers' OTLP metrics were received (and counted)
    log = s.bridge.log()
    assert "Traceback" not in log, log[-3000:]


def test_in_process_and_bridge_stores_are_identical(scenario):
    s = scenario
    eq = s.eq
    # MLflow
    a = _mlflow_snapshot(f"sqlite:///{s.a}/mlflow.db", eq.project)
    b = _mlflow_snapshot(f"sqlite:///{s.b}/mlflow.db", eq.project)
    assert list(a) == list(b) == [eq.run_id]
    ra, rb = a[eq.run_id], b[eq.run_id]
    assert ra["metrics"] and len(ra["traces"]) == 6 and len(ra["tables"]) == 2
    for key in ("name", "status", "params", "tags", "metrics", "tables"):
        assert ra[key] == rb[key], key
    assert set(ra["traces"]) == set(rb["traces"])
    for tid in ra["traces"]:
        assert ra["traces"][tid] == rb["traces"][tid], tid
    # wandb (the wandb run id is the otel-rl run id)
    wa, wb = _wandb_snapshot(s.a, eq.run_id), _wandb_snapshot(s.b, eq.run_id)
    assert wa["rows"] and wa["tables"] and wa["config"]
    assert wa == wb
    # SwanLab
    sa = _swanlab_snapshot(_swanlab_runs(s.a)[eq.run_id])
    sb = _swanlab_snapshot(_swanlab_runs(s.b)[eq.run_id])
    assert sa["scalars"] and sa["tables"] and sa["state"] == "RUN_STATE_FINISHED"
    assert sa == sb


def test_each_transport_reaches_the_stores(scenario):
    """HTTP/protobuf, gRPC and HTTP/JSON trainers: the bridge's stores hold exactly what each one recorded."""
    s = scenario
    uri = f"sqlite:///{s.b}/mlflow.db"
    runs = {**_mlflow_snapshot(uri, s.eq.project), **_mlflow_snapshot(uri, s.conc.project)}
    swan = _swanlab_runs(s.b)
    keys = KeyMap()
    for mode, run_id in (("both", s.eq.run_id), ("grpc", "conc-grpc"), ("json", "conc-json")):
        cap = s.caps[mode]
        assert cap["run_id"] == run_id
        _check_mlflow_against_capture(runs[run_id], cap)
        w = _wandb_snapshot(s.b, run_id)
        _check_rows(w["rows"], cap)
        assert w["config"] == norm(cap["config"])
        rows: dict[int, dict] = {}
        for r in swan[run_id]:
            for step, values in r.scalars.items():
                rows.setdefault(step, {}).update(values)
        _check_rows(rows, cap, key_map=keys, value_map=_num)
    # the official OTLP/JSON encoder when it is installed (a test extra), else spec JSON from the protobuf
    assert s.caps["json"]["encoder"] == ("official" if official_json_encoder() is not None else "spec")


def test_two_concurrent_trainers_get_two_runs(scenario):
    s = scenario
    runs = _mlflow_snapshot(f"sqlite:///{s.b}/mlflow.db", s.conc.project)
    assert sorted(runs) == ["conc-grpc", "conc-json"]
    assert {r["name"] for r in runs.values()} == {s.conc.experiment}
    for rid, run in runs.items():  # nothing of the other trainer's trajectories
        mine = {otel_rl_mlflow.mlflow_trace_id(int(t["trace_id"], 16))
                for t in s.caps["grpc" if rid == "conc-grpc" else "json"]["trajectories"]}
        assert set(run["traces"]) == mine
    for rid in ("conc-grpc", "conc-json"):
        assert len(find_run_dirs(str(s.b / "wandb"), run_id=rid)) == 1
    assert {"conc-grpc", "conc-json"} <= set(_swanlab_runs(s.b))
