"""One bad record never holds back the others: real tracker stores read back.

A batch holds a record a tracker cannot store (a step outside the signed 64-bit range, as an older
otel-rl spooled it, or a point the store itself refuses) between good ones.  The bad one is rejected
alone, with one warning naming its key and step; every good point is stored; nothing is retried for
ever.  MLflow (its sqlite store, through MLflow's own path and through the direct writer), wandb and
SwanLab offline runs, each read back from what the library wrote.
"""

from __future__ import annotations

import logging
import os
import time

import pytest

from otel_rl._delivery import DeliveryQueue
from otel_rl.config import resolve
from otel_rl.records import RunIdentity, StepMetrics

RUN = RunIdentity("bad-records", "e", "r-bad")
BAD_STEP = 2**63


def _batch(bad: StepMetrics) -> list[StepMetrics]:
    t = time.time_ns()
    good = [StepMetrics(RUN, s, {"loss": s / 4, "reward": float(s)}, t + s) for s in range(1, 49)]
    return good[:20] + [bad] + good[20:]


def _deliver(exporter, name: str, batches: list[list]) -> dict:
    exporter.name = name
    q = DeliveryQueue(exporter, 10_000, gather_s=0.0)
    try:
        for b in batches:
            q.put([], b)
        assert q.wait_idle(60), "the queue is stuck on the bad record"
        return q.stats.as_dict()
    finally:
        q.stop(10)
        exporter.shutdown()


def _rejections(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]


# ----------------------------------------------------------------------------- MLflow


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("OTEL_RL_MLFLOW_TEMPLATE_DIR", "")
    return uri


def _mlflow_points(uri: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(RUN.project)
    (run,) = client.search_runs([exp.experiment_id])
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
            for k in ("loss", "reward")}


@pytest.mark.parametrize("direct", [True, False], ids=["direct-sqlite-writer", "mlflow-log-batch"])
@pytest.mark.parametrize("bad", ["step", "timestamp"])
def test_mlflow_stores_every_good_point_around_one_it_cannot_store(mlflow_uri, monkeypatch, caplog, direct, bad):
    """A step beyond int64 (refused before the store) or a timestamp sqlite cannot hold (refused by the
    store: "Python int too large to convert to SQLite INTEGER") rejects that record alone."""
    from otel_rl_mlflow import MlflowExporter

    monkeypatch.setenv("OTEL_RL_MLFLOW_BULK_METRICS", "true" if direct else "false")
    if bad == "step":
        record = StepMetrics(RUN, BAD_STEP, {"loss": 2.0}, time.time_ns())
    else:
        record = StepMetrics(RUN, 7, {"loss": 2.0}, 2**90)  # milliseconds beyond int64
    first = [StepMetrics(RUN, 0, {"loss": 0.0, "reward": 0.0}, time.time_ns())]  # the direct writer's probe
    exp = MlflowExporter(resolve(env={}, exporters=[]))
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        stats = _deliver(exp, "mlflow", [first, _batch(record)])
    if direct:
        assert exp._bulk_metrics and exp._bulk_metrics.fast_batches > 0  # the direct writer met the bad point
    points = _mlflow_points(mlflow_uri)
    assert points["reward"] == [(s, float(s)) for s in range(49)]
    assert points["loss"] == [(s, s / 4) for s in range(49)]
    assert stats["exported"] == 50 and stats["rejected"] == 1 and stats["dropped"] == 0
    assert stats["failed_attempts"] == 0  # a data error is isolated at once, not retried
    (msg,) = _rejections(caplog)
    assert "'loss'" in msg and f"at step {record.step}" in msg


# ----------------------------------------------------------------------------- wandb


def test_wandb_run_has_every_good_step_and_not_the_bad_one(tmp_path, monkeypatch, caplog):
    wandb = pytest.importorskip("wandb")
    from otel_rl_wandb import STEP_METRIC, WandbExporter
    from otel_rl_wandb.reader import find_run_dirs, read_run

    root = str(tmp_path / "wb")
    for k in ("data", "cache", "config"):
        os.makedirs(os.path.join(root, k))
    for k, v in {"WANDB_MODE": "offline", "WANDB_DISABLE_WEAVE": "true", "WANDB_SILENT": "true", "WANDB_DIR": root,
                 "WANDB_DATA_DIR": f"{root}/data", "WANDB_CACHE_DIR": f"{root}/cache",
                 "WANDB_CONFIG_DIR": f"{root}/config"}.items():
        monkeypatch.setenv(k, v)
    wandb.teardown()
    exp = WandbExporter(resolve(env={}, exporters=[]))
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        stats = _deliver(exp, "wandb", [_batch(StepMetrics(RUN, BAD_STEP, {"loss": 2.0}, time.time_ns()))])
    (run_dir,) = find_run_dirs(root, run_id=RUN.run_id)
    data = read_run(run_dir)
    assert data.exit_seen
    rows = [r for r in data.history if "loss" in r]
    assert [(r[STEP_METRIC], r["loss"]) for r in rows] == [(s, s / 4) for s in range(1, 49)]
    assert stats["rejected"] == 1 and stats["exported"] == 49
    (msg,) = _rejections(caplog)
    assert "'loss'" in msg and f"at step {BAD_STEP}" in msg


# ----------------------------------------------------------------------------- SwanLab


def test_swanlab_run_has_every_good_step_and_not_the_bad_one(tmp_path, monkeypatch, caplog):
    pytest.importorskip("swanlab")
    from otel_rl_swanlab import SwanlabExporter
    from otel_rl_swanlab.offline import read_runs

    for k in list(os.environ):
        if k.startswith("SWANLAB_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "swan"))
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanroot"))
    exp = SwanlabExporter(resolve(env={}, exporters=[]))
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        stats = _deliver(exp, "swanlab", [_batch(StepMetrics(RUN, BAD_STEP, {"loss": 2.0}, time.time_ns()))])
    (run,) = read_runs(tmp_path / "swan")
    assert {s: v["loss"] for s, v in run.scalars.items()} == {s: s / 4 for s in range(1, 49)}
    assert stats["rejected"] == 1 and stats["exported"] == 49
    (msg,) = _rejections(caplog)
    assert "'loss'" in msg and f"at step {BAD_STEP}" in msg


@pytest.mark.parametrize("direct", [True, False], ids=["direct-sqlite-writer", "mlflow-log-spans"])
def test_mlflow_stores_every_good_trace_around_one_it_cannot_store(mlflow_uri, monkeypatch, caplog, direct):
    """A trajectory whose start time sqlite cannot hold is rejected alone; the 16 around it are traces."""
    import mlflow
    from otel_rl_mlflow import MlflowExporter

    from otel_rl.records import SpanNode, Trajectory

    monkeypatch.setenv("OTEL_RL_MLFLOW_BULK_TRACES", "true" if direct else "false")

    def traj(tid: int, start: int) -> Trajectory:
        node = SpanNode(name="agent", kind="AGENT", span_id=tid, parent_id=None, start_ns=start,
                        end_ns=start + 10**9, attributes={}, inputs='{"x": 1}', output="2", status="UNSET",
                        status_message=None, events=[])
        return Trajectory(RUN, tid, 1, tid, None, False, "agent", node)

    t = time.time_ns()
    first = [StepMetrics(RUN, 0, {"loss": 0.0}, t), traj(1, t)]  # opens the run (and the direct writer's probe)
    batch = [traj(i, t) for i in range(2, 9)] + [traj(99, 2**90)] + [traj(i, t) for i in range(9, 18)]
    exp = MlflowExporter(resolve(env={}, exporters=[], trace_backend="mlflow"))
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        stats = _deliver(exp, "mlflow", [first, batch])
    if direct:
        assert exp._bulk and exp._bulk.state == "on"
    exp_id = mlflow.MlflowClient(mlflow_uri).get_experiment_by_name(RUN.project).experiment_id
    traces = mlflow.search_traces(locations=[exp_id], return_type="list", max_results=100)
    assert sorted(int(tr.info.tags["sample_index"]) for tr in traces) == list(range(1, 18))
    assert stats["rejected"] == 1 and stats["failed_attempts"] == 0
    (msg,) = _rejections(caplog)
    assert f"trace {99:032x}" in msg
