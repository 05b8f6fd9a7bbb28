"""What `log()` prints and writes in the edge cases where it must behave as verl's loggers do, and the
routing and messages around it (a trace backend, a forked child, an unwritable JSONL path)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import otel_rl
from otel_rl import _values
from otel_rl.testing import CaptureExporter


def _run(tmp_path, data_calls, **kw):
    """log() each (data, step) through console and JSONL exporters; (stdout text, JSONL bytes)."""
    path = tmp_path / "m.jsonl"
    h = otel_rl.init(logger=["console", "file"], jsonl_path=str(path), export_interval_s=0, **kw)
    for data, step in data_calls:
        h.log(data, step)
    h.shutdown()
    return path.read_bytes()


def _verl_file_bytes(tmp_path, data_calls) -> bytes:
    tracking = pytest.importorskip("verl.utils.tracking")
    os.environ["VERL_FILE_LOGGER_PATH"] = str(tmp_path / "verl.jsonl")
    try:
        fl = tracking.FileLogger("p", "e")
        for data, step in data_calls:
            fl.log(data, step)
        fl.finish()
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
    return (tmp_path / "verl.jsonl").read_bytes()


def test_console_key_control_characters_cannot_forge_a_line(tmp_path, capsys):
    _run(tmp_path, [({"loss\nstep:999 - loss:0.0": 1.5, "a\rb\x1b[2J\u2028": 2}, 4)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step:")]
    assert lines == ["step:4 - loss\\nstep:999 - loss:0.0:1.5 - a\\rb\\x1b[2J\\u2028:2"]


def test_jsonl_key_with_lone_surrogate_is_valid_utf8_json(tmp_path):
    raw = _run(tmp_path, [({"bad\ud800key": 1.0, "pair\ud83d\ude00": 2}, 1)])
    (line,) = raw.decode("utf-8").splitlines()  # strict UTF-8: no surrogates written
    assert json.loads(line) == {"step": 1, "data": {"bad\ufffdkey": 1.0, "pair\U0001F600": 2}}


def test_numpy_float32_printed_and_written_as_verl(tmp_path, capsys):
    calls = [({"a": np.float32(0.1), "c": np.float64(0.1), "d": np.float32(3.25), "e": np.float32(1e-7)}, 1)]
    ours = _run(tmp_path, calls)
    out = capsys.readouterr().out
    assert "step:1 - a:0.1 - c:0.1 - d:3.25 - e:1e-07" in out.splitlines()
    assert ours == _verl_file_bytes(tmp_path, calls)  # verl's file logger: orjson's shortest float32 text


def test_empty_log_call_writes_the_step_as_verl(tmp_path, capsys):
    calls = [({}, 2)]
    ours = _run(tmp_path, calls)
    assert "step:2" in capsys.readouterr().out.splitlines()
    assert ours == b'{"step":2,"data":{}}\n' == _verl_file_bytes(tmp_path, calls)


def test_step_given_as_digit_string_is_that_step():
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], batch_delay_s=0.05)
    try:
        h.log({"x": 1.0}, step=5)
        h.log({"x": 2.0}, step="7")
        h.log({"x": 3.0}, step=b" 8 ")
        cap.collect()
        assert [(m.step, m.values["x"]) for m in cap.step_metrics()] == [(5, 1.0), (7, 2.0), (8, 3.0)]
    finally:
        h.shutdown()


def test_log_in_forked_child_says_it_is_a_forked_child(tmp_path):
    script = textwrap.dedent("""
        import os, sys
        import otel_rl
        otel_rl.init(logger=["console"])
        otel_rl.log({"parent": 1.0}, step=1)
        pid = os.fork()
        if pid == 0:
            otel_rl.log({"child": 1.0}, step=1)
            sys.stderr.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        otel_rl.shutdown()
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "log() in a forked child process" in res.stderr
    assert "otel_rl.init() in the child" in res.stderr
    assert "called before otel_rl.init()" not in res.stderr


def test_unknown_trace_backend_warns_and_metrics_still_flow(caplog):
    _values._warned_keys.discard("trace-backend:no_such_backend")
    caplog.set_level(logging.WARNING, logger="otel_rl")
    cap = CaptureExporter()
    h = otel_rl.init(["trainer.logger=[console]", "actor_rollout_ref.rollout.trace.backend=no_such_backend"],
                     exporters=[cap], batch_delay_s=0.05)
    try:
        h.log({"x": 1.0}, step=1)
        assert cap.collect().metrics_by_step() == {1: {"x": 1.0}}
        assert h.config.trace_backend is None
        assert any("no_such_backend" in r.getMessage() and "without rollout traces" in r.getMessage()
                   for r in caplog.records)
    finally:
        h.shutdown()


def test_trace_backend_not_in_logger_list_gets_only_trajectories(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    h = otel_rl.init(["trainer.project_name=routing", "trainer.experiment_name=r1", "trainer.logger=[console]",
                      "actor_rollout_ref.rollout.trace.backend=mlflow"], export_process="false")
    try:
        for n in (1, 2):
            with otel_rl.step(n):
                with otel_rl.trajectory(sample_index=0):
                    pass
                otel_rl.log({"actor/pg_loss": 0.5 * n}, step=n)
        otel_rl.log_generations([("q", "a", 1.0)], step=2)
    finally:
        h.shutdown()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("routing")
    traces = client.search_traces(locations=[exp.experiment_id], filter_string="tags.step = '2'")
    assert len(traces) == 1  # the trajectories reach the trace backend
    runs = client.search_runs([exp.experiment_id])
    assert all(not r.data.metrics for r in runs)  # the metrics do not (verl sends them only to the loggers)
    assert all(not client.list_artifacts(r.info.run_id) for r in runs)  # nor the generations table


def test_unwritable_jsonl_path_is_named_in_the_init_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    path = blocker / "sub" / "m.jsonl"  # its parent cannot be a directory
    with pytest.raises(otel_rl.ConfigError) as info:
        otel_rl.init(logger=["console", "file"], jsonl_path=str(path))
    assert str(path) in str(info.value) and "jsonl_path" in str(info.value)
    assert otel_rl.current() is None
