"""A real trainer ended every way a training job ends: its tracker runs say how, as each tracker's own API
would (MLflow FAILED / KILLED / FINISHED, wandb's exit code, SwanLab's crashed / aborted state); and a
trainer killed with SIGKILL leaves its MLflow run RUNNING, also when its export process outlives it and after
`otel-rl replay` delivered what it spooled (docs/delivery.md, Run status)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ._helpers import (ROOT, export_pid, finish, metric_steps, mlflow_run, signal_group, start, trainer_env,
                       wait_gone, wait_logged)

pytestmark = pytest.mark.slow

ENDS = {  # how the trainer ends -> (its END setting, a signal sent to it, its exit status)
    "uncaught exception": ("raise", None, 1),
    "sys.exit(3)": ("exit", None, 3),
    "Ctrl-C": ("wait", signal.SIGINT, -signal.SIGINT),
    "SIGTERM": ("wait", signal.SIGTERM, -signal.SIGTERM),
    "end of script": ("return", None, 0),
    "SIGKILL": ("wait", signal.SIGKILL, -signal.SIGKILL),
}


def _end(tmp_path, how: str, **env: str) -> None:
    end, sig, status = ENDS[how]
    # a generous shutdown budget: the export process may take long to start on a busy machine
    env.setdefault("OTEL_RL_SHUTDOWN_TIMEOUT_S", "120")
    env.setdefault("FLUSH", "120")  # the trainer's data is in before it ends: the ending alone is tested
    proc = start(tmp_path, STEPS="5", END=end, EXIT_CODE="3", **env)
    wait_logged(proc, tmp_path)
    if sig is not None:
        signal_group(proc, sig)
    assert finish(proc, tmp_path) == status, (tmp_path / "stderr").read_text()[-3000:]
    # the export process (in a session of its own: a signal to the group does not reach it) ends its runs
    wait_gone(export_pid(tmp_path))


@pytest.mark.parametrize("how, status", [("uncaught exception", "FAILED"), ("sys.exit(3)", "FAILED"),
                                         ("Ctrl-C", "KILLED"), ("SIGTERM", "KILLED"), ("end of script", "FINISHED"),
                                         ("SIGKILL", "RUNNING")])
def test_mlflow_run_status_says_how_the_trainer_ended(tmp_path, how, status):
    """MLflow in the export process (the default): a trainer killed with SIGKILL said nothing, and the
    export process, which outlives it, delivers its data but leaves the run RUNNING."""
    _end(tmp_path, how, EXPORTERS="mlflow")
    assert export_pid(tmp_path) > 0
    client, run = mlflow_run(f"sqlite:///{tmp_path}/mlflow.db")
    assert run.info.status == status
    assert metric_steps(client, run, "loss") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("how, code", [("uncaught exception", 1), ("sys.exit(3)", 3), ("Ctrl-C", 255),
                                       ("SIGTERM", 128 + signal.SIGTERM), ("end of script", 0),
                                       ("SIGKILL", 128 + signal.SIGKILL)])
def test_wandb_run_exit_code_says_how_the_trainer_ended(tmp_path, how, code):
    from otel_rl_wandb.reader import find_run_dirs, read_run

    root = tmp_path / "wb"
    for d in ("data", "cache", "config"):
        (root / d).mkdir(parents=True)
    _end(tmp_path / "t", how, EXPORTERS="wandb", WANDB_MODE="offline", WANDB_DISABLE_WEAVE="true",
         WANDB_SILENT="true", WANDB_DIR=str(root), WANDB_DATA_DIR=str(root / "data"),
         WANDB_CACHE_DIR=str(root / "cache"), WANDB_CONFIG_DIR=str(root / "config"))
    (run_dir,) = find_run_dirs(str(root))
    data = read_run(run_dir)
    assert data.exit_seen and data.exit_code == code


@pytest.mark.parametrize("how, state", [("uncaught exception", "RUN_STATE_CRASHED"),
                                        ("sys.exit(3)", "RUN_STATE_CRASHED"), ("Ctrl-C", "RUN_STATE_ABORTED"),
                                        ("SIGTERM", "RUN_STATE_ABORTED"),
                                        ("end of script", "RUN_STATE_FINISHED"), ("SIGKILL", "RUN_STATE_CRASHED")])
def test_swanlab_run_state_says_how_the_trainer_ended(tmp_path, how, state):
    from otel_rl_swanlab.offline import read_runs

    logdir = tmp_path / "swanlog"
    _end(tmp_path / "t", how, EXPORTERS="swanlab", SWANLAB_MODE="offline", SWANLAB_LOG_DIR=str(logdir),
         SWANLAB_ROOT=str(tmp_path / "swanroot"))
    (run,) = read_runs(str(logdir))
    assert run.state == state


def _replay(spool, url: str) -> subprocess.CompletedProcess:
    env = trainer_env(spool.parent, MLFLOW_TRACKING_URI=url)
    proc = subprocess.run([sys.executable, "-m", "otel_rl.cli", "replay", str(spool), "--timeout", "120"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "delivered 5 of 5 items" in proc.stdout or "delivered" in proc.stdout, proc.stdout
    return proc


@pytest.mark.parametrize("how, export_process, status", [("SIGKILL", "false", "RUNNING"),
                                                         ("SIGKILL", "true", "RUNNING"),
                                                         ("sys.exit(3)", "false", "FAILED"),
                                                         ("end of script", "false", "FINISHED")])
def test_replay_ends_the_mlflow_run_only_as_the_trainer_said(tmp_path, how, export_process, status):
    """The MLflow server is down for the whole training: the trainer spools everything.  `otel-rl replay`,
    once a server is up, delivers it and ends the run as the trainer ended; a trainer killed with SIGKILL
    never said, and its run stays RUNNING (also when its export process, which outlives it, spooled)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "server")
    server.root.mkdir()
    # in the training process: its flush spools what it could not deliver within 3 s (MLflow is down)
    down = dict(EXPORTERS="mlflow", MLFLOW_TRACKING_URI=server.url, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                MLFLOW_HTTP_REQUEST_TIMEOUT="2", FLUSH="3", OTEL_RL_EXPORT_PROCESS=export_process,
                OTEL_RL_SHUTDOWN_TIMEOUT_S="5")
    out = tmp_path / "t"
    if how == "SIGKILL":
        proc = start(out, STEPS="5", END="wait", **down)
        wait_logged(proc, out)  # (after a flush: everything is in the spool)
        signal_group(proc, signal.SIGKILL)
        finish(proc, out)
        wait_gone(export_pid(out))  # an export process spools what it still had, then ends
    else:
        _end(out, how, **down)
    server.start()
    try:
        _replay(out / "spool", server.url)
        client, run = mlflow_run(server.url)
        assert metric_steps(client, run, "loss") == [1, 2, 3, 4, 5]
        assert run.info.status == status
    finally:
        server.kill()
