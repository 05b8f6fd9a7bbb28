"""A stalled tracker costs memory only up to `queue_max_bytes`: the spool takes the rest from the start.

A real `mlflow server` is stopped with SIGSTOP once the run is open: its socket still accepts, nothing
answers, and the exporter's call hangs (its HTTP timeout is set longer than the test), so no delivery
fails while the trainer goes on.  With a budget of 1 MiB, the export process's queue must write to its
spool while that first call still hangs, the memory of the training and export processes must stay
within a bound proportional to the budget, and once the server is continued every trajectory and every
metric point is in its store exactly once.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
import uuid

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

import otel_rl  # noqa: E402

from .spool_helpers import VENV_BIN, MlflowServer  # noqa: E402

pytestmark = pytest.mark.slow
BUDGET = 1 << 20
KEYS = [f"m/{i}" for i in range(10)]
STEPS, TRAJECTORIES, OPS = 100, 10, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (VENV_BIN / "mlflow").exists():
        pytest.skip("the mlflow CLI is not installed")
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-stalled"))
    s.start()
    try:
        yield s
    finally:
        if s.proc is not None:
            os.killpg(s.proc.pid, signal.SIGCONT)
        s.kill()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@otel_rl.op
def act(turn: int, prompt: str) -> dict:
    return {"turn": turn, "text": "the answer is " + prompt[::-1], "tokens": list(range(40))}


def emit(n: int) -> None:
    with otel_rl.step(n):
        for k in range(TRAJECTORIES):
            with otel_rl.trajectory(sample_index=k):
                for j in range(OPS):
                    act(j, f"step {n} sample {k}: " + "x" * 200)
        otel_rl.log({k: n + i / 100 for i, k in enumerate(KEYS)}, step=n)


def test_stalled_tracker_spools_from_the_start_within_the_memory_budget_then_delivers_all_once(
    server, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")  # the stalled call never times out here
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    project = f"stalled-{uuid.uuid4().hex[:8]}"
    h = otel_rl.init(
        project=project,
        experiment="stalled",
        exporters=["mlflow"],
        trace_backend="mlflow",
        export_process=True,  # (this test imports mlflow, which would keep the tracker in-process)
        batch_delay_s=0.05,
        spool_dir=str(tmp_path / "spool"),
        queue_max_bytes=BUDGET,
        shutdown_timeout_s=120,
    )
    try:
        assert h._export_process is not None
        child = h._export_process.proc.pid
        emit(0)
        assert h.flush(60)  # the run is open
        time.sleep(0.5)
        base = rss_mb(child) + rss_mb(os.getpid())
        os.killpg(server.proc.pid, signal.SIGSTOP)
        peak = 0.0
        for n in range(1, STEPS + 1):
            emit(n)
            if n % 5 == 0:
                time.sleep(0.05)  # (a trainer's own work between steps)
                peak = max(peak, rss_mb(child) + rss_mb(os.getpid()) - base)
        # the spool takes what memory cannot hold while the first call still hangs: no attempt has failed
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            peak = max(peak, rss_mb(child) + rss_mb(os.getpid()) - base)
            st = h.stats()["exporters"]["mlflow"]
            if st["in_memory"] * 10 < st["spooled"] and st["queued"] >= STEPS * (TRAJECTORIES + 1) * 0.9:
                break
            time.sleep(0.2)
        assert st["failed_attempts"] == 0, st
        assert st["spooled"] > 0 and st["spool_bytes"] > 0, st
        # everything the trainer made, about 30 MB once built into trajectories, minus what memory holds
        assert st["in_memory"] * 10 < st["spooled"], st
        assert peak < 24 * BUDGET / 2**20, f"memory grew by {peak:.1f} MB with a budget of 1 MiB"
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert h.flush(120)
    st = h.stats()["exporters"]["mlflow"]
    assert st["dropped"] == 0 and st["queued"] == 0, st
    h.shutdown()

    con = sqlite3.connect(f"file:{server.root}/server.db?mode=ro", uri=True)
    try:
        (exp_id,) = con.execute("SELECT experiment_id FROM experiments WHERE name = ?", (project,)).fetchone()
        traces = con.execute("SELECT count(*) FROM trace_info WHERE experiment_id = ?", (exp_id,)).fetchone()[0]
        spans = con.execute("SELECT count(*) FROM spans WHERE experiment_id = ?", (exp_id,)).fetchone()[0]
        points = con.execute(
            "SELECT m.key, count(*), count(DISTINCT m.step) FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid "
            "WHERE r.experiment_id = ? AND m.key LIKE 'm/%' GROUP BY m.key",
            (exp_id,),
        ).fetchall()
    finally:
        con.close()
    assert traces == (STEPS + 1) * TRAJECTORIES
    assert spans == (STEPS + 1) * TRAJECTORIES * (1 + OPS)
    assert sorted(points) == sorted((k, STEPS + 1, STEPS + 1) for k in KEYS)  # each point once


def test_export_process_behind_the_batches_wait_on_disk_then_all_arrive_once(tmp_path, monkeypatch):
    """The export process stopped (SIGSTOP: it reads nothing, its pipe fills): beyond `queue_max_bytes`
    the batches for it wait in a file, not in the training process's memory, and all arrive once."""
    from otel_rl.export_process.client import _OnDisk

    store = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    project = f"behind-{uuid.uuid4().hex[:8]}"
    keys = [f"k/{i}" for i in range(200)]
    h = otel_rl.init(
        project=project,
        experiment="behind",
        exporters=["mlflow"],
        export_process="true",
        batch_delay_s=0.02,
        spool_dir=str(tmp_path / "spool"),
        queue_max_bytes=BUDGET,
    )
    client = h._export_process
    assert client is not None
    otel_rl.log({k: 0.0 for k in keys}, step=0)
    assert h.flush(60)
    os.kill(client.pid, signal.SIGSTOP)
    on_disk = seen = 0
    try:
        for n in range(1, 3001):
            otel_rl.log({k: n + i / 1000 for i, k in enumerate(keys)}, step=n)
            if n % 50 == 0:
                time.sleep(0.03)
                with client._cond:
                    on_disk = max(on_disk, sum(type(m) is _OnDisk for m in client._out))
                    seen = max(seen, client._out_bytes)
                    assert client._out_bytes <= BUDGET + (1 << 20), client._out_bytes
    finally:
        os.kill(client.pid, signal.SIGCONT)
    assert on_disk > 0, seen
    assert h.flush(120)
    h.shutdown()
    from mlflow import MlflowClient

    c = MlflowClient(store)
    run = c.search_runs([c.get_experiment_by_name(project).experiment_id])[0]
    for k in (keys[0], keys[-1]):
        got = sorted(m.step for m in c.get_metric_history(run.info.run_id, k))
        assert got == list(range(3001)), (k, len(got))
