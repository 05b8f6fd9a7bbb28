"""The export process starts its trackers while the training runs, not in `finish()` / `shutdown()`.

verl's `Tracking(...)` opens every tracker run before it returns; otel-rl's returns at once and the export
process opens them beside the first steps: with the first batch it gets (its queues gather batches over
`export_interval_s` only once the runs are open), at the training process's own priority, so even a machine
whose every core is busy lets it start them; once they are open it goes to the idle class.  Real trackers
(MLflow sqlite, wandb and SwanLab offline), their runs looked for on disk while training goes on.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("otel_rl_mlflow")
pytest.importorskip("otel_rl_wandb")
pytest.importorskip("otel_rl_swanlab")

from otel_rl_swanlab.offline import run_dirs  # noqa: E402
from otel_rl_wandb.reader import find_run_dirs  # noqa: E402
from spool.spool_helpers import wait_for  # noqa: E402  (tests/ is on sys.path)
from trackers.test_swanlab import swan_env  # noqa: E402,F401  (fixture)
from trackers.test_wandb import wandb_dir  # noqa: E402,F401  (fixture)

import otel_rl  # noqa: E402
from otel_rl.compat.verl import Tracking  # noqa: E402

pytestmark = pytest.mark.slow


def _mlflow_runs(db: str, experiment: str) -> int:
    """Runs of `experiment` in the MLflow sqlite store `db`, read with sqlite itself (0 before it exists)."""
    if not os.path.exists(db):
        return 0
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            return con.execute("SELECT count(*) FROM runs JOIN experiments USING (experiment_id) "
                               "WHERE experiments.name = ?", (experiment,)).fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:  # its tables not made yet
        return 0


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _policies(pid: int) -> set[int]:
    """The scheduling classes of every thread of `pid` and of the processes below it."""
    seen = set()
    for p in _tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                seen.add(os.sched_getscheduler(int(tid)))
            except OSError:  # ended meanwhile
                pass
    return seen


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_tracker_runs_open_while_training_keeps_every_core_busy(tmp_path, monkeypatch,
                                                                wandb_dir, swan_env):  # noqa: F811
    """verl's Tracking with mlflow, wandb and swanlab in the export process, at the default priorities and
    with a long gathering interval: with every core kept busy by the training, the three runs exist on disk
    before finish(), long before the interval is over; then the export process and what it started (wandb's
    service) are in the idle class."""
    db = str(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.setenv("OTEL_RL_EXPORT_PROCESS", "true")
    monkeypatch.setenv("OTEL_RL_EXPORT_INTERVAL_S", "600")  # the runs must not wait for a gathered delivery
    for k in ("OTEL_RL_EXPORT_PROCESS_NICE", "OTEL_RL_EXPORT_PROCESS_IDLE"):
        monkeypatch.delenv(k, raising=False)
    project = f"startup-{uuid.uuid4().hex[:8]}"
    tracking = Tracking(project, "busy", default_backend=["mlflow", "wandb", "swanlab"])
    client = tracking.handle._export_process
    assert client is not None and {e.name for e in tracking.handle.exporters} == {"mlflow", "wandb", "swanlab"}
    # the training: this thread logs, and one process per core spins at the trainer's priority
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]
    try:
        opened: dict[str, bool] = {}
        step, deadline = 0, time.monotonic() + 90
        while time.monotonic() < deadline:
            step += 1
            tracking.log({"loss": 1.0 / step, "step_time": 0.2}, step)
            opened = {"mlflow": _mlflow_runs(db, project) == 1, "wandb": len(find_run_dirs(wandb_dir)) == 1,
                      "swanlab": len(run_dirs(swan_env)) == 1}
            if all(opened.values()):
                break
            time.sleep(0.2)
        assert all(opened.values()), opened  # every run is there while the training still runs
        assert client.alive and client.proc.poll() is None and not tracking._finished
        # started: the export process and wandb's service below it give the CPU away from now on
        assert wait_for(lambda: _policies(client.pid) == {os.SCHED_IDLE}, 10), _policies(client.pid)
        assert len(_tree(client.pid)) > 1  # (wandb's service is there to be looked at)
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait(10)
    tracking.log({"loss": 0.0, "step_time": 0.2}, step + 1)
    tracking.finish()
    assert otel_rl.current() is None
    assert _mlflow_runs(db, project) == 1 and len(find_run_dirs(wandb_dir)) == 1 and len(run_dirs(swan_env)) == 1
