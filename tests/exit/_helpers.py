"""Running `exit_trainer.py` as a real subprocess and reading back what reached the stores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def trainer_env(out: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "MLFLOW_", "WANDB_", "SWANLAB_"))}
    paths = [str(ROOT), *(str(ROOT / "exporters" / x) for x in ("mlflow", "wandb", "swanlab", "weave")), str(HERE)]
    base.update(PYTHONPATH=os.pathsep.join(paths + [base.get("PYTHONPATH", "")]), PYTHONUNBUFFERED="1",
                EXIT_DIR=str(out), MLFLOW_TRACKING_URI=f"sqlite:///{out}/mlflow.db",
                OTEL_RL_SPOOL_DIR=str(out / "spool"), MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    base.update(env)
    return base


def start(out: Path, **env: str) -> subprocess.Popen:
    """The trainer in its own process group (a signal to the group reaches its export process too)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(HERE / "exit_trainer.py")], env=trainer_env(out, **env),
                            stdout=open(out / "stdout", "w"), stderr=open(out / "stderr", "w"),
                            start_new_session=True)


def wait_logged(proc: subprocess.Popen, out: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "logged" in (out / "stderr").read_text().splitlines():
            return
        assert proc.poll() is None, (out / "stderr").read_text()[-3000:]
        time.sleep(0.01)
    raise AssertionError("the trainer did not get to its end: " + (out / "stderr").read_text()[-3000:])


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    os.killpg(proc.pid, sig)


def finish(proc: subprocess.Popen, out: Path, timeout_s: float = 120.0) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError("the trainer did not end: " + (out / "stderr").read_text()[-3000:]) from None


def mlflow_run(uri: str):
    """The one MLflow run of project "exit" and its client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("exit")
    assert exp is not None, "no experiment in the store"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


def metric_steps(client, run, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


def export_pid(out: Path) -> int:
    """The export process's pid the trainer printed (0: it has none)."""
    lines = (out / "stderr").read_text().splitlines()
    return int(next(x for x in lines if x.startswith("export_pid ")).split()[1])


def gone(pid: int) -> bool:
    """Process `pid` has ended (or is a zombie)."""
    if pid <= 0:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.2)

