"""Fault 1: a real `mlflow server` is killed (SIGKILL) mid-run and restarted on the same port.

While it is down the trainer keeps logging; its MLflow queue spills to the spool, and every
`flush()` leaves nothing only in memory.  After the restart everything arrives, counted exactly:
every metric point (`get_metric_history`), every trace (`search_traces`), every table row, and the
queue's own counts match what the core produced (a `CaptureExporter` beside the MLflow exporter).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
otel_rl_mlflow = pytest.importorskip("otel_rl_mlflow")

from mlflow import MlflowClient  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl.records import Generations, StepMetrics, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402

from .spool_helpers import VENV_BIN, MlflowServer  # noqa: E402

pytestmark = pytest.mark.slow
KEYS = [f"k/{i}" for i in range(10)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (VENV_BIN / "mlflow").exists():
        pytest.skip("the mlflow CLI is not installed")
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    s.start()
    try:
        yield s
    finally:
        s.kill()


@otel_rl.generate(model="policy")
def generate(prompt_ids: list) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": [5, 6, 7], "text": "x"}


def steps(a: int, b: int) -> None:
    for n in range(a, b):
        with otel_rl.step(n):
            with otel_rl.trajectory(sample_index=0):
                generate([1, 2, n])
            otel_rl.log({**{k: n + i / 100 for i, k in enumerate(KEYS)}, "n": n, "inf": math.inf}, step=n)
        if n % 3 == 0:
            otel_rl.log_generations([(f"p{n}", f"o{n}", 0.5)], step=n)


def test_server_sigkilled_mid_run_and_restarted_everything_arrives_once(server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the queue retries; don't stack retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("OTEL_RL_SHUTDOWN_TIMEOUT_S", "120")  # read right after shutdown(): no 10 s cut-off
    project = f"outage-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"
    cap = CaptureExporter()
    h = otel_rl.init(project=project, experiment="outage", exporters=["mlflow", cap], trace_backend="mlflow",
                     batch_delay_s=0.05, spool_dir=str(spool_dir))
    try:
        steps(1, 6)
        assert h.flush(60)
        steps(6, 9)  # no flush: deliveries are in flight when the server dies
        server.kill()
        for a in range(9, 29, 5):
            steps(a, a + 5)  # training goes on, never sees an error
            h.flush(0.2)  # not delivered, but acknowledged: nothing only in memory
            s = h.stats()["exporters"]["mlflow"]
            assert s["in_memory"] == 0 and s["spool_pending"] == s["queued"] > 0, s
        down = h.stats()["exporters"]["mlflow"]
        assert down["failed_attempts"] >= 1 and down["spooled"] > 0 and down["dropped"] == 0
        assert list((spool_dir / "mlflow").glob("*.seg"))
        server.start()
        assert h.flush(120)
        stats = h.stats()["exporters"]["mlflow"]
    finally:
        h.shutdown()
    assert stats["dropped"] == 0 and stats["queued"] == 0 and stats["spool_pending"] == 0, stats
    assert stats["exported"] == len(cap.records)  # counted exactly: every record once
    assert 0 < stats["replayed"] <= stats["spooled"]
    assert not (spool_dir / "mlflow").exists()

    client = MlflowClient(server.url)
    exp = client.get_experiment_by_name(project)
    (run,) = client.search_runs([exp.experiment_id])
    rid = run.info.run_id
    metrics = cap.of_type(StepMetrics)
    assert [m.step for m in metrics] == list(range(1, 29))
    total = 0
    for key in KEYS + ["n", "inf"]:
        hist = client.get_metric_history(rid, key)
        want = sorted((m.step, m.time_ns // 1_000_000, float(m.values[key])) for m in metrics)
        want = [(s, t, 1.7976931348623157e308 if v == math.inf else v) for s, t, v in want]
        assert sorted((p.step, p.timestamp, p.value) for p in hist) == want, key
        total += len(hist)
    assert total == sum(len(m.values) for m in metrics)
    trajs = {otel_rl_mlflow.mlflow_trace_id(t.trace_id): t for t in cap.of_type(Trajectory)}
    assert len(trajs) == 28
    traces = otel_rl_mlflow_traces(exp.experiment_id, server.url)
    assert sorted(t.info.trace_id for t in traces) == sorted(trajs)
    for t in traces:
        assert t.info.tags["step"] == str(trajs[t.info.trace_id].step)
        assert [s.name for s in t.data.spans] == [n.name for n in trajs[t.info.trace_id].root.walk()]
    for g in cap.of_type(Generations):
        local = client.download_artifacts(rid, f"val_generations/step_{g.step}.json", str(tmp_path))
        rows = json.loads(Path(local).read_text())["data"]
        assert [r[1:3] for r in rows] == [[f"p{g.step}", f"o{g.step}"]]
    assert json.loads(client.get_run(rid).data.tags[otel_rl_mlflow.INF_METRICS_TAG])["inf"]["count"] == 28


def otel_rl_mlflow_traces(experiment_id: str, uri: str) -> list:
    from mlflow.tracing.client import TracingClient

    out, token = [], None
    while True:
        page = TracingClient(uri).search_traces(locations=[experiment_id], max_results=100, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out
