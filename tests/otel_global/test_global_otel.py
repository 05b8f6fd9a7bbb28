"""otel-rl's spans and metrics reach the user's own OpenTelemetry pipeline: a global SDK provider set before
init(), the real ``opentelemetry-instrument`` CLI (console, and OTLP into a real ``otel-rl bridge`` whose
MLflow store is read back), the real logfire package; span limits from the environment."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from opentelemetry import trace

import otel_rl
from otel_rl import semconv as sc
from bridge.helpers import BridgeProcess, clean_env, tracker_env

HERE = Path(__file__).resolve().parent
TRAINER = HERE / "trainer.py"
BIN = Path(sys.executable).parent
STEPS, SAMPLES = 3, 2


def _values(n: int) -> dict:
    return {"actor/loss": 1.0 / n, "critic/score/mean": n * 0.25, "count": n, "nan": math.nan, "inf": -math.inf}


def _run(cmd: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[2])
    full = clean_env(PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                     OTEL_RL_SPOOL_DIR="off", **env)
    proc = subprocess.run(cmd, cwd=tmp_path, env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _log_values(spans: list[dict]) -> dict[int, dict]:
    """step -> the exact values of its rl.log span, rebuilt from the attributes as any exporter does."""
    out = {}
    for s in spans:
        if s["name"] != sc.SPAN_LOG:
            continue
        a = s["attributes"]
        vals = dict(zip(a[sc.RL_METRICS_KEYS], a[sc.RL_METRICS_VALUES]))
        vals.update(zip(a.get(sc.RL_METRICS_INT_KEYS, []), a.get(sc.RL_METRICS_INT_VALUES, [])))
        out.setdefault(a[sc.RL_STEP], {}).update(vals)  # the step's log() call and its timers' timing_s/*
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(x) and math.isnan(y)) if isinstance(x, float) and math.isnan(x) else x == y and type(x) is type(y)
        for x, y in ((a[k], b[k]) for k in a))


def _check_spans(spans: list[dict]) -> None:
    names = [s["name"] for s in spans]
    assert names.count(sc.SPAN_STEP) == STEPS
    assert names.count("gen") == STEPS
    assert names.count(sc.SPAN_TRAJECTORY) == STEPS * SAMPLES
    assert names.count("execute_tool calculator") == STEPS * SAMPLES
    assert names.count("policy") == STEPS * SAMPLES
    assert names.count(sc.SPAN_RUN) == 1
    logs = _log_values(spans)
    assert sorted(logs) == [1, 2, 3]
    for n, vals in logs.items():
        assert "timing_s/gen" in vals
        assert _same({k: v for k, v in vals.items() if not k.startswith("timing_s/")}, _values(n)), (n, vals)
    for s in spans:
        assert s["resource"].get(sc.RL_RUN_ID) == "glob-run"


@pytest.mark.slow
def test_a_global_sdk_provider_set_before_init_gets_every_span_and_the_metrics(tmp_path):
    out = tmp_path / "out.json"
    _run([sys.executable, str(TRAINER), "sdk", str(out)], tmp_path)
    got = json.loads(out.read_text())
    _check_spans(got["spans"])
    metrics = got["metrics"]  # the global MeterProvider's reader: otel-rl's gauges at their last value
    assert metrics["rl.train.actor/loss"] == pytest.approx(1.0 / STEPS)
    assert metrics["rl.train.count"] == STEPS
    assert sc.METRIC_TRAJECTORIES in metrics


@pytest.mark.slow
def test_feed_global_provider_false_keeps_everything_private(tmp_path):
    out = tmp_path / "out.json"
    _run([sys.executable, str(TRAINER), "private", str(out)], tmp_path)
    got = json.loads(out.read_text())
    assert got["spans"] == [] and got["metrics"] == {}


@pytest.mark.slow
def test_opentelemetry_instrument_console_exporter_prints_otel_rls_spans(tmp_path):
    proc = _run([str(BIN / "opentelemetry-instrument"), sys.executable, str(TRAINER), "plain", str(tmp_path / "o")],
                tmp_path, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
                OTEL_SERVICE_NAME="instrumented")
    spans = []
    decoder = json.JSONDecoder()
    text, i = proc.stdout, 0
    while (i := text.find("{", i)) != -1:  # the console exporter prints one JSON document per span
        try:
            doc, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        if isinstance(doc, dict) and "context" in doc:
            spans.append({"name": doc["name"], "attributes": doc["attributes"],
                          "resource": doc["resource"]["attributes"]})
        i = end
    _check_spans(spans)


@pytest.mark.slow
def test_opentelemetry_instrument_otlp_into_a_bridge_stores_the_exact_metrics_and_traces(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    bridge = BridgeProcess(["--exporters", "mlflow", "--trace-backend", "mlflow", "--batch-delay", "0.05"],
                           clean_env(**tracker_env(store)), store)
    try:
        _run([str(BIN / "opentelemetry-instrument"), sys.executable, str(TRAINER), "plain", str(tmp_path / "o")],
             tmp_path, OTEL_TRACES_EXPORTER="otlp", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
             OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
             OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://{bridge.http}/v1/traces")
    finally:
        assert bridge.terminate() == 0, bridge.log()[-3000:]
    mlflow.set_tracking_uri(tracker_env(store)["MLFLOW_TRACKING_URI"])
    try:
        client = mlflow.MlflowClient()
        exp = client.get_experiment_by_name("glob")
        runs = client.search_runs([exp.experiment_id])
        assert len(runs) == 1
        run = runs[0]
        for key in ("actor/loss", "critic/score/mean", "count"):
            hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            assert hist == [(n, float(_values(n)[key])) for n in range(1, STEPS + 1)], key
        nan = client.get_metric_history(run.info.run_id, "nan")
        assert len(nan) == STEPS and all(math.isnan(m.value) for m in nan)
        traces = mlflow.search_traces(locations=[exp.experiment_id], return_type="list")
        assert len(traces) == STEPS * SAMPLES
        assert sorted((int(t.info.tags["step"]), int(t.info.tags["sample_index"])) for t in traces) == \
            [(n, i) for n in range(1, STEPS + 1) for i in range(SAMPLES)]
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_logfire_receives_otel_rls_spans_with_exact_values(tmp_path):
    pytest.importorskip("logfire")
    out = tmp_path / "out.json"
    _run([sys.executable, str(TRAINER), "logfire", str(out)], tmp_path, LOGFIRE_SEND_TO_LOGFIRE="false")
    spans = json.loads(out.read_text())["spans"]
    # logfire reads otel-rl's spans as the SDK's own: at each start it exports its "pending span" too
    pending = [s for s in spans if s["attributes"].get("logfire.span_type") == "pending_span"]
    assert sorted({s["name"] for s in pending}) == sorted(
        {sc.SPAN_RUN, sc.SPAN_STEP, "gen", sc.SPAN_TRAJECTORY, "policy", "execute_tool calculator"})
    _check_spans([s for s in spans if s not in pending])


def test_span_limits_from_the_environment_cut_user_attributes_never_the_log_payload(monkeypatch):
    monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "8")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "12")
    from otel_rl.testing import CaptureExporter

    cap = CaptureExporter()
    h = otel_rl.init(["trainer.project_name=limits", "trainer.experiment_name=" + "e" * 60], exporters=[cap],
                     batch_delay_s=0.05)
    try:
        long_key = "k" * 300
        data = {f"{long_key}/{i}": float(i) for i in range(200)}  # more keys than the count limit
        with otel_rl.step(1):
            with otel_rl.trajectory(sample_index=0):
                span = trace.get_current_span()
                span.set_attribute("user.note", "x" * 100)
                for i in range(40):
                    span.set_attribute(f"user.extra.{i}", i)
            otel_rl.log(data, step=1)
        h.flush()
        spans = cap.spans
        traj = next(s for s in spans if s.name == sc.SPAN_TRAJECTORY)
        assert traj.attributes["user.note"] == "x" * 8
        assert len(traj.attributes) == 12  # own attributes kept, user ones up to the count limit
        assert traj.attributes[sc.RL_SAMPLE_INDEX] == 0
        log = next(s for s in spans if s.name == sc.SPAN_LOG)
        assert dict(zip(log.attributes[sc.RL_METRICS_KEYS], log.attributes[sc.RL_METRICS_VALUES])) == data
        run = next(s for s in spans if s.name == sc.SPAN_RUN)
        assert "e" * 60 in run.attributes[sc.RL_RUN_CONFIG]
    finally:
        h.shutdown()
