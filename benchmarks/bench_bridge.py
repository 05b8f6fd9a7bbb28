"""`otel-rl bridge` throughput and latency on this machine, with the official OTLP/HTTP exporter as client.

    .venv/bin/python benchmarks/bench_bridge.py            # ~2-3 min
    .venv/bin/python benchmarks/bench_bridge.py --quick    # smoke run, noisier

1. ingest, discard sink: the bridge as a real subprocess (`otel-rl bridge --exporters discard`,
   HTTP only); this process sends pre-built spans of a training-like mix with the SDK's
   `OTLPSpanExporter` (HTTP/protobuf, 512 spans per request, one connection).  The clock runs
   from the first request until the bridge has turned every span into records and the sink has
   taken them (its pipeline backlog and exporter queue read from its Prometheus endpoint), so
   the rate is sustained processing, not just acknowledgement.  Also reported: the bridge's
   own CPU time per span (/proc/<pid>/stat), i.e. what one core of it can take.
2. metric points: the SDK's `OTLPMetricExporter` posting 1,000-point requests (the bridge
   decodes, counts and acknowledges them; trackers take metrics from the rl.log spans).
3. ingest into MLflow (sqlite): the same span mix, clock until MLflow has every record
   (metrics batched, each trajectory an MLflow trace).
4. end-to-end latency, span end -> in the store: a trainer process (`otel_rl.init(exporters=
   ["otlp"])`, default settings) logs one step every 100 ms; the bridge (in this process, so its
   exporter wrapper's exact per-record latencies can be read) writes to MLflow.  Latency = time
   the MLflow exporter returned from writing a record - the end time of its span in the trainer.

5. memory under gzip bombs (``--bombs 8,32``, only this section): a fresh bridge (discard sink,
   default limits) gets N authenticated 1 MiB gzip bodies that inflate to 1 GiB each, all at once
   over raw HTTP connections; reported: the bridge's peak RSS (VmHWM) above its RSS before, and
   the answers.  ``--baseline-root DIR`` runs the same against the bridge code of another checkout
   (e.g. the main branch) in the same run.

The span mix per training step: one `rl.log` span with 40 metrics, and 8 trajectories of 4 spans
(AGENT root; a CHAIN op with JSON inputs/outputs; an LLM op with GenAI token usage; a TOOL op):
33 spans, about 11 KB of OTLP protobuf.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import logging  # noqa: E402

for name in ("mlflow", "alembic", "opentelemetry"):
    logging.getLogger(name).setLevel(logging.ERROR)

from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.util.instrumentation import InstrumentationScope  # noqa: E402
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags  # noqa: E402

from otel_rl import semconv as sc  # noqa: E402

OTEL_RL = Path(sys.executable).parent / "otel-rl"
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
SCOPE = InstrumentationScope("otel_rl", "0.1.0")


# ----------------------------------------------------------------------------- workload


class Ids:
    def __init__(self) -> None:
        self.n = 1

    def __call__(self) -> int:
        self.n += 1
        return self.n


def step_spans(step: int, ids: Ids, resource: Resource, t0: int) -> list[ReadableSpan]:
    spans = []
    keys = tuple(f"actor/metric_{i:02d}" for i in range(40))
    spans.append(ReadableSpan(
        sc.SPAN_LOG, context=SpanContext(ids() << 64, ids(), False, SAMPLED), resource=resource,
        attributes={sc.RL_STEP: step, sc.RL_SPAN_KIND: sc.KIND_METRICS, sc.RL_METRICS_KEYS: keys,
                    sc.RL_METRICS_VALUES: tuple(i * 0.5 + step for i in range(40))},
        start_time=t0, end_time=t0, instrumentation_scope=SCOPE))
    for i in range(8):
        tid = ids() << 64 | i
        root = SpanContext(tid, ids(), False, SAMPLED)
        t = t0 + i * 1000
        children = [
            ("plan", {sc.RL_SPAN_KIND: sc.KIND_CHAIN, sc.RL_OP_INPUTS: json.dumps({"question": f"q{step}-{i}"}),
                      sc.RL_OP_OUTPUT: json.dumps({"plan": ["think", "compute"]})}),
            ("chat policy-7b", {sc.RL_SPAN_KIND: sc.KIND_LLM, sc.GEN_AI_OPERATION_NAME: "chat",
                                sc.GEN_AI_REQUEST_MODEL: "policy-7b", sc.GEN_AI_USAGE_INPUT_TOKENS: 120,
                                sc.GEN_AI_USAGE_OUTPUT_TOKENS: 48,
                                sc.RL_OP_INPUTS: json.dumps({"prompt": "x" * 200}),
                                sc.RL_OP_OUTPUT: json.dumps({"text": "y" * 120})}),
            ("execute_tool calculator", {sc.RL_SPAN_KIND: sc.KIND_TOOL, sc.GEN_AI_TOOL_NAME: "calculator",
                                         sc.GEN_AI_TOOL_CALL_ID: f"call-{step}-{i}",
                                         sc.RL_OP_INPUTS: json.dumps({"expression": "2+2"}),
                                         sc.RL_OP_OUTPUT: "4.0"}),
        ]
        for j, (name, attrs) in enumerate(children):
            spans.append(ReadableSpan(name, context=SpanContext(tid, ids(), False, SAMPLED), parent=root,
                                      resource=resource, attributes=attrs, start_time=t + j * 10,
                                      end_time=t + j * 10 + 5, instrumentation_scope=SCOPE,
                                      status=Status(StatusCode.OK)))
        spans.append(ReadableSpan(f"trajectory {i}", context=root, resource=resource, instrumentation_scope=SCOPE,
                                  attributes={sc.RL_SPAN_KIND: sc.KIND_AGENT, sc.RL_STEP: step, sc.RL_SAMPLE_INDEX: i,
                                              sc.RL_ROLLOUT_N: 0, sc.RL_VALIDATE: False, sc.RL_REWARD: 1.0,
                                              sc.RL_TRAJECTORY_NAME: "agent"},
                                  start_time=t, end_time=t + 100))
    return spans


def batches(n_spans: int, run_id: str, size: int = 512) -> list[list[ReadableSpan]]:
    resource = Resource({sc.RL_PROJECT_NAME: "bench", sc.RL_EXPERIMENT_NAME: "bridge", sc.RL_RUN_ID: run_id,
                         sc.SERVICE_NAME: "otel-rl", sc.RL_WORKER_RANK: 0})
    ids = Ids()
    spans: list[ReadableSpan] = []
    t0 = time.time_ns()
    step = 0
    while len(spans) < n_spans:
        spans.extend(step_spans(step, ids, resource, t0 + step * 1_000_000))
        step += 1
    return [spans[i:i + size] for i in range(0, len(spans), size)]


# ----------------------------------------------------------------------------- helpers


class Bridge:
    def __init__(self, args: list[str], env: dict[str, str], cwd: str):
        self.proc = subprocess.Popen([str(OTEL_RL), "bridge", "--http-address", "127.0.0.1:0", "--grpc-address",
                                      "off", "--prometheus-port", "0", "--log-level", "warning", *args],
                                     env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for raw in self.proc.stdout:
            line = raw.decode()
            if line.startswith('{"event": "ready"'):
                info = json.loads(line)
                break
        else:
            raise RuntimeError("bridge did not start")
        self.http, self.prometheus = info["http"], info["prometheus"]
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://{self.prometheus}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def value(self, prefix: str, **labels: str) -> float:
        total = 0.0
        for key, v in self.metrics().items():
            if key.startswith(prefix + "{") and all(f'{k}="{x}"' in key for k, x in labels.items()):
                total += v
        return total

    def drained(self, exporter: str) -> bool:
        m = self.metrics()
        backlog = sum(v for k, v in m.items() if k.startswith("otel_rl_bridge_pipeline_backlog"))
        queued = sum(v for k, v in m.items() if k.startswith("otel_rl_exporter_queued") and f'exporter="{exporter}"' in k)
        return backlog == 0 and queued == 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLFLOW_TRACKING", "WANDB_"))}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)
    return env


class _PreEncoded(list):
    """A batch already converted to its ExportTraceServiceRequest (by the SDK's own encode_spans)."""

    message = None


def pre_encode(bs: list[list[ReadableSpan]]) -> list[_PreEncoded]:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    out = []
    for b in bs:
        p = _PreEncoded(b)
        p.message = encode_spans(b)
        out.append(p)
    return out


def send_all(endpoint: str, bs: list) -> float:
    """The SDK's OTLPSpanExporter.export() per batch.  For pre-encoded batches the exporter's call of
    encode_spans returns the prepared message (it still serializes it and does the whole HTTP part)."""
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as mod
    from opentelemetry.sdk.trace.export import SpanExportResult

    exp = mod.OTLPSpanExporter(endpoint=endpoint, timeout=60)
    original = mod.encode_spans
    if bs and isinstance(bs[0], _PreEncoded):
        mod.encode_spans = lambda spans: spans.message
    try:
        t0 = time.perf_counter()
        for b in bs:
            if exp.export(b) != SpanExportResult.SUCCESS:
                raise RuntimeError("export failed")
        took = time.perf_counter() - t0
    finally:
        mod.encode_spans = original
    exp.shutdown()
    return took


def wait_drained(bridge: Bridge, exporter: str, timeout: float = 600, every_s: float = 0.05) -> None:
    """Until the bridge's pipeline and `exporter`'s queue are empty, reading its /metrics every `every_s`
    (each read costs the bridge about 1.6 ms of CPU)."""
    deadline = time.monotonic() + timeout
    while not bridge.drained(exporter):
        if time.monotonic() > deadline:
            raise RuntimeError("bridge did not drain")
        time.sleep(every_s)


# ----------------------------------------------------------------------------- sections


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def gzip_bomb(inflated_mib: int = 1024) -> bytes:
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join([c.compress(zeros) for _ in range(inflated_mib)] + [c.flush()])


def bombs(n: int, body: bytes, env: dict[str, str], cwd: str) -> dict[str, object]:
    """Peak RSS of a fresh bridge while `n` clients post `body` (gzip) at once."""
    import http.client
    from collections import Counter

    token = "bench-" + os.urandom(8).hex()
    b = Bridge(["--exporters", "discard", "--auth-token-env", "BENCH_BRIDGE_TOKEN"], dict(env, BENCH_BRIDGE_TOKEN=token),
               cwd)
    try:
        time.sleep(1.0)
        before = _status_kib(b.proc.pid, "VmRSS")
        host, port = b.http.rsplit(":", 1)
        statuses: list[int | str] = []
        go = threading.Barrier(n)

        def one() -> None:
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            try:
                go.wait()
                conn.request("POST", "/v1/traces", body=body, headers={
                    "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip",
                    "Authorization": f"Bearer {token}"})
                r = conn.getresponse()
                r.read()
                statuses.append(r.status)
            except OSError as exc:
                statuses.append(type(exc).__name__)
            finally:
                conn.close()

        threads = [threading.Thread(target=one) for _ in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
        peak = _status_kib(b.proc.pid, "VmHWM")
    finally:
        b.stop()
    return {"n": n, "rss_before_mib": before / 1024, "peak_mib": peak / 1024, "peak_above_mib": (peak - before) / 1024,
            "answers": dict(Counter(statuses)), "seconds": took}


def bombs_section(counts: list[int], baseline_root: str | None, tmp: str) -> None:
    body = gzip_bomb()
    print(f"\n5. bridge memory under concurrent gzip bombs: each body {len(body) / 1024:.0f} KiB of gzip inflating to "
          f"1 GiB, authenticated; default limits (64 MiB decompressed per request)")
    roots = [("this checkout", str(ROOT))] + ([("baseline " + baseline_root, baseline_root)] if baseline_root else [])
    for label, root in roots:
        paths = [root] + [str(Path(root) / "exporters" / x) for x in ("mlflow", "wandb", "swanlab", "weave")]
        env = clean_env(PYTHONPATH=os.pathsep.join(paths))
        for n in counts:
            r = bombs(n, body, env, tmp)
            print(f"   {label:<28} {n:>3} at once: peak RSS {r['peak_mib']:7.0f} MiB = {r['peak_above_mib']:+7.0f} MiB "
                  f"over {r['rss_before_mib']:.0f} MiB before; answers {r['answers']}; {r['seconds']:.1f} s")


def ingest(sink: str, n_spans: int, repeats: int, env: dict[str, str], cwd: str,
           pre_encoded: bool = False) -> dict[str, float]:
    bridge = Bridge(["--exporters", sink, "--queue-size", "2000000"] + (["--trace-backend", "mlflow"]
                                                                          if sink == "mlflow" else []), env, cwd)
    try:
        warm = batches(2048, "warmup")
        send_all(f"http://{bridge.http}/v1/traces", warm)
        wait_drained(bridge, sink)
        rates, acks, cpus = [], [], []
        for r in range(repeats):
            bs = batches(n_spans, f"run-{sink}-{r}-{pre_encoded}")
            if pre_encoded:
                bs = pre_encode(bs)
            n = sum(len(b) for b in bs)
            cpu0 = bridge.cpu_s()
            t0 = time.perf_counter()
            ack_s = send_all(f"http://{bridge.http}/v1/traces", bs)
            wait_drained(bridge, sink)
            took = time.perf_counter() - t0
            cpu = bridge.cpu_s() - cpu0
            rates.append(n / took)
            acks.append(n / ack_s)
            cpus.append(cpu / n * 1e6)
        return {"spans": n, "rate": statistics.median(rates), "rate_min": min(rates), "rate_max": max(rates),
                "ack_rate": statistics.median(acks), "cpu_us_per_span": statistics.median(cpus)}
    finally:
        bridge.stop()


def metric_points(n_requests: int, env: dict[str, str], cwd: str) -> dict[str, float]:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult

    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource({sc.RL_RUN_ID: "metrics"}), metric_readers=[reader])
    meter = provider.get_meter("bench")
    for i in range(100):
        g = meter.create_gauge(f"rl.train.metric_{i}")
        for j in range(10):
            g.set(i * j * 0.5, {"rank": str(j)})
    data = reader.get_metrics_data()
    points = sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics)
    bridge = Bridge(["--exporters", "discard"], env, cwd)
    try:
        exp = OTLPMetricExporter(endpoint=f"http://{bridge.http}/v1/metrics", timeout=60)
        exp.export(data)
        cpu0 = bridge.cpu_s()
        t0 = time.perf_counter()
        for _ in range(n_requests):
            if exp.export(data) != MetricExportResult.SUCCESS:
                raise RuntimeError("metric export failed")
        took = time.perf_counter() - t0
        cpu = bridge.cpu_s() - cpu0
        exp.shutdown()
        received = bridge.value("otel_rl_bridge_metric_points_total")
        assert received == points * (n_requests + 1), (received, points)
        return {"points_per_request": points, "rate": points * n_requests / took,
                "cpu_us_per_point": cpu / (points * n_requests) * 1e6}
    finally:
        bridge.stop()
        provider.shutdown()


TRAINER = r"""
import sys, time, otel_rl
h = otel_rl.init(exporters=["otlp"], otlp_protocol="http/protobuf", otlp_endpoint=sys.argv[1], project="bench",
                 experiment="latency", batch_delay_s=float(sys.argv[3]))
for n in range(int(sys.argv[2])):
    otel_rl.log({"loss": 1.0 / (n + 1), "reward": n * 0.5}, step=n)
    time.sleep(0.1)
h.shutdown()
"""


def latency(steps: int, batch_delay: float, tmp: str) -> dict[str, float]:
    from otel_rl.bridge import Bridge as InProcessBridge, Settings

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/latency-{batch_delay}.db"
    b = InProcessBridge(Settings(http_address=("127.0.0.1", 0), grpc_address=None, exporters=("mlflow",),
                                 batch_delay_s=batch_delay)).start()
    try:
        # the store exists and the run is open before timing (MLflow's migrations take seconds)
        subprocess.run([sys.executable, "-c", TRAINER, f"http://127.0.0.1:{b.http.port}", "2", str(batch_delay)],
                       env=clean_env(), check=True, timeout=300)
        (ml,) = b.exporters
        deadline = time.monotonic() + 60
        while len(ml.latencies) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ml.latencies.clear()
        subprocess.run([sys.executable, "-c", TRAINER, f"http://127.0.0.1:{b.http.port}", str(steps), str(batch_delay)],
                       env=clean_env(), check=True, timeout=300)
        deadline = time.monotonic() + 60
        while len(ml.latencies) < steps and time.monotonic() < deadline:
            time.sleep(0.05)
        lat = sorted(ml.latencies)
    finally:
        b.stop(60)
    q = statistics.quantiles(lat, n=20)
    return {"n": len(lat), "p50": statistics.median(lat), "p95": q[18], "max": lat[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bombs", default=None, metavar="N,N", help="only section 5, with these numbers of bombs at once")
    p.add_argument("--baseline-root", default=None, metavar="DIR",
                   help="section 5 also against the bridge code of this checkout")
    a = p.parse_args()
    if a.bombs:
        with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
            print(f"bench_bridge: {platform.python_version()} on {os.cpu_count()} cores, "
                  f"load {os.getloadavg()[0]:.2f}")
            bombs_section([int(x) for x in a.bombs.split(",")], a.baseline_root, tmp)
        return 0
    n_spans, repeats, n_mlflow, n_metric_req, steps = ((20_000, 1, 3_000, 20, 20) if a.quick
                                                       else (100_000, 3, 16_500, 100, 60))
    print(f"bench_bridge: {platform.python_version()} on {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}; span mix: 33 spans per training step (1 rl.log + 8 x 4-span trajectories)")
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as tmp:
        env = clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp}/ingest.db", MLFLOW_DISABLE_TELEMETRY="true")
        for pre in (False, True):
            r = ingest("discard", n_spans, repeats, env, tmp, pre_encoded=pre)
            how = ("spans pre-converted to protobuf messages by the SDK's encode_spans before the clock; the "
                   "exporter serializes and posts them" if pre else "export(spans): the exporter also converts "
                   "the SDK spans to protobuf (pure Python), on the client's core")
            print(f"\n1{'b' if pre else 'a'}. ingest -> discard sink ({r['spans']} spans x {repeats}, official "
                  f"OTLPSpanExporter, 512 spans/request)\n    {how}")
            print(f"    sustained (sent until all records built and taken): {r['rate']:>9,.0f} spans/s "
                  f"(min {r['rate_min']:,.0f}, max {r['rate_max']:,.0f})")
            print(f"    acknowledged (client send loop only):               {r['ack_rate']:>9,.0f} spans/s")
            print(f"    bridge CPU per span: {r['cpu_us_per_span']:.1f} us  -> one bridge core: "
                  f"{1e6 / r['cpu_us_per_span']:,.0f} spans/s")
        m = metric_points(n_metric_req, env, tmp)
        print(f"\n2. metric points (official OTLPMetricExporter, {m['points_per_request']} points/request)")
        print(f"   {m['rate']:>9,.0f} points/s; bridge CPU per point {m['cpu_us_per_point']:.2f} us")
        r = ingest("mlflow", n_mlflow, 1, env, tmp, pre_encoded=True)
        print(f"\n3. ingest -> MLflow sqlite ({r['spans']} spans = {r['spans'] // 33} steps: metrics + "
              f"{r['spans'] // 33 * 8} traces; pre-converted as in 1b)")
        print(f"   sustained (sent until MLflow has every record):     {r['rate']:>9,.0f} spans/s")
        print(f"   acknowledged:                                       {r['ack_rate']:>9,.0f} spans/s")
        for delay in (0.2, 0.05):
            lat = latency(steps, delay, tmp)
            print(f"\n4. latency span end -> in MLflow, batch delay {delay}s in the trainer (the bridge builds "
                  f"as requests arrive; {lat['n']} steps, one per 100 ms)")
            print(f"   p50 {lat['p50'] * 1000:.0f} ms   p95 {lat['p95'] * 1000:.0f} ms   max {lat['max'] * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
