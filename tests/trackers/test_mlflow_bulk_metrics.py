"""The direct sqlite metric writer of the MLflow exporter (otel_rl_mlflow.direct.metrics) against MLflow itself.

The same metric records go to two real sqlite stores: one written by the exporter with the direct
writer, one with ``OTEL_RL_MLFLOW_BULK_METRICS=false`` (MLflow's ``log_batch`` for every batch).
The ``metrics`` and ``latest_metrics`` rows must be equal (each store's own run id aside), and
MLflow's read APIs must return the same histories and latest values.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, StepMetrics  # noqa: E402
from otel_rl_mlflow.direct import metrics as direct_metrics  # noqa: E402
from otel_rl_mlflow._exporter import MlflowExporter  # noqa: E402

IDENT = RunIdentity("bulkm", "e1", "run-bulk-metrics")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv(direct_metrics.ENV_BULK_METRICS, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def records() -> list[list[StepMetrics]]:
    """Deliveries of metric records: verl-like keys, NaN, +-Inf, ints and bools, a key that appears
    late, a step older than the latest (stored, not the latest), two records of one step in a
    delivery (the larger value is the latest), one point twice in a delivery."""
    t0 = 1_700_000_000_000_000_000
    out: list[list[StepMetrics]] = []
    for n in range(8):
        values: dict = {"actor/pg_loss": 0.5 - 0.01 * n, "critic/score/mean": n / 7, "timing_s/gen": 0.25,
                        "perf/total_num_tokens": 1000 + n, "val-core/arith/reward/mean@4": n % 2 == 0}
        if n == 2:
            values["actor/entropy"] = float("nan")
        if n == 3:
            values["actor/grad_norm"] = float("inf")
            values["actor/kl_loss"] = float("-inf")
        if n >= 5:
            values["late/key"] = float(n)
        delivery = [StepMetrics(IDENT, n, values, t0 + n * 1_000_000_000)]
        if n == 4:  # a second record of the same step in the delivery, in the same millisecond
            delivery.append(StepMetrics(IDENT, n, {"actor/pg_loss": 9.0, "extra/x": 1.5}, t0 + n * 1_000_000_000 + 5))
        if n == 5:  # the very same point twice in a delivery (left to MLflow's de-duplication)
            delivery.append(StepMetrics(IDENT, n, {"timing_s/gen": 0.25}, t0 + n * 1_000_000_000))
        if n == 6:  # an older step arrives after newer ones: stored, but not the latest value
            delivery.append(StepMetrics(IDENT, 1, {"critic/score/mean": 42.0}, t0 + 7_000_000_000_000))
        if n == 7:  # a step with NaN after a finite value of that key, at a later step
            delivery.append(StepMetrics(IDENT, 8, {"actor/entropy": float("nan"), "timing_s/gen": 0.25},
                                        t0 + 8 * 1_000_000_000))
        out.append(delivery)
    return out


def export(uri: str, deliveries: list[list[StepMetrics]]) -> MlflowExporter:
    cfg = resolve(project=IDENT.project, experiment=IDENT.experiment, run_id=IDENT.run_id)
    exp = MlflowExporter(cfg, tracking_uri=uri)
    exp.export_records([RunStart(IDENT, {"a": 1}, 0, time.time_ns())])
    for d in deliveries:
        exp.export_records(d)
    return exp


def mlflow_run_id(exp: MlflowExporter) -> str:
    return next(iter(exp.runs.values())).run_id


def metric_rows(path: str, run_id: str) -> dict[str, list[tuple]]:
    con = sqlite3.connect(path)
    out = {}
    for table in ("metrics", "latest_metrics"):
        cur = con.execute(f"SELECT * FROM {table} WHERE run_uuid = ?", (run_id,))
        names = [d[0] for d in cur.description]
        out[table] = sorted((tuple("RUN" if n == "run_uuid" else v for n, v in zip(names, r)) for r in cur.fetchall()),
                            key=repr)
    con.close()
    return out


def test_direct_writes_equal_mlflow_writes(tmp_path, monkeypatch):
    deliveries = records()
    fast_db, slow_db = tmp_path / "fast.db", tmp_path / "slow.db"
    fast = export(f"sqlite:///{fast_db}", deliveries)
    writer = fast._bulk_metrics
    assert isinstance(writer, direct_metrics.BulkMetricWriter)
    assert writer.state == "on", writer.mismatch
    # MLflow wrote the probe and the delivery with a point twice; the delivery with an Inf carries the
    # run tag that flags it, so it goes to MLflow's log_batch without the writer
    assert (writer.mlflow_batches, writer.fast_batches) == (2, len(deliveries) - 3)
    monkeypatch.setenv(direct_metrics.ENV_BULK_METRICS, "false")
    slow = export(f"sqlite:///{slow_db}", deliveries)
    assert slow._bulk_metrics is False
    fast_run, slow_run = mlflow_run_id(fast), mlflow_run_id(slow)
    fast.shutdown()
    slow.shutdown()

    a, b = metric_rows(str(fast_db), fast_run), metric_rows(str(slow_db), slow_run)
    assert len(a["metrics"]) == sum(len(r.values) for d in deliveries for r in d) - 1  # the point given twice
    assert a == b

    # MLflow's own reads: the same latest values and histories, with the documented NaN/Inf storage
    ca, cb = MlflowClient(f"sqlite:///{fast_db}"), MlflowClient(f"sqlite:///{slow_db}")
    la, lb = ca.get_run(fast_run).data.metrics, cb.get_run(slow_run).data.metrics
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k] == lb[k] or (math.isnan(la[k]) and math.isnan(lb[k])), k
    assert math.isnan(la["actor/entropy"])
    assert la["critic/score/mean"] == pytest.approx(1.0)  # step 7's value: the older step 1 (42.0) is not the latest
    assert la["actor/pg_loss"] == pytest.approx(0.5 - 0.07)
    step4 = sorted(m.value for m in ca.get_metric_history(fast_run, "actor/pg_loss") if m.step == 4)
    assert step4 == pytest.approx([0.46, 9.0])
    hist = {(m.step, m.timestamp, m.value) for m in ca.get_metric_history(fast_run, "critic/score/mean")}
    assert (1, (1_700_000_000_000_000_000 + 7_000_000_000_000) // 1_000_000, 42.0) in hist
    assert len(ca.get_metric_history(fast_run, "actor/pg_loss")) == 9  # 8 steps + the second record of step 4
    grad = ca.get_metric_history(fast_run, "actor/grad_norm")
    assert [m.value for m in grad] == [1.7976931348623157e308]


def test_redelivered_batch_and_a_new_writer_on_the_same_store(tmp_path):
    """A re-delivery (points already stored) goes to MLflow, which skips what is there; a second exporter
    on the same store (a restarted export process) verifies again and adds nothing twice."""
    deliveries = records()
    db = tmp_path / "m.db"
    exp = export(f"sqlite:///{db}", deliveries[:5])
    exp.export_records(deliveries[3])  # delivered again
    w = exp._bulk_metrics
    assert w.state == "on" and w.mlflow_batches == 2  # the probe and the re-delivery
    run = mlflow_run_id(exp)
    exp.shutdown()
    again = export(f"sqlite:///{db}", deliveries[4:])  # restarted: step 4 arrives once more, then new steps
    assert again._bulk_metrics.state == "on", again._bulk_metrics.mismatch
    assert mlflow_run_id(again) == run
    again.shutdown()
    ref_db = tmp_path / "ref.db"
    ref = export(f"sqlite:///{ref_db}", deliveries)
    ref_run = mlflow_run_id(ref)
    ref.shutdown()
    assert metric_rows(str(db), run) == metric_rows(str(ref_db), ref_run)


def test_a_mismatch_turns_the_direct_writer_off(tmp_path, monkeypatch, caplog):
    """When MLflow writes something else than this writer would (here: a latest-value rule that differs),
    the writer turns itself off after the probe, says so once, and MLflow stores everything."""
    monkeypatch.setattr(direct_metrics.BulkMetricWriter, "latest", staticmethod(lambda points, stored: ([], [])))
    deliveries = records()
    db = tmp_path / "m.db"
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        exp = export(f"sqlite:///{db}", deliveries)
    w = exp._bulk_metrics
    assert w.state == "off" and "latest_metrics" in (w.mismatch or "")
    assert (w.fast_batches, w.mlflow_batches) == (0, len(deliveries) - 1)  # the Inf delivery: log_batch directly
    assert sum("direct metric writer does not write what MLflow" in r.getMessage() for r in caplog.records) == 1
    run = mlflow_run_id(exp)
    exp.shutdown()
    monkeypatch.undo()
    ref_db = tmp_path / "ref.db"
    monkeypatch.setenv(direct_metrics.ENV_BULK_METRICS, "false")
    ref = export(f"sqlite:///{ref_db}", deliveries)
    ref_run = mlflow_run_id(ref)
    ref.shutdown()
    assert metric_rows(str(db), run) == metric_rows(str(ref_db), ref_run)


def test_errors_are_mlflows_own(tmp_path):
    """What MLflow rejects is rejected with MLflow's error, and nothing of the batch is stored: a point that
    fails MLflow's validation, a run that is no longer active."""
    db = tmp_path / "m.db"
    client = MlflowClient(f"sqlite:///{db}")
    exp_id = client.create_experiment("e")
    run = client.create_run(exp_id).info.run_id
    writer = direct_metrics.BulkMetricWriter.for_store(client._tracking_client.store)
    assert writer is not None

    def via_mlflow(ms):
        client.log_batch(run, metrics=ms)

    writer.log(run, [Metric("a", 1.0, 1, 0)], via_mlflow)  # the probe
    assert writer.state == "on"
    writer.log(run, [Metric("a", 2.0, 2, 1), Metric("b", 3.0, 2, 1)], via_mlflow)
    assert writer.fast_batches == 1
    with pytest.raises(MlflowException):  # a step that is not an int: MLflow's validation
        writer.log(run, [Metric("a", 3.0, 3, 2), Metric("c", 1.0, 3, "x")], via_mlflow)
    client.delete_run(run)
    with pytest.raises(MlflowException):
        writer.log(run, [Metric("a", 4.0, 4, 3)], via_mlflow)
    client.restore_run(run)
    assert [(m.step, m.value) for m in client.get_metric_history(run, "a")] == [(0, 1.0), (1, 2.0)]
    assert client.get_run(run).data.metrics == {"a": 2.0, "b": 3.0}
    writer.close()


def test_not_used_where_it_does_not_apply(tmp_path, monkeypatch):
    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    client.search_experiments()
    assert direct_metrics.BulkMetricWriter.for_store(client._tracking_client.store) is not None
    monkeypatch.setenv(direct_metrics.ENV_BULK_METRICS, "false")
    assert direct_metrics.BulkMetricWriter.for_store(client._tracking_client.store) is None
    monkeypatch.delenv(direct_metrics.ENV_BULK_METRICS)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    file_client = MlflowClient(f"file://{tmp_path / 'mlruns'}")
    assert direct_metrics.BulkMetricWriter.for_store(file_client._tracking_client.store) is None
