"""ClearML exporter in offline mode: the session folder ClearML writes read back (metrics.jsonl, task.json with
the configuration parsed by ClearML's own HOCON reader, the zip).  Talking to a ClearML server
(`CLEARML_API_HOST`, a clearml.conf) cannot be tested here: no server runs on this machine."""

from __future__ import annotations

import os
import zipfile

import pytest

pytest.importorskip("clearml")
otel_rl_clearml = pytest.importorskip("otel_rl_clearml")

import otel_rl  # noqa: E402
from otel_rl_clearml import offline_mode, split_key  # noqa: E402

from .new_stores import (GENERATIONS, assert_same_points, clearml_config, clearml_expected,  # noqa: E402
                         clearml_points, clearml_sessions, clearml_tables, clearml_task, run_workload,
                         workload_steps)

CONFIG = {"trainer": {"logger": ["clearml"]}, "actor": {"lr": 1e-6, "ppo_mini_batch_size": 8}, "files": ["a", "b"]}


@pytest.fixture
def clearml_env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith(("OTEL_RL_", "CLEARML_", "TRAINS_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/clearml.conf: offline
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(otel_rl._values, "_warned_keys", set())
    yield tmp_path / "cache"
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def test_split_key_and_offline_rule():
    assert split_key("actor/pg_loss") == ("actor", "pg_loss")
    assert split_key("a/b/c") == ("a", "b/c")  # at the first "/" as verl
    assert split_key("plain") == ("plain", "plain")  # verl's logger raises on such a key
    assert offline_mode({}) is True or os.path.isfile(os.path.expanduser("~/clearml.conf"))
    assert offline_mode({"CLEARML_API_HOST": "http://127.0.0.1:8008"}) is False
    assert offline_mode({"CLEARML_API_HOST": "http://127.0.0.1:8008", "CLEARML_OFFLINE_MODE": "1"}) is True


@pytest.mark.slow
def test_offline_session_holds_every_scalar_the_config_and_the_tables(clearml_env):
    h = otel_rl.init(CONFIG, project="cml", experiment="grpo", exporters=["clearml"], batch_delay_s=0.02,
                     export_process="false")
    run_workload(lambda values, step: otel_rl.log(values, step=step),
                 lambda rows, step: otel_rl.log_generations(rows, step=step))
    h.shutdown()
    (session,) = clearml_sessions(clearml_env)
    task = clearml_task(session)
    assert (task["project_name"], task["name"]) == ("cml", "grpo")
    # NaN and ±Inf arrive as ClearML's reporting values (0.0 unless Logger.set_reporting_nan_value says otherwise)
    assert_same_points(clearml_points(session), clearml_expected(workload_steps()))
    assert clearml_config(session) == {"OTEL_RL_RUN_ID": h.run_id, **CONFIG}
    tables = clearml_tables(session)
    assert sorted(tables) == sorted(GENERATIONS)
    for step, rows in GENERATIONS.items():
        assert tables[step] == [[["step", "input", "output", "score"]] + [[step, i, o, s] for i, o, s in rows]]
    with zipfile.ZipFile(str(session) + ".zip") as z:  # the session ClearML imports later
        assert {"task.json", "metrics.jsonl"} <= set(z.namelist())
