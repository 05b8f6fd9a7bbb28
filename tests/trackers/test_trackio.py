"""Trackio exporter: local runs only, read back from Trackio's own sqlite store (`SQLiteStorage`)."""

from __future__ import annotations

import os
import uuid

import pytest

trackio = pytest.importorskip("trackio")
pytest.importorskip("otel_rl_trackio")

import otel_rl  # noqa: E402

from .new_stores import (GENERATIONS, assert_same_points, run_workload, trackio_expected, trackio_points,  # noqa: E402
                         trackio_rows, trackio_traces, workload_steps)

CONFIG = {"trainer": {"logger": ["trackio"]}, "actor": {"lr": 1e-6, "名": "值"}}


@pytest.fixture
def trackio_env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_RL_", "TRACKIO_SPACE", "TRACKIO_SERVER", "HF_TOKEN")):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(otel_rl._values, "_warned_keys", set())
    yield f"otel-rl-{uuid.uuid4().hex[:8]}"  # a project of its own in Trackio's directory
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def test_every_row_reads_back_from_trackios_store_with_config_and_generations(trackio_env):
    project = trackio_env
    h = otel_rl.init(CONFIG, project=project, experiment="grpo", exporters=["trackio"], batch_delay_s=0.02,
                     export_process="false")
    run_workload(lambda values, step: otel_rl.log(values, step=step),
                 lambda rows, step: otel_rl.log_generations(rows, step=step))
    h.shutdown()
    assert_same_points(trackio_points(project, "grpo"), trackio_expected(workload_steps()))
    rows = trackio_rows(project, "grpo")
    # one row per log() call, in call order: the repeated step twice, the earlier step after the later one
    metric_rows = [r for r in rows if set(r) - {"step", "timestamp"}]
    assert [r["step"] for r in metric_rows] == [1, 1, 2, 2, 3, 3, 2]
    from trackio.sqlite_storage import SQLiteStorage

    config = SQLiteStorage.get_run_config(project, "grpo")
    assert {k: v for k, v in config.items() if not k.startswith("_")} == {"OTEL_RL_RUN_ID": h.run_id, **CONFIG}
    traces = trackio_traces(project, "grpo")
    assert sorted(traces) == sorted(GENERATIONS)
    for step, gens in GENERATIONS.items():
        logged = traces[step]
        assert [[m["content"] for m in t["messages"]] for t in logged] == [[i, o] for i, o, _ in gens]
        assert [t["metadata"]["score"] for t in logged] == [s for _, _, s in gens]
        assert [t["metadata"]["sample_index"] for t in logged] == list(range(len(gens)))


def test_a_trackio_run_already_open_in_the_process_is_reused_and_left_open(trackio_env):
    project = trackio_env
    app = trackio.init(project=project, name="mine", config={"own": 1})
    app.log({"own/metric": 1.0}, step=0)
    h = otel_rl.init(project="ignored", experiment="e", exporters=["trackio"], batch_delay_s=0.02,
                     export_process="false")
    otel_rl.log({"x": 2.0}, step=1)
    h.shutdown()
    app.log({"own/metric": 3.0}, step=2)  # still open: otel-rl did not finish it
    trackio.finish()
    assert trackio_points(project, "mine") == [("own/metric", 0, 1.0), ("x", 1, 2.0), ("own/metric", 2, 3.0)]
    from trackio.sqlite_storage import SQLiteStorage

    assert "ignored" not in SQLiteStorage.get_projects()
