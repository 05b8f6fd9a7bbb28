"""TensorBoard exporter: event files read back with TensorBoard's own EventAccumulator, compared with what
verl's torch SummaryWriter writes for the same calls, and served by a real `tensorboard --logdir`."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
otel_rl_tensorboard = pytest.importorskip("otel_rl_tensorboard")

import otel_rl  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, StepMetrics  # noqa: E402
from otel_rl_tensorboard import TensorboardExporter, log_dir  # noqa: E402

from .new_stores import (GENERATIONS, assert_same_points, run_workload, tb_expected, tb_points, tb_texts,  # noqa: E402
                         workload_steps)

CONFIG = {"trainer": {"project_name": "tb", "logger": ["tensorboard"]}, "actor": {"lr": 1e-6, "名": "值"}}


@pytest.fixture
def tb_env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_RL_") or k == "TENSORBOARD_DIR":
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(otel_rl._values, "_warned_keys", set())
    yield tmp_path
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def _run(**kw) -> otel_rl.Handle:
    h = otel_rl.init(CONFIG, project="tb", experiment="grpo", exporters=["tensorboard"], batch_delay_s=0.02,
                     export_process="false", **kw)
    run_workload(lambda values, step: otel_rl.log(values, step=step),
                 lambda rows, step: otel_rl.log_generations(rows, step=step))
    h.shutdown()
    return h


def test_every_scalar_reads_back_with_event_accumulator_nan_inf_repeats_and_order_kept(tb_env):
    _run()
    path = tb_env / "tensorboard_log" / "tb" / "grpo"  # verl's default directory
    got = tb_points(path)
    assert_same_points(got, tb_expected(workload_steps()))
    # TensorBoard keeps every point: a repeated step twice, an earlier step after a later one where it came
    assert [(s, v) for k, s, v in got if k == "actor/pg_loss"] == [(1, 0.5), (1, -0.5), (2, 0.25), (2, -0.25),
                                                                  (3, pytest.approx(0.5 / 3)),
                                                                  (3, pytest.approx(-0.5 / 3))]
    assert any(math.isnan(v) for k, _, v in got if k == "nan/metric")
    assert [v for k, _, v in got if k == "inf/neg"] == [-math.inf] * 3


def test_config_and_generations_are_text_tables_per_step(tb_env):
    h = _run()
    path = tb_env / "tensorboard_log" / "tb" / "grpo"
    (config_text,) = tb_texts(path, "config")[0]
    assert config_text.startswith("```json\n") and config_text.endswith("\n```")
    assert json.loads(config_text[len("```json\n"):-len("\n```")]) == CONFIG
    tables = tb_texts(path, "val/generations")
    assert sorted(tables) == sorted(GENERATIONS)
    for step, rows in GENERATIONS.items():
        assert tables[step] == [[["input", "output", "score"]] + [[i, o, str(s)] for i, o, s in rows]]
    assert h.stats()["exporters"]["tensorboard"]["dropped"] == 0


def test_tensorboard_dir_variable_wins_and_a_second_identity_gets_its_own_directory(tb_env, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_DIR", "custom/tb")
    exp = TensorboardExporter(resolve(env={}, exporters=[]))
    a, b = RunIdentity("p", "e", "run-a"), RunIdentity("p", "e", "run-b")
    monkeypatch.chdir(tb_env / "..")  # relative directories are taken as at init()
    exp.export_records([RunStart(a, {}, 0, 1), StepMetrics(a, 1, {"x": 1.0}, 10**9),
                        RunStart(b, {}, 0, 2), StepMetrics(b, 1, {"x": 2.0}, 2 * 10**9)])
    exp.shutdown()
    assert log_dir("p", "e", {"TENSORBOARD_DIR": "custom/tb"}, str(tb_env)) == str(tb_env / "custom" / "tb")
    assert tb_points(tb_env / "custom" / "tb") == [("x", 1, 1.0)]
    assert tb_points(tb_env / "custom" / "tb" / "run-b") == [("x", 1, 2.0)]


def test_event_files_read_the_same_as_verls_torch_summary_writer(tb_env, monkeypatch):
    """verl's `_TensorboardAdapter` (torch's SummaryWriter) and this exporter, same calls: the same points."""
    pytest.importorskip("torch")
    from verl.utils.tracking import _TensorboardAdapter

    monkeypatch.setenv("TENSORBOARD_DIR", str(tb_env / "verl"))
    verl = _TensorboardAdapter("tb", "grpo")
    for step, values in workload_steps():
        verl.log(values, step)
    verl.finish()
    monkeypatch.setenv("TENSORBOARD_DIR", str(tb_env / "ours"))
    h = otel_rl.init(project="tb", experiment="grpo", exporters=["tensorboard"], batch_delay_s=0.02,
                     export_process="false")
    for step, values in workload_steps():
        otel_rl.log(values, step=step)
    h.shutdown()
    ours, theirs = tb_points(tb_env / "ours"), tb_points(tb_env / "verl")
    assert ours and len(ours) == len(theirs)
    assert_same_points(ours, theirs)


@pytest.mark.slow
def test_tensorboard_server_scalars_api_serves_the_runs_series(tb_env):
    _run()
    exe = Path(sys.executable).parent / "tensorboard"
    proc = subprocess.Popen([str(exe), "--logdir", str(tb_env / "tensorboard_log"), "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = None
        deadline = time.monotonic() + 90
        while base is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            m = re.search(r"(http://127\.0\.0\.1:\d+)/", line or "")
            if m:
                base = m.group(1)
            elif not line and proc.poll() is not None:
                break
        assert base, "tensorboard did not start"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def get(path: str):
            for _ in range(100):  # the server loads the event files shortly after it starts
                body = json.loads(opener.open(base + path, timeout=30).read())
                if body:
                    return body
                time.sleep(0.2)
            return body

        tags = get("/data/plugin/scalars/tags")
        assert set(tags) == {"tb/grpo"}
        want = tb_expected(workload_steps())
        assert set(tags["tb/grpo"]) == {k for k, _, _ in want}
        for key in ("actor/pg_loss", "nan/metric", "inf/pos", "指标/损失", "late/value"):
            q = urllib.parse.urlencode({"run": "tb/grpo", "tag": key})
            series = get(f"/data/plugin/scalars/scalars?{q}")
            got = [(s, {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, v))
                   for _, s, v in series]
            # the server (its default data loader) shows one point per step: the last one written, by step
            last = {}
            for _, s, v in (p for p in want if p[0] == key):
                last[s] = v
            assert_same_points([(key, s, float(v)) for s, v in got], [(key, s, last[s]) for s in sorted(last)])
    finally:
        proc.terminate()
        proc.wait(30)
