"""TensorBoard, Trackio and ClearML behind the bridge: one trainer execution delivered in-process to stores A
and over OTLP/HTTP to a real `otel-rl bridge` subprocess writing stores B; each store read back with its
tracker's reader, A and B equal (but for the trackers' own ids and wall-clock fields)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("trackio")
pytest.importorskip("clearml")
pytest.importorskip("otel_rl_tensorboard")
pytest.importorskip("otel_rl_trackio")
pytest.importorskip("otel_rl_clearml")

from bridge.helpers import BridgeProcess, clean_env  # noqa: E402

from .new_stores import (assert_same_points, clearml_config, clearml_expected, clearml_points,  # noqa: E402
                         clearml_sessions, clearml_tables, tb_expected, tb_points, tb_texts, workload_steps)

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def _env(root: Path) -> dict[str, str]:
    (root / "home").mkdir(parents=True, exist_ok=True)
    return {"HOME": str(root / "home"), "TRACKIO_DIR": str(root / "trackio"), "CLEARML_CACHE_DIR": str(root / "cache")}


def _trackio(root: Path, project: str, run: str) -> dict:
    """Trackio's store under `root` read with its own reader (its directory is fixed when trackio is imported:
    read in a process of its own)."""
    code = textwrap.dedent(f"""
        import json
        from trackio.sqlite_storage import SQLiteStorage as S
        logs = [{{k: v for k, v in r.items() if k != "timestamp"}} for r in S.get_logs({project!r}, {run!r})]
        traces = sorted([t["step"], t["index"], t["messages"], t["metadata"]] for t in S.get_traces({project!r}, {run!r}))
        config = {{k: v for k, v in S.get_run_config({project!r}, {run!r}).items() if not k.startswith("_")}}
        print(json.dumps({{"logs": logs, "traces": traces, "config": config}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(**_env(root)), capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _snapshot(root: Path, project: str, experiment: str) -> dict:
    tb = root / "tensorboard_log" / project / experiment
    (session,) = clearml_sessions(root / "cache")
    return {"tb": tb_points(tb), "tb_text": tb_texts(tb, "val/generations"), "tb_config": tb_texts(tb, "config"),
            "trackio": _trackio(root, project, experiment), "clearml": clearml_points(session),
            "clearml_tables": clearml_tables(session), "clearml_config": clearml_config(session)}


def test_bridge_writes_the_same_stores_as_in_process(tmp_path):
    a, b = tmp_path / "in-process", tmp_path / "bridge"
    a.mkdir()
    b.mkdir()
    project, experiment, run_id = f"br-{uuid.uuid4().hex[:6]}", "grpo", "bridge-run-1"
    bridge = BridgeProcess(["--exporters", "tensorboard,trackio,clearml", "--batch-delay", "0.05",
                            "--prometheus-port", "0"], clean_env(**_env(b)), b)
    try:
        out = subprocess.run([sys.executable, str(HERE / "new_trackers_trainer.py"), f"http://{bridge.http}", project,
                              experiment, run_id], env=clean_env(**_env(a)), cwd=a, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        code = bridge.terminate()
    except BaseException:
        bridge.kill()
        raise
    assert code == 0, bridge.log()[-3000:]
    for name in ("tensorboard", "trackio", "clearml"):
        st = bridge.stopped["exporters"][name]
        assert st["dropped"] == 0 and st["queued"] == 0 and st["exported"] > 0, (name, st)
    sa, sb = _snapshot(a, project, experiment), _snapshot(b, project, experiment)
    calls = workload_steps()
    assert_same_points(sa["tb"], tb_expected(calls))
    assert_same_points(sa["clearml"], clearml_expected(calls))
    assert sa["clearml_config"]["OTEL_RL_RUN_ID"] == run_id and sa["trackio"]["logs"] and sa["trackio"]["traces"]
    assert_same_points(sb["tb"], sa["tb"])
    assert_same_points(sb["clearml"], sa["clearml"])
    for key in ("tb_text", "tb_config", "clearml_tables", "clearml_config"):
        assert sa[key] == sb[key], key
    assert json.dumps(sa["trackio"], sort_keys=True) == json.dumps(sb["trackio"], sort_keys=True)
