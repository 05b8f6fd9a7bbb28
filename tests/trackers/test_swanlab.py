"""SwanLab exporter: runs in SwanLab's offline mode, then reads back what SwanLab wrote.

The read-back uses SwanLab's own record reader (`DataStoreReader`, behind
``swanlab sync``) on ``run-<id>.swanlab`` plus ``files/config.yaml`` and the
media files (see otel_rl_swanlab.offline).  Nothing here needs the network.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

swanlab = pytest.importorskip("swanlab")
otel_rl_swanlab = pytest.importorskip("otel_rl_swanlab")

import otel_rl  # noqa: E402
from otel_rl import semconv as sc  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402
from otel_rl_swanlab import KeyMap, SwanlabExporter, sanitize_key  # noqa: E402
from otel_rl_swanlab.offline import read_run, read_runs, run_dirs, same_value  # noqa: E402

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def swan_env(tmp_path, monkeypatch):
    """Offline SwanLab in a temporary directory, no saved login, no otel-rl settings from outside."""
    for k in list(os.environ):
        if k.startswith(("OTEL_RL_", "SWANLAB_")):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    logdir = tmp_path / "swanlog"
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(logdir))
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanroot"))  # where `swanlab login` would have saved a key
    monkeypatch.setattr(otel_rl._values, "_warned_keys", set())  # warnings are once per process
    yield logdir
    if swanlab.has_run():  # a failed test must not leave a run open for the next one
        swanlab.get_run().finish()


def _num(v) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond the double range
        return INF if v > 0 else -INF


def _expected_rows(records_by_step: dict[int, dict]) -> dict[int, dict[str, float]]:
    keys = KeyMap()
    return {step: {keys(k): _num(v) for k, v in values.items()} for step, values in records_by_step.items()}


def _assert_rows(actual: dict[int, dict[str, float]], expected: dict[int, dict[str, float]]) -> None:
    assert sorted(actual) == sorted(expected)
    for step, row in expected.items():
        got = actual[step]
        assert sorted(got) == sorted(row), f"step {step}: keys differ"
        bad = {k: (got[k], v) for k, v in row.items() if not same_value(got[k], v)}
        assert not bad, f"step {step}: {bad}"


def _only_run(logdir: Path):
    dirs = run_dirs(logdir)
    assert len(dirs) == 1, dirs
    return read_run(dirs[0])


# ----------------------------------------------------------------------------- end to end


def test_instrumented_run_round_trips_through_offline_logs(swan_env, caplog):
    """Several log() calls per step, timers added after them, batches split across a step, odd keys,
    NaN/Inf, config and generations: SwanLab's offline logs hold exactly what otel-rl recorded."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    verl_cfg = {
        "trainer": {"project_name": "otel-rl-test", "experiment_name": "grpo 1 中文", "logger": ["swanlab"],
                    "total_training_steps": 4, "log_val_generations": 0},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 8}},
        "data": {"train_files": ["a.parquet", "b.parquet"], "seed": None},
    }
    cap = CaptureExporter()
    h = otel_rl.init(verl_cfg, exporters=["swanlab", cap], batch_delay_s=0.02)
    odd = {
        "中文/损失": 1.5, "ünïcødé/métric": 2.5, "/leading/slash": 3, "trailing.dot.": 4, "ctl\x01key": 5.0,
        "k/" + "x" * 600: 6.0, "__swanlab__.fake": 7.0, "nan": NAN, "inf": INF, "-inf": -INF, "flag": True,
        "huge_int": 10**400, "neg": -0.25,
    }
    gens = {2: [("What is 1+1?", "2", 1.0), ("写一首诗", "床前明月光", 0.5)],
            4: [("q", "a", NAN), ("long " * 50, "out\nwith\nlines", -1.0)]}
    for n in range(1, 5):
        with otel_rl.step(n):
            with otel_rl.timer("gen"):
                time.sleep(0.002)
            otel_rl.log({"actor/pg_loss": 0.1 * n, "critic/score/mean": n, **odd}, step=n)
            time.sleep(0.06)  # > batch_delay_s: the next values of this step come in a later batch
            otel_rl.log({"actor/pg_loss": -0.1 * n, "actor/entropy": 1.0 / n}, step=n)  # later value wins
            with otel_rl.timer("update"):
                time.sleep(0.002)
        if n in gens:
            otel_rl.log_generations(gens[n], step=n)
        time.sleep(0.03)
    h.shutdown()

    run = _only_run(swan_env)
    assert run.state == "RUN_STATE_FINISHED"
    assert run.project == "otel-rl-test"
    assert run.name == "grpo 1 中文"
    expected = _expected_rows(cap.metrics_by_step())
    assert {f"{sc.TIMING_PREFIX}gen", f"{sc.TIMING_PREFIX}update", "actor/pg_loss"} <= set(expected[3])
    _assert_rows(run.scalars, expected)
    assert run.scalars[2]["actor/pg_loss"] == pytest.approx(-0.2)  # the later log() call of the step
    assert math.isinf(run.scalars[1]["huge_int"])
    # SwanLab-invalid keys were renamed once each, the rest kept as they are
    assert sanitize_key("k/" + "x" * 600) in run.scalars[1] and len(sanitize_key("k/" + "x" * 600)) == 512
    assert {"leading/slash", "trailing.dot", "ctl_key", "___swanlab__.fake", "中文/损失"} <= set(run.scalars[1])
    renamed = [r.getMessage() for r in caplog.records if "logged to SwanLab as" in r.getMessage()]
    assert len(renamed) == len(set(renamed)) >= 5

    # config: verl's {"FRAMEWORK": "verl", **config} plus the otel-rl run id
    assert run.config == {"FRAMEWORK": "verl", "OTEL_RL_RUN_ID": h.run_id, **verl_cfg}

    # generations: one echarts.Table per step with verl's columns
    assert sorted(run.media[sc.VAL_GENERATIONS_KEY]) == [2, 4]
    for step, rows in gens.items():
        table = run.table(sc.VAL_GENERATIONS_KEY, step)
        assert table["headers"] == ["step", "input", "output", "score"]
        assert table["rows"] == [[step, i, o, None if math.isnan(s) else s] for i, o, s in rows]


# ----------------------------------------------------------------------------- step rows


def _exporter(**settings):
    cfg = resolve(env={}, exporters=[], **settings)
    return SwanlabExporter(cfg), RunIdentity(cfg.project, cfg.experiment, cfg.run_id)


def test_step_row_is_held_across_batches_and_logged_once(swan_env, caplog):
    """SwanLab keeps the first value logged at a step: values of a step coming in several batches
    (later ones winning) must reach it in one call."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    exp, run = _exporter(project="rows", experiment="e")
    exp.export_records([RunStart(run, {"lr": 0.1}, 0, 1), StepMetrics(run, 1, {"a": 1.0}, 1)])
    exp.export_records([StepMetrics(run, 1, {"a": 2.0, "b": 1}, 2)])  # same step, later batch
    exp.export_records([StepMetrics(run, 1, {sc.TIMING_PREFIX + "gen": 0.5}, 3),  # timings after the metrics
                        StepMetrics(run, 2, {"a": 3.0}, 4)])
    exp.export_records([Generations(run, 2, [("in", "out", 1.0)], 5), StepMetrics(run, 2, {"c": True}, 5)])
    exp.flush()  # step 2 goes out now ...
    exp.export_records([StepMetrics(run, 2, {"d": 4.0, "a": 99.0}, 6)])  # ... so a new key is fine, "a" is not
    exp.export_records([StepMetrics(run, 1, {"late": 5.0}, 7)])  # an older step: logged at once
    exp.export_records([StepMetrics(run, 3, {"a": 4.0}, 8), StepMetrics(run, 3, {"a": 5.0}, 9)])
    exp.shutdown()

    r = _only_run(swan_env)
    _assert_rows(r.scalars, {1: {"a": 2.0, "b": 1.0, sc.TIMING_PREFIX + "gen": 0.5, "late": 5.0},
                             2: {"a": 3.0, "c": 1.0, "d": 4.0}, 3: {"a": 5.0}})
    assert r.table(sc.VAL_GENERATIONS_KEY, 2)["rows"] == [[2, "in", "out", 1.0]]
    assert r.config == {"FRAMEWORK": "verl", "OTEL_RL_RUN_ID": run.run_id, "lr": 0.1}
    dropped = [m for m in caplog.messages if "keeps the first value" in m]
    assert len(dropped) == 1 and "'a'" in dropped[0]


def test_ten_thousand_keys_per_step(swan_env):
    cap = CaptureExporter()
    h = otel_rl.init(project="wide", experiment="e", exporters=["swanlab", cap], batch_delay_s=0.02)
    t0 = time.perf_counter()
    for n in range(1, 4):
        otel_rl.log({f"layer{i % 100}/param{i}/grad_norm": i * n + 0.5 for i in range(10_000)}, step=n)
    h.shutdown()
    elapsed = time.perf_counter() - t0
    run = _only_run(swan_env)
    assert [len(run.scalars[n]) for n in (1, 2, 3)] == [10_000] * 3
    _assert_rows(run.scalars, _expected_rows(cap.metrics_by_step()))
    assert elapsed < 60


def test_key_map_is_stable_and_collision_free():
    keys = KeyMap()
    assert keys("a/b") == "a/b"
    assert keys("/a/b/") != "a/b" and keys("/a/b/").startswith("a/b~")  # would collide with "a/b"
    assert keys("/a/b/") == keys("/a/b/")
    assert keys("x" * 600) == "x" * 512
    assert keys("y" * 511 + "/z") == "y" * 511  # cut, then no trailing "/"
    assert keys("..") == "_" and keys("\x00").startswith("_~")  # both empty after SwanLab's rules
    assert keys("bad\ud800surrogate") == "bad\ufffdsurrogate"
    assert keys("__swanlab__.cpu") == "___swanlab__.cpu"
    for original, mapped in keys.items():
        assert 1 <= len(mapped) <= 512 and not mapped.startswith((".", "/")) and not mapped.endswith((".", "/"))


# ----------------------------------------------------------------------------- runs


def test_one_run_per_process_identities_take_turns(swan_env, caplog):
    """SwanLab has one active run per process: a second identity finishes the first one's run;
    coming back opens a new one (offline mode cannot reopen a finished run)."""
    caplog.set_level(logging.WARNING, logger="otel_rl")
    exp, a = _exporter(project="turns", experiment="a")
    b = RunIdentity("turns", "b", "run-b")
    exp.export_records([RunStart(a, {"who": "a"}, 0, 1), StepMetrics(a, 1, {"x": 1.0}, 1),
                        RunStart(b, {"who": "b"}, 0, 2), StepMetrics(b, 1, {"x": 10.0}, 2)])
    exp.export_records([StepMetrics(a, 2, {"x": 2.0}, 3)])
    exp.shutdown()
    runs = read_runs(swan_env)
    assert [(r.name, r.state) for r in runs] == [("a", "RUN_STATE_FINISHED"), ("b", "RUN_STATE_FINISHED"),
                                                ("a", "RUN_STATE_FINISHED")]
    assert [r.scalars for r in runs] == [{1: {"x": 1.0}}, {1: {"x": 10.0}}, {2: {"x": 2.0}}]
    assert [r.config["who"] for r in runs] == ["a", "b", "a"]
    assert runs[1].config["OTEL_RL_RUN_ID"] == "run-b"
    assert any("one run per process" in m for m in caplog.messages)


def test_application_run_is_used_not_finished(swan_env):
    app_run = swanlab.init(project="app", experiment_name="mine", mode="offline", logdir=str(swan_env),
                           settings=swanlab.Settings(interactive=False))
    app_run.log({"own": 1.0}, step=1)
    exp, run = _exporter(project="ignored", experiment="e")
    exp.export_records([RunStart(run, {"k": "v"}, 0, 1), StepMetrics(run, 2, {"x": 2.0}, 2)])
    exp.shutdown()
    assert app_run.alive  # otel-rl does not finish a run it did not start
    app_run.finish()
    r = _only_run(swan_env)
    assert r.scalars == {1: {"own": 1.0}, 2: {"x": 2.0}}
    assert r.config["k"] == "v" and r.name == "mine"


def test_mode_defaults_to_offline_without_a_key(swan_env, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    exp, run = _exporter(project="modes", experiment="e")
    exp.export_records([StepMetrics(run, 1, {"x": 1.0}, 1)])
    exp.shutdown()
    assert any("offline mode" in m for m in caplog.messages)
    assert _only_run(swan_env).scalars == {1: {"x": 1.0}}

    monkeypatch.setenv("SWANLAB_MODE", "disabled")  # SWANLAB_MODE is used as given
    exp, run = _exporter(project="modes", experiment="e2")
    exp.export_records([StepMetrics(run, 1, {"x": 1.0}, 1)])
    exp.shutdown()
    assert len(run_dirs(swan_env)) == 1


def test_other_ranks_are_idle(swan_env, monkeypatch):
    exp, run = _exporter(project="ranks", experiment="e", rank=1)
    exp.export_records([StepMetrics(run, 1, {"x": 1.0}, 1)])
    exp.shutdown()
    assert run_dirs(swan_env) == []
    monkeypatch.setenv("OTEL_RL_SWANLAB_ALL_RANKS", "true")
    exp, run = _exporter(project="ranks", experiment="e", rank=1)
    exp.export_records([StepMetrics(run, 1, {"x": 1.0}, 1)])
    exp.shutdown()
    assert len(run_dirs(swan_env)) == 1


# ----------------------------------------------------------------------------- entry points, adapter


def test_entry_points_and_span_exporter_adapter(swan_env, monkeypatch):
    """`OTEL_TRACES_EXPORTER=swanlab`: the SpanExporter turns the spans of another process into the same run."""
    from importlib.metadata import entry_points

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_rl.exporters import registry

    assert registry.resolve_factory("swanlab") is SwanlabExporter
    (ep,) = [e for e in entry_points(group="opentelemetry_traces_exporter") if e.name == "swanlab"]
    span_exporter_cls = ep.load()
    assert issubclass(span_exporter_cls, SpanExporter)

    cap = CaptureExporter()  # the producing side: keeps the raw spans it would send over OTLP
    h = otel_rl.init(project="bridge", experiment="e", exporters=[cap], batch_delay_s=0.02)
    for n in (1, 2):
        otel_rl.log({"x": float(n)}, step=n)
        otel_rl.log({"y": float(n)}, step=n)
    otel_rl.log_generations([("i", "o", 1.0)], step=2)
    cap.collect()
    spans = list(cap.spans)
    expected = cap.metrics_by_step()
    h.shutdown()

    monkeypatch.setenv("OTEL_RL_PROJECT", "bridge")
    bridge = span_exporter_cls()
    half = len(spans) // 2
    assert bridge.export(spans[:half]) is SpanExportResult.SUCCESS
    assert bridge.export(spans[half:]) is SpanExportResult.SUCCESS
    assert bridge.force_flush()
    bridge.shutdown()
    r = _only_run(swan_env)
    _assert_rows(r.scalars, _expected_rows(expected))
    assert r.table(sc.VAL_GENERATIONS_KEY, 2)["rows"] == [[2, "i", "o", 1.0]]


# ----------------------------------------------------------------------------- process exit


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, otel_rl
    how = sys.argv[1]
    otel_rl.init(project="exit", experiment=how, exporters=["swanlab"], batch_delay_s=5.0)
    for n in range(1, 4):
        with otel_rl.step(n):
            otel_rl.log({"x": float(n)}, step=n)
        if n == 1 and how == "crash":
            otel_rl.flush()  # the SwanLab run is open (with SwanLab's own excepthook) before the failure
    otel_rl.log_generations([("i", "o", 1.0)], step=3)
    if how.startswith("crash"):
        raise RuntimeError("boom")
""")


@pytest.mark.parametrize("how", ["exit", "crash", "crash-early"])
def test_values_still_queued_at_exit_reach_swanlab(swan_env, tmp_path, how):
    """No shutdown() call: the batch delay (5 s) keeps values queued when the script ends.
    SwanLab's own atexit/excepthook would finish the run first; the exporter's hooks deliver before,
    and a run ended by an uncaught exception is marked crashed (also when it opens only at exit)."""
    script = tmp_path / "train.py"
    script.write_text(_EXIT_SCRIPT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_RL_", "SWANLAB_"))}
    env.update(SWANLAB_LOG_DIR=str(swan_env), SWANLAB_ROOT=str(tmp_path / "swanroot"), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), how], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    crashed = how.startswith("crash")
    assert proc.returncode == (1 if crashed else 0), proc.stderr[-3000:]
    r = _only_run(swan_env)
    assert r.scalars == {1: {"x": 1.0}, 2: {"x": 2.0}, 3: {"x": 3.0}}
    assert r.table(sc.VAL_GENERATIONS_KEY, 3)["rows"] == [[3, "i", "o", 1.0]]
    assert r.state == ("RUN_STATE_CRASHED" if crashed else "RUN_STATE_FINISHED")
    if crashed:
        assert "boom" in proc.stderr


def test_offline_reader_sees_json_config_types(swan_env):
    exp, run = _exporter(project="cfg", experiment="e")
    cfg = {"a": {"b": [1, 2.5, "x", None, True]}, "中文": "值"}
    exp.export_records([RunStart(run, cfg, 0, 1), StepMetrics(run, 1, {"x": 1.0}, 1)])
    exp.shutdown()
    r = _only_run(swan_env)
    assert json.dumps(r.config, sort_keys=True) == json.dumps(
        {"FRAMEWORK": "verl", "OTEL_RL_RUN_ID": run.run_id, **cfg}, sort_keys=True)


# ----------------------------------------------------------------------------- requirements snapshot


_REQUIREMENTS_SCRIPT = textwrap.dedent("""
    import sys
    children = []
    sys.addaudithook(lambda event, args: children.append(" ".join(map(str, args[1]))) if event == "subprocess.Popen" else None)
    from otel_rl.config import resolve
    from otel_rl.records import RunIdentity, RunStart, StepMetrics
    from otel_rl_swanlab import SwanlabExporter
    cfg = resolve(env={}, exporters=[], project="req", experiment="e")
    exp, run = SwanlabExporter(cfg), RunIdentity(cfg.project, cfg.experiment, cfg.run_id)
    exp.export_records([RunStart(run, {"a": 1}, 0, 1), StepMetrics(run, 1, {"x": 1.0}, 2)])
    exp.shutdown()
    print("CHILDREN", [c for c in children if "list" in c])
""")


@pytest.mark.parametrize("uv_on_path", [False, True], ids=["pip", "uv-on-path"])
def test_requirements_snapshot_is_pips_list_read_in_process(swan_env, tmp_path, uv_on_path):
    """SwanLab's files/requirements.txt holds what `pip list --format=freeze` prints, read without a pip child
    process; where SwanLab would ask uv (or pixi) first, SwanLab does it its own way."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if uv_on_path:
        uv = bindir / "uv"
        uv.write_text("#!/bin/sh\necho 'from-uv==1.0'\n")
        uv.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_RL_", "SWANLAB_"))}
    env.update(SWANLAB_LOG_DIR=str(swan_env), SWANLAB_ROOT=str(tmp_path / "swanroot"),
               PATH=os.pathsep.join([str(bindir), os.path.dirname(sys.executable), "/usr/bin", "/bin"]))
    script = tmp_path / "req.py"
    script.write_text(_REQUIREMENTS_SCRIPT, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = run_dirs(swan_env)
    written = (Path(run_dir) / "files" / "requirements.txt").read_text()
    if uv_on_path:
        assert written.strip() == "from-uv==1.0"
        assert "CHILDREN ['pixi list', 'uv pip list --format=freeze']" in proc.stdout, proc.stdout  # SwanLab's order
        return
    pip = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr
    assert written == pip.stdout
    assert len(written.splitlines()) > 10 and "swanlab==" in written
    assert "CHILDREN []" in proc.stdout, proc.stdout  # no pip (nor pixi, uv) child process
