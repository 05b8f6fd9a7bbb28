"""TensorBoard, Trackio and ClearML through the export process (the same stores as in-process), through verl's
own `Tracking` after `install()`, and spooled then replayed while a store cannot be written."""

from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("trackio")
pytest.importorskip("clearml")
pytest.importorskip("otel_rl_tensorboard")
pytest.importorskip("otel_rl_trackio")
pytest.importorskip("otel_rl_clearml")

import otel_rl  # noqa: E402
from otel_rl.export_process.client import RemoteExporter  # noqa: E402

from .new_stores import (GENERATIONS, assert_same_points, clearml_config, clearml_expected,  # noqa: E402
                         clearml_points, clearml_sessions, clearml_tables, clearml_task, run_workload,
                         tb_expected, tb_points, tb_texts, trackio_expected, trackio_points, trackio_traces,
                         workload_steps)

pytestmark = pytest.mark.slow
TRACKERS = ["tensorboard", "trackio", "clearml"]


@pytest.fixture
def stores(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_RL_", "CLEARML_", "TRAINS_", "TRACKIO_SPACE", "TRACKIO_SERVER", "VERL_FILE_LOGGER")) \
                or k == "TENSORBOARD_DIR":
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(otel_rl._values, "_warned_keys", set())
    yield tmp_path
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def _snapshot(root, project: str, experiment: str) -> dict:
    """Each store of one run, as its tracker's reader gives it back."""
    tb = root / "tensorboard_log" / project / experiment
    sessions = [s for s in clearml_sessions(root / "cache") if clearml_task(s)["name"] == experiment]
    assert len(sessions) == 1, sessions
    config = clearml_config(sessions[0])
    config.pop("OTEL_RL_RUN_ID")
    return {"tb": tb_points(tb), "tb_text": tb_texts(tb, "val/generations"),
            "trackio": trackio_points(project, experiment),
            "trackio_traces": {s: [(t["messages"], t["metadata"]) for t in ts]
                               for s, ts in trackio_traces(project, experiment).items()},
            "clearml": clearml_points(sessions[0]), "clearml_tables": clearml_tables(sessions[0]),
            "clearml_config": config}


def _check(snap: dict) -> None:
    calls = workload_steps()
    assert_same_points(snap["tb"], tb_expected(calls))
    assert_same_points(snap["trackio"], trackio_expected(calls))
    assert_same_points(snap["clearml"], clearml_expected(calls))
    assert sorted(snap["tb_text"]) == sorted(snap["trackio_traces"]) == sorted(snap["clearml_tables"]) \
        == sorted(GENERATIONS)


def test_export_process_writes_the_same_stores_as_in_process(stores):
    project = f"ep-{uuid.uuid4().hex[:6]}"
    config = {"trainer": {"logger": TRACKERS}, "lr": 1e-6}
    snaps = {}
    for where in ("true", "false"):
        h = otel_rl.init(config, project=project, experiment=f"in-{where}", exporters=TRACKERS, batch_delay_s=0.02,
                         export_process=where)
        assert all(isinstance(e, RemoteExporter) == (where == "true") for e in h.exporters)
        run_workload(lambda values, step: otel_rl.log(values, step=step),
                     lambda rows, step: otel_rl.log_generations(rows, step=step))
        h.shutdown()
        for name in TRACKERS:
            st = h.stats()["exporters"][name]
            assert st["dropped"] == 0 and st["queued"] == 0 and st["exported"] > 0, (name, st)
        snaps[where] = _snapshot(stores, project, f"in-{where}")
        _check(snaps[where])
    remote, local = snaps["true"], snaps["false"]
    assert remote["clearml_config"] == local["clearml_config"] == config
    for key in remote:
        if key in ("tb", "trackio", "clearml"):
            assert_same_points(remote[key], local[key])
        else:
            assert remote[key] == local[key], key


def test_verls_own_tracking_after_install_reaches_every_store(stores):
    tracking = pytest.importorskip("verl.utils.tracking")
    from otel_rl.integrations import verl as iv

    project = f"verl-{uuid.uuid4().hex[:6]}"
    iv.install()
    try:
        t = tracking.Tracking(project, "grpo", ["console", "tensorboard", "trackio", "clearml", "file"],
                              config={"trainer": {"logger": TRACKERS}})
        assert {"tensorboard", "trackio", "clearml", "console", "file"} <= set(t.logger)
        for step, values in workload_steps():
            t.log(values, step)
        t.finish()
    finally:
        iv.uninstall()
    calls = workload_steps()
    tb = stores / "tensorboard_log" / project / "grpo"
    assert_same_points(tb_points(tb), tb_expected(calls))
    assert_same_points(trackio_points(project, "grpo"), trackio_expected(calls))
    (session,) = clearml_sessions(stores / "cache")
    assert_same_points(clearml_points(session), clearml_expected(calls))
    assert (stores / project / "grpo.jsonl").is_file()


def test_unwritable_tensorboard_directory_spools_then_replays_everything(stores, monkeypatch):
    blocker = stores / "blocked"
    blocker.write_text("a file where the event directory should be")
    monkeypatch.setenv("TENSORBOARD_DIR", str(blocker / "tb"))
    h = otel_rl.init(project="spool", experiment="e", exporters=["tensorboard"], batch_delay_s=0.02,
                     export_process="false", spool_dir=str(stores / "spool"))
    for step, values in workload_steps():
        assert otel_rl.log(values, step=step) is None  # never raises into the trainer
    assert h.flush(0.5) is False
    st = h.stats()["exporters"]["tensorboard"]
    assert st["failed_attempts"] >= 1 and st["spooled"] > 0 and st["dropped"] == 0, st
    blocker.unlink()
    assert h.flush(60)
    h.shutdown()
    st = h.stats()["exporters"]["tensorboard"]
    assert st["replayed"] > 0 and st["dropped"] == 0 and st["queued"] == 0, st
    assert_same_points(tb_points(blocker / "tb"), tb_expected(workload_steps()))
    shutil.rmtree(blocker)


def test_unwritable_clearml_cache_directory_spools_then_replays_everything(stores, monkeypatch):
    blocker = stores / "blocked"
    blocker.write_text("a file where ClearML's cache directory should be")
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(blocker / "cache"))
    h = otel_rl.init(project="spool", experiment="e", exporters=["clearml"], batch_delay_s=0.02,
                     export_process="false", spool_dir=str(stores / "spool"))
    for step, values in workload_steps():
        assert otel_rl.log(values, step=step) is None
    assert h.flush(0.5) is False
    deadline = time.monotonic() + 60  # ClearML's Task.init takes about a second to fail
    while h.stats()["exporters"]["clearml"]["failed_attempts"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    st = h.stats()["exporters"]["clearml"]
    assert st["failed_attempts"] >= 1 and st["spooled"] > 0 and st["dropped"] == 0, st
    blocker.unlink()
    assert h.flush(60)
    h.shutdown()
    st = h.stats()["exporters"]["clearml"]
    assert st["replayed"] > 0 and st["dropped"] == 0 and st["queued"] == 0, st
    (session,) = clearml_sessions(blocker / "cache")
    assert_same_points(clearml_points(session), clearml_expected(workload_steps()))
