"""Concurrent gzip bombs against a real `otel-rl bridge` process: what all requests together hold
inflated stays within ``--decompression-budget-mib`` (the process's peak RSS says so), each bomb is
refused (413, or a retryable 503 while the budget is taken), and an authenticated sender using the
official OTLP/HTTP exporter at the same time gets its data into MLflow.
"""

from __future__ import annotations

import http.client
import threading
import time
import uuid
import zlib

import pytest

mlflow = pytest.importorskip("mlflow")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: E402

from .helpers import BridgeProcess, clean_env, log_spans, tracker_env  # noqa: E402

pytestmark = pytest.mark.slow
TOKEN = "tok-" + uuid.uuid4().hex
N_BOMBS = 8
MAX_DECOMPRESSED_MIB = 32
BUDGET_MIB = 64


def _bomb(inflated_mib: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join([c.compress(zeros) for _ in range(inflated_mib)] + [c.flush()])


def _vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_concurrent_gzip_bombs_stay_within_the_decompression_budget(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    b = BridgeProcess(["--exporters", "mlflow", "--auth-token-env", "BRIDGE_TOKEN", "--batch-delay", "0.1",
                       "--max-decompressed-mib", str(MAX_DECOMPRESSED_MIB), "--decompression-budget-mib",
                       str(BUDGET_MIB)], clean_env(BRIDGE_TOKEN=TOKEN, **tracker_env(store)), tmp_path)
    project = f"bombs-{uuid.uuid4().hex[:6]}"
    bomb = _bomb(256)  # ~256 KiB that inflate to 256 MiB: stopped at the 32 MiB limit
    try:
        host, port = b.http.rsplit(":", 1)
        rss_before = _vm_kib(b.pid, "VmRSS")
        answers: list = []
        go = threading.Barrier(N_BOMBS + 1)

        def attack() -> None:
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                go.wait()
                conn.request("POST", "/v1/traces", body=bomb, headers={
                    "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip",
                    "Authorization": f"Bearer {TOKEN}"})
                r = conn.getresponse()
                r.read()
                answers.append(r.status)
            finally:
                conn.close()

        threads = [threading.Thread(target=attack) for _ in range(N_BOMBS)]
        for t in threads:
            t.start()
        sender = OTLPSpanExporter(endpoint=f"http://{b.http}/v1/traces", headers={"Authorization": f"Bearer {TOKEN}"},
                                  compression=None, timeout=30)
        go.wait()
        assert sender.export(log_spans("sender", range(10), project=project)) == SpanExportResult.SUCCESS
        for t in threads:
            t.join(60)
        peak_above_mib = (_vm_kib(b.pid, "VmHWM") - rss_before) / 1024
        sender.shutdown()
        code = b.terminate()
    except BaseException:
        b.kill()
        raise
    assert code == 0, b.log()[-3000:]
    assert len(answers) == N_BOMBS and set(answers) <= {413, 503}, answers
    assert 413 in answers
    # the budget, plus what is not inflated output: request bodies, buffers, allocator slack
    assert peak_above_mib < BUDGET_MIB + 40, peak_above_mib
    assert b.stopped["decompression_peak_bytes"] <= BUDGET_MIB << 20
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(10))


def test_concurrent_grpc_bombs_share_the_same_budget(tmp_path):
    """The same over gRPC: compressed messages are inflated by the bridge (not by grpcio) under the budget
    shared with HTTP, each bomb is refused (RESOURCE_EXHAUSTED, or UNAVAILABLE while the budget is taken)
    and counted as ``decompression_limit``, and the official OTLP/gRPC exporter with gzip gets its data
    into MLflow at the same time."""
    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    store = tmp_path / "store"
    store.mkdir()
    b = BridgeProcess(["--exporters", "mlflow", "--auth-token-env", "BRIDGE_TOKEN", "--batch-delay", "0.1",
                       "--max-decompressed-mib", str(MAX_DECOMPRESSED_MIB), "--decompression-budget-mib",
                       str(BUDGET_MIB)], clean_env(BRIDGE_TOKEN=TOKEN, **tracker_env(store)), tmp_path)
    project = f"gbombs-{uuid.uuid4().hex[:6]}"
    zeros = bytes(96 << 20)  # compressed by the gRPC client: inflates to 3x the limit
    md = [("authorization", f"Bearer {TOKEN}")]
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}/mlflow.db")
    sender = GrpcExporter(endpoint=f"http://{b.grpc}", insecure=True, headers=md,
                          compression=grpc.Compression.Gzip, timeout=60)
    try:
        # a first run, stored before the bombs: the bridge's MLflow exporter is loaded (~140 MiB) before
        # the memory is measured
        assert sender.export(log_spans("warm-up", [0], project=project)) == SpanExportResult.SUCCESS
        deadline = time.monotonic() + 120
        while not client.get_experiment_by_name(project) or not client.search_runs(
                [client.get_experiment_by_name(project).experiment_id]):
            assert time.monotonic() < deadline, "the warm-up run never reached MLflow"
            time.sleep(0.2)
        rss_before = _vm_kib(b.pid, "VmRSS")
        answers: list = []
        go = threading.Barrier(N_BOMBS + 1)

        def attack() -> None:
            with grpc.insecure_channel(b.grpc, options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
                call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
                go.wait()
                try:
                    call(zeros, metadata=md, timeout=120, compression=grpc.Compression.Gzip)
                    answers.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    answers.append(exc.code())

        threads = [threading.Thread(target=attack) for _ in range(N_BOMBS)]
        for t in threads:
            t.start()
        go.wait()
        assert sender.export(log_spans("sender", range(10), project=project)) == SpanExportResult.SUCCESS
        for t in threads:
            t.join(180)
        peak_above_mib = (_vm_kib(b.pid, "VmHWM") - rss_before) / 1024
        sender.shutdown()
        code = b.terminate()
    except BaseException:
        b.kill()
        raise
    assert code == 0, b.log()[-3000:]
    ok = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
    assert len(answers) == N_BOMBS and set(answers) <= ok, answers
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in answers
    assert b.stopped["rejected_by_reason"].get("decompression_limit", 0) >= 1  # refused by the bridge's inflater
    assert peak_above_mib < BUDGET_MIB + 40, peak_above_mib
    assert 0 < b.stopped["decompression_peak_bytes"] <= BUDGET_MIB << 20
    runs = {r.data.tags["rl.run.id"]: r for r in client.search_runs([client.get_experiment_by_name(project)
                                                                       .experiment_id])}
    steps = sorted(m.step for m in client.get_metric_history(runs["sender"].info.run_id, "loss"))
    assert steps == list(range(10))
