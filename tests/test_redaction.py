"""Credentials inside URL values never reach what otel-rl writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import otel_rl
from otel_rl.redact import redact_text, scrub_secrets

SECRETS = ["pw-wandb-proxy-1", "s3secret-2", "rm-pw-3", "tok-4", "sig-5"]
OVERRIDES = ["trainer.project_name=redact", "trainer.experiment_name=r1",
             f"trainer.wandb_proxy=http://user:{SECRETS[0]}@proxy:8080",
             f"+data.train_files=s3://AKIAKEY:{SECRETS[1]}@bucket/train.parquet",
             f"+reward_model.url=https://u:{SECRETS[2]}@rm.example/score",
             f"+data.val_files=https://h/v.parquet?token={SECRETS[3]}&X-Amz-Signature={SECRETS[4]}&page=2"]


def test_redact_text_userinfo_and_secret_query_parameters():
    assert redact_text("http://user:pw@host:8080/x") == "http://***@host:8080/x"
    assert redact_text("s3://key:secret@bucket/a") == "s3://***@bucket/a"
    assert redact_text("https://h/x?token=abc&page=2&sig=zz") == "https://h/x?token=***&page=2&sig=***"
    assert redact_text("user@example.com and a=b") == "user@example.com and a=b"
    assert scrub_secrets({"a": ["http://u:p@h"], "n": 3}) == {"a": ["http://***@h"], "n": 3}


def test_otel_rl_config_prints_no_credential_inside_urls():
    res = subprocess.run([sys.executable, "-m", "otel_rl.cli", "config", *OVERRIDES], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    for s in SECRETS:
        assert s not in res.stdout + res.stderr
    assert json.loads(res.stdout)["verl_config"]["trainer"]["wandb_proxy"] == "http://***@proxy:8080"


def _spooled(root: Path) -> list:
    """What the spools under `root` hold, decoded: span attributes and records."""
    from otel_rl.spool.codec import decode_batch
    from otel_rl.spool.files import FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES, frame_at

    out: list = []
    for seg in sorted(root.rglob("*.seg")):
        data = seg.read_bytes()
        pos = SEGMENT_HEADER_BYTES
        while pos < len(data) and (n := frame_at(data, pos, len(data))) >= 0:
            spans, records = decode_batch(data[pos + FRAME_HEADER_BYTES:pos + FRAME_HEADER_BYTES + n])
            out += [dict(s.attributes or {}) for s in spans] + records
            pos += FRAME_HEADER_BYTES + n
    return out


@pytest.mark.parametrize("mlflow_up", [True, False], ids=["delivered", "tracker-down-spooled"])
def test_no_written_byte_holds_a_url_credential(tmp_path, monkeypatch, capfd, mlflow_up):
    """Every file written (MLflow store and artifacts, JSONL, the spool: kept whole when MLflow is down) and
    everything printed hold none of the secrets."""
    if mlflow_up:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens: all goes to the spool
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("OTEL_RL_MLFLOW_ARTIFACT_LOCATION", str(tmp_path / "artifacts"))
    h = otel_rl.init([*OVERRIDES, "trainer.logger=[console,file,mlflow]"], jsonl_path=str(tmp_path / "m.jsonl"),
                     spool_dir=str(tmp_path / "spool"), export_process="false")
    with otel_rl.step(1):
        otel_rl.log({"loss": 1.0}, step=1)
    h.shutdown(120 if mlflow_up else 5)  # delivered: a budget for MLflow's first start on a busy machine
    out = capfd.readouterr()
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    if mlflow_up:
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name("redact").experiment_id])
        assert run.data.params["trainer/wandb_proxy"] == "http://***@proxy:8080"  # the config is in the store
    blobs = [p.read_bytes() for p in files] + [out.out.encode(), out.err.encode()]
    if not mlflow_up:  # frames may be zlib-compressed: their decoded records are scanned too
        decoded = repr(_spooled(tmp_path / "spool"))
        assert "wandb_proxy" in decoded and "'loss': 1.0" in decoded  # the run's config and step are in the spool
        blobs.append(decoded.encode())
    for s in SECRETS:
        assert not any(s.encode() in b for b in blobs), s


@pytest.mark.slow
def test_no_byte_sent_over_otlp_or_written_by_a_bridge_holds_a_url_credential(tmp_path):
    """The trainer's OTLP export to a real `otel-rl bridge` (the encoded requests, as the official exporter
    encodes them) and everything the bridge writes (MLflow, wandb and SwanLab stores, its log) hold none of
    the secrets; nor does a run config another sender sent unredacted (the bridge redacts what it stores)."""
    from bridge.helpers import BridgeProcess, clean_env, tracker_env
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.trace import SpanContext, TraceFlags

    from otel_rl import semconv as sc

    store = tmp_path / "store"
    store.mkdir()
    bridge = BridgeProcess(["--exporters", "mlflow,wandb,swanlab", "--trace-backend", "mlflow", "--batch-delay",
                            "0.05"], clean_env(**tracker_env(store)), store)
    sent: list[bytes] = []

    class Encoded(SpanProcessor):
        def on_end(self, span) -> None:
            sent.append(encode_spans([span]).SerializeToString())

    raw_config = {"trainer": {"wandb_proxy": f"http://user:{SECRETS[0]}@proxy:8080", "api_key": SECRETS[3]},
                  "data": {"train_files": f"s3://AKIAKEY:{SECRETS[1]}@bucket/train.parquet"}}
    now = time.time_ns()
    foreign = ReadableSpan(sc.SPAN_RUN, context=SpanContext(5 << 64 | 1, 77, False, TraceFlags(1)),
                           resource=Resource({sc.RL_PROJECT_NAME: "redact", sc.RL_EXPERIMENT_NAME: "r2",
                                              sc.RL_RUN_ID: "foreign-sender"}),
                           attributes={sc.RL_RUN_CONFIG: json.dumps(raw_config), sc.RL_SPAN_KIND: sc.KIND_METRICS},
                           start_time=now, end_time=now)
    try:
        h = otel_rl.init([*OVERRIDES, "trainer.logger=[otlp]"], otlp_endpoint=f"http://{bridge.http}",
                         otlp_protocol="http/protobuf", spool_dir="off")
        h.tracer_provider.add_span_processor(Encoded())
        with otel_rl.step(1):
            otel_rl.log({"loss": 1.0}, step=1)
        h.shutdown()
        other = OTLPSpanExporter(endpoint=f"http://{bridge.http}/v1/traces", timeout=10)
        assert other.export([foreign]) == SpanExportResult.SUCCESS
        other.shutdown()
    finally:
        assert bridge.terminate() == 0, bridge.log()[-3000:]
    assert any(b"rl.run.config" in b for b in sent)  # the config went out (redacted)
    files = [p for p in store.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files)
    assert any(p.suffix == ".wandb" for p in files) and any("swan" in str(p) for p in files)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("redact").experiment_id])
    (foreign_params,) = [r.data.params for r in runs if "trainer/api_key" in r.data.params]
    assert foreign_params["data/train_files"] == "s3://***@bucket/train.parquet"
    assert foreign_params["trainer/api_key"] == "***"
    blobs = [p.read_bytes() for p in files] + sent + ["\n".join(bridge.lines).encode()]
    for s in SECRETS:
        assert not any(s.encode() in b for b in blobs), s
