"""The bridge's parts in-process: out-of-order spans, the exporter wrapper, decompression limits, the
command line's refusals.  (Everything end to end runs `otel-rl bridge` as a subprocess elsewhere.)"""

from __future__ import annotations

import gzip
import http.client
import time
import zlib

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from otel_rl import semconv as sc
from otel_rl.bridge import Bridge, Settings
from otel_rl.bridge._http import HttpError, decompress
from otel_rl.bridge.cli import parse_address
from otel_rl.bridge.sinks import Delivered
from otel_rl.cli import main as otel_rl_main
from otel_rl.exporters.base import Exporter
from otel_rl.records import RunIdentity, RunStart, StepMetrics, Trajectory
from otel_rl.testing import CaptureExporter

RES = Resource({sc.RL_PROJECT_NAME: "p", sc.RL_EXPERIMENT_NAME: "e", sc.RL_RUN_ID: "r"})
F = TraceFlags(TraceFlags.SAMPLED)


def _trajectory(tid: int) -> tuple[ReadableSpan, list[ReadableSpan]]:
    root_ctx = SpanContext(tid, 1, False, F)
    root = ReadableSpan("agent", context=root_ctx, resource=RES, start_time=10, end_time=100,
                        attributes={sc.RL_SPAN_KIND: sc.KIND_AGENT, sc.RL_STEP: 3, sc.RL_SAMPLE_INDEX: 0})
    kids = [ReadableSpan(f"op{i}", context=SpanContext(tid, 10 + i, False, F), parent=root_ctx, resource=RES,
                         start_time=20 + i, end_time=30 + i, attributes={sc.RL_SPAN_KIND: sc.KIND_CHAIN})
            for i in range(3)]
    return root, kids


def _post(port: int, spans) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/v1/traces", body=encode_spans(spans).SerializeToString(),
              headers={"Content-Type": "application/x-protobuf"})
    status = c.getresponse().status
    c.close()
    return status


@pytest.mark.parametrize("grace, complete", [(1.0, True), (0.0, False)])
def test_children_arriving_after_their_root_still_join_it(grace, complete):
    """Behind a Collector, batches can overtake each other: the root is held for the grace period."""
    cap = CaptureExporter()
    b = Bridge(Settings(http_address=("127.0.0.1", 0), grpc_address=None, batch_delay_s=0.02, root_grace_s=grace),
               exporters=[cap]).start()
    try:
        root, kids = _trajectory(0xABC)
        assert _post(b.http.port, [root]) == 200  # the root first, in its own request
        time.sleep(0.3)
        assert _post(b.http.port, kids) == 200
        time.sleep(0.1)
    finally:
        b.stop(30)
    trajs = cap.of_type(Trajectory)
    if complete:
        (t,) = trajs
        assert t.complete and sorted(n.name for n in t.root.children) == ["op0", "op1", "op2"]
        assert t.step == 3 and t.run == RunIdentity("p", "e", "r")
    else:  # without the grace: the root alone, the children later as a partial trajectory
        assert len(trajs) == 2 and {t.complete for t in trajs} == {True, False}


class _FakeWandb(Exporter):
    tracker_name = "wandb"
    wants_records = True

    def __init__(self):
        self.name = "wandb"
        self.calls = []

    def export_records(self, records):
        self.calls.append(records)
        if len(self.calls) == 1:
            raise ConnectionError("down")  # the first attempt fails: the queue retries the same batch


def test_a_received_wandb_proxy_is_not_used_and_retries_keep_the_batch_identity():
    inner = _FakeWandb()
    d = Delivered(inner)
    run = RunIdentity("p", "e", "r")
    batch = [RunStart(run, {"trainer": {"wandb_proxy": "http://evil:3128", "x": 1}}, 0, 1),
             StepMetrics(run, 1, {"a": 1.0}, time.time_ns())]
    with pytest.raises(ConnectionError):
        d.export_records(batch)
    d.export_records(batch)
    first, second = inner.calls
    assert first is second  # the tracker base's retry bookkeeping relies on the same list
    assert first[0].config == {"trainer": {"wandb_proxy": None, "x": 1}}
    assert batch[0].config["trainer"]["wandb_proxy"] == "http://evil:3128"  # the caller's record untouched
    assert len(d.latencies) == 1


def test_decompress_limits_and_formats():
    data = b"otlp" * 1000
    assert decompress(gzip.compress(data), "gzip", 1 << 20, 100) == data
    assert decompress(gzip.compress(data) + gzip.compress(data), "gzip", 1 << 20, 100) == data * 2  # two members
    assert decompress(zlib.compress(data), "Deflate", 1 << 20, 100) == data
    raw = zlib.compressobj(wbits=-15)
    assert decompress(raw.compress(data) + raw.flush(), "deflate", 1 << 20, 100) == data
    assert decompress(data, "identity", 1 << 20, 100) == data
    bomb = gzip.compress(b"\0" * (8 << 20))
    with pytest.raises(HttpError) as e:
        decompress(bomb, "gzip", 4 << 20, 1000)
    assert e.value.code == 413 and "size" in e.value.message
    with pytest.raises(HttpError) as e:
        decompress(bomb, "gzip", 64 << 20, 50)  # 8 MiB from ~8 KiB: past the ratio (above 1 MiB)
    assert e.value.code == 413 and "ratio" in e.value.message
    assert len(decompress(gzip.compress(b"\0" * (512 << 10)), "gzip", 64 << 20, 2)) == 512 << 10  # < 1 MiB: ok
    for bad in (gzip.compress(data)[:-4], b"\x1f\x8b\x08\x00junk"):
        with pytest.raises(HttpError) as e:
            decompress(bad, "gzip", 1 << 20, 100)
        assert e.value.code == 400
    with pytest.raises(HttpError) as e:
        decompress(data, "br", 1 << 20, 100)
    assert e.value.code == 415


def test_addresses():
    assert parse_address("0.0.0.0:4318", 1) == ("0.0.0.0", 4318)
    assert parse_address("[::1]:4317", 1) == ("::1", 4317)
    assert parse_address(":9", 1) == ("127.0.0.1", 9)
    assert parse_address("5000", 1) == ("127.0.0.1", 5000)
    assert parse_address("localhost", 4318) == ("localhost", 4318)
    assert parse_address("off", 1) is None


@pytest.mark.parametrize("argv, message", [
    (["--auth-token-env", "NO_SUCH_VARIABLE_HOPEFULLY"], "empty or unset"),
    (["--tls-cert", "/nonexistent.pem"], "go together"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "no such file"),
    (["--http-address", "off", "--grpc-address", "off"], "both receivers are off"),
    (["--exporters", "no-such-exporter"], "unknown exporter"),
    (["--http-address", "127.0.0.1:99999"], "bad port"),
])
def test_the_command_refuses_bad_settings(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VARIABLE_HOPEFULLY", raising=False)
    code = otel_rl_main(["bridge", "--http-address", "127.0.0.1:0", "--grpc-address", "127.0.0.1:0", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("native", [True, False], ids=["c-decoder", "generated-messages"])
def test_the_bridge_makes_the_same_records_with_either_decoder(native, monkeypatch):
    """Where otel-rl was installed without a C compiler the bridge decodes with the generated messages:
    the same records come out."""
    from otel_rl.bridge import decode

    monkeypatch.setattr(decode, "NATIVE", native)
    cap = CaptureExporter()
    b = Bridge(Settings(http_address=("127.0.0.1", 0), grpc_address=None, batch_delay_s=0.02, root_grace_s=0.0),
               exporters=[cap]).start()
    try:
        root, kids = _trajectory(0xDEF)
        log = ReadableSpan(sc.SPAN_LOG, context=SpanContext(0x123, 5, False, F), resource=RES, start_time=1,
                           end_time=2, attributes={sc.RL_STEP: 4, sc.RL_METRICS_KEYS: ("loss",),
                                                   sc.RL_METRICS_VALUES: (0.5,)})
        assert _post(b.http.port, [*kids, root, log]) == 200
    finally:
        b.stop(30)
    (t,) = cap.of_type(Trajectory)
    assert t.complete and t.step == 3 and [n.name for n in t.root.children] == ["op0", "op1", "op2"]
    assert t.run == RunIdentity("p", "e", "r")
    (m,) = cap.of_type(StepMetrics)
    assert (m.step, m.values) == (4, {"loss": 0.5})


def test_a_request_is_built_into_records_before_it_is_answered_and_a_builder_error_refuses_nothing(caplog):
    """The bridge builds a request's spans on the thread that decoded them (no hand-over to the pipeline's
    worker, whose next look is `batch_delay_s` away); an error while building is logged, the request is still
    accepted and the next ones are built."""
    cap = CaptureExporter()
    b = Bridge(Settings(http_address=("127.0.0.1", 0), grpc_address=None, batch_delay_s=30.0, root_grace_s=0.0),
               exporters=[cap]).start()
    builder = b.pipeline._builder
    real = builder.build

    def build(spans):
        if any(s.name == "boom" for s in spans):
            raise RuntimeError("boom")
        return real(spans)

    builder.build = build
    try:
        boom = ReadableSpan("boom", context=SpanContext(0x77, 7, False, F), resource=RES, start_time=1, end_time=2)
        assert _post(b.http.port, [boom]) == 200
        assert "error while building records" in caplog.text
        root, kids = _trajectory(0xFED)
        assert _post(b.http.port, [*kids, root]) == 200
        deadline = time.monotonic() + 5
        while not cap.of_type(Trajectory) and time.monotonic() < deadline:
            time.sleep(0.01)
        (t,) = cap.of_type(Trajectory)  # long before the worker's next look
        assert t.complete and [n.name for n in t.root.children] == ["op0", "op1", "op2"]
    finally:
        b.stop(30)
