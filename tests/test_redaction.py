"""Credentials inside URL values never reach what otel-rl writes."""

from __future__ import annotations

import json
import subprocess
import sys
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


def test_no_written_byte_holds_a_url_credential(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("OTEL_RL_MLFLOW_ARTIFACT_LOCATION", str(tmp_path / "artifacts"))
    h = otel_rl.init([*OVERRIDES, "trainer.logger=[console,file,mlflow]"], jsonl_path=str(tmp_path / "m.jsonl"),
                     spool_dir=str(tmp_path / "spool"), export_process="false")
    with otel_rl.step(1):
        otel_rl.log({"loss": 1.0}, step=1)
    h.shutdown()
    out = capfd.readouterr()
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files)
    blobs = [p.read_bytes() for p in files] + [out.out.encode(), out.err.encode()]
    for s in SECRETS:
        assert not any(s.encode() in b for b in blobs), s


@pytest.mark.slow
def test_no_byte_sent_over_otlp_or_written_by_a_bridge_holds_a_url_credential(tmp_path):
    """The trainer's OTLP export to a real `otel-rl bridge` (the encoded requests, as the official exporter
    encodes them) and everything the bridge writes (MLflow store, its log) hold none of the secrets."""
    from bridge.helpers import BridgeProcess, clean_env, tracker_env
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import SpanProcessor

    store = tmp_path / "store"
    store.mkdir()
    bridge = BridgeProcess(["--exporters", "mlflow", "--trace-backend", "mlflow", "--batch-delay", "0.05"],
                           clean_env(**tracker_env(store)), store)
    sent: list[bytes] = []

    class Encoded(SpanProcessor):
        def on_end(self, span) -> None:
            sent.append(encode_spans([span]).SerializeToString())

    try:
        h = otel_rl.init([*OVERRIDES, "trainer.logger=[otlp]"], otlp_endpoint=f"http://{bridge.http}",
                         otlp_protocol="http/protobuf", spool_dir="off")
        h.tracer_provider.add_span_processor(Encoded())
        with otel_rl.step(1):
            otel_rl.log({"loss": 1.0}, step=1)
        h.shutdown()
    finally:
        assert bridge.terminate() == 0, bridge.log()[-3000:]
    assert any(b"rl.run.config" in b for b in sent)  # the config went out (redacted)
    files = [p for p in store.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files)
    blobs = [p.read_bytes() for p in files] + sent + ["\n".join(bridge.lines).encode()]
    for s in SECRETS:
        assert not any(s.encode() in b for b in blobs), s
