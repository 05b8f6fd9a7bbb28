"""verl's whole `trainer.logger` list at once -- console, tensorboard, trackio, clearml, mlflow, wandb,
swanlab, file -- through otel-rl's own API and through verl's `Tracking` after `install()`: each of the
eight stores read back with its tracker's reader holds exactly the values logged, step by step."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Any

import pytest

for _lib in ("mlflow", "wandb", "swanlab", "tensorboard", "trackio", "clearml", "otel_rl_mlflow", "otel_rl_wandb",
             "otel_rl_swanlab", "otel_rl_tensorboard", "otel_rl_trackio", "otel_rl_clearml"):
    pytest.importorskip(_lib)

import wandb  # noqa: E402
from bridge.helpers import tracker_env  # noqa: E402
from bridge.test_trackers import _mlflow_snapshot  # noqa: E402
from otel_rl_swanlab.offline import read_run as read_swanlab_run, run_dirs as swanlab_run_dirs  # noqa: E402
from otel_rl_wandb import STEP_METRIC  # noqa: E402
from otel_rl_wandb.reader import find_run_dirs, read_run as read_wandb_run  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl.serialize import parse_json_float  # noqa: E402

from .new_stores import (assert_same_points, clearml_expected, clearml_points, clearml_sessions,  # noqa: E402
                         clearml_task, points, tb_expected, tb_points, trackio_expected, trackio_points)
from .test_new_trackers_delivery import stores  # noqa: E402,F401  (fixture)

pytestmark = pytest.mark.slow
LOGGERS = ["console", "tensorboard", "trackio", "clearml", "mlflow", "wandb", "swanlab", "file"]
EXPERIMENT = "grpo"


def _calls() -> list[tuple[int, dict[str, Any]]]:
    """verl-style keys, floats at full precision, ints, a key without `/`; step 2 has no `timing_s/gen`."""
    calls = []
    for n in (1, 2, 3):
        values = {"actor/pg_loss": -0.1 * n + 1 / 3, "actor/lr": 1e-6 * n, "critic/score/mean": n / 7,
                  "response_length/max": 512 * n, "timing_s/gen": 1.25 + n / 9, "epoch": n // 2}
        if n == 2:
            del values["timing_s/gen"]
        calls.append((n, values))
    return calls


@pytest.fixture
def all_stores(stores, monkeypatch):
    """Every store under one temporary directory: MLflow sqlite, wandb and SwanLab offline, TensorBoard,
    Trackio, ClearML offline and the file logger beside them; no tracker settings from outside."""
    for k in list(os.environ):
        if k.startswith(("OTEL_", "WANDB_", "SWANLAB_", "MLFLOW_")):
            monkeypatch.delenv(k)
    for k, v in tracker_env(stores).items():
        monkeypatch.setenv(k, v)
    wandb.teardown()
    yield stores
    wandb.teardown()


def _file_points(path: Path) -> list[tuple[str, int, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        out.extend((k, rec["step"], parse_json_float(v)) for k, v in rec["data"].items())
    return out


def _console_points(text: str) -> list[tuple[str, int, Any]]:
    out = []
    for line in text.splitlines():
        if not line.startswith("step:"):
            continue
        head, *items = line.split(" - ")
        step = int(head[len("step:"):])
        for item in items:
            key, _, value = item.rpartition(":")
            out.append((key, step, ast.literal_eval(value)))
    return out


def _check_every_store(root: Path, project: str, run_id: str, console: str) -> None:
    calls = _calls()
    want = points(calls)
    assert_same_points(_console_points(console), want)
    assert_same_points(_file_points(root / project / f"{EXPERIMENT}.jsonl"), want)

    assert_same_points(tb_points(root / "tensorboard_log" / project / EXPERIMENT), tb_expected(calls))
    assert_same_points(trackio_points(project, EXPERIMENT), trackio_expected(calls))
    (session,) = [s for s in clearml_sessions(root / "cache") if clearml_task(s)["name"] == EXPERIMENT]
    assert_same_points(clearml_points(session), clearml_expected(calls))

    mlflow_runs = _mlflow_snapshot(f"sqlite:///{root}/mlflow.db", project)
    assert list(mlflow_runs) == [run_id]
    mlflow_want: dict[str, list] = {}
    for k, s, v in want:
        mlflow_want.setdefault(k, []).append((s, repr(float(v))))
    assert {k: [(s, v) for s, _, v in pts] for k, pts in mlflow_runs[run_id]["metrics"].items()} == mlflow_want

    (wandb_dir,) = find_run_dirs(str(root / "wandb"))
    run = read_wandb_run(wandb_dir)
    assert run.exit_seen and run.complete and run.project == project
    assert_same_points([(k, step, v) for step, row in run.rows_by(STEP_METRIC).items()
                        for k, v in row.items() if k != STEP_METRIC], want)

    (swan_dir,) = swanlab_run_dirs(root / "swanlog")
    swan = read_swanlab_run(swan_dir)
    assert swan.state == "RUN_STATE_FINISHED" and swan.project == project and swan.name == EXPERIMENT
    assert_same_points([(k, step, v) for step, row in swan.scalars.items() for k, v in row.items()
                        if not k.startswith("__swanlab__.")], [(k, s, float(v)) for k, s, v in want])


def test_native_api_with_every_verl_logger_reaches_every_store(all_stores, capsys):
    project = "native-all"
    config = {"trainer": {"project_name": project, "experiment_name": EXPERIMENT, "logger": LOGGERS}}
    h = otel_rl.init(config)
    assert [e.name for e in h.exporters] == LOGGERS
    for step, values in _calls():
        otel_rl.log(values, step=step)
    h.shutdown()
    for name in LOGGERS:
        st = h.stats()["exporters"][name]
        assert st["dropped"] == 0 and st["queued"] == 0 and st["exported"] > 0, (name, st)
    _check_every_store(all_stores, project, h.run_id, capsys.readouterr().out)


def test_verls_own_tracking_after_install_with_every_logger_reaches_every_store(all_stores, capsys):
    tracking = pytest.importorskip("verl.utils.tracking")
    from otel_rl.integrations import verl as iv

    project = "verl-all"
    iv.install()
    try:
        t = tracking.Tracking(project, EXPERIMENT, LOGGERS, config={"trainer": {"logger": LOGGERS}})
        assert sorted(t.logger) == sorted(LOGGERS)
        for step, values in _calls():
            t.log(values, step)
        run_id = t.handle.run_id
        t.finish()
    finally:
        iv.uninstall()
    _check_every_store(all_stores, project, run_id, capsys.readouterr().out)
