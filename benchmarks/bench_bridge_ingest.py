"""`otel-rl bridge` ingest against a minimal Python OTLP receiver, 2 concurrent clients, same run.

    .venv/bin/python benchmarks/bench_bridge_ingest.py            # ~3 min
    .venv/bin/python benchmarks/bench_bridge_ingest.py --quick    # ~1 min, noisier
    .venv/bin/python benchmarks/bench_bridge_ingest.py --spans 150000 --repeats 1 --modes encode  # sustained

Two receivers, each a real subprocess on 127.0.0.1, both running for the whole benchmark:

- baseline: the least an OTLP/HTTP receiver written in Python can do, the standard library's
  `ThreadingHTTPServer` (HTTP/1.1 keep-alive, a thread per connection) that reads the body, parses
  it into an `ExportTraceServiceRequest` (the official generated message, upb), counts its spans
  and answers an empty `ExportTraceServiceResponse`;
- the bridge: `otel-rl bridge --exporters discard` (HTTP only): decodes, validates, turns every span
  into records and hands them to a sink that drops them.

Each measurement: 2 client processes start together, each sending its own run's spans (the span
mix of bench_bridge.py: per training step one `rl.log` span with 40 metrics and 8 four-span
trajectories; 512 spans per request) with the SDK's `OTLPSpanExporter` (HTTP/protobuf).  Two
client modes:

- ``encode``: ``export(spans)``, the exporter converting SDK spans to protobuf on the client's core
  (what a Python sender does);
- ``pre``: the same requests already serialized before the clock, posted on the exporter's own
  session (what a Collector's sender costs is closer to this: the receiver is the limit).

The clock runs from the clients' start until both have every request acknowledged and, for the
bridge, until it has built and discarded every record (its pipeline backlog and sink queue read
from its Prometheus endpoint every 0.2 s, `POLL_S`).  Reported: spans/s of each receiver over that clock, and accepted
spans/s (the clock stopped when the last request is answered: what the clients see), the ratios
bridge / baseline, and each receiver's CPU time per span from /proc/<pid>/stat (robust to the machine's
other load; the throughputs are not).  The baseline and the bridge alternate within each repeat,
and which goes first alternates too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_bridge as bb  # noqa: E402

SPANS_PER_REQUEST = 512
# how often the bridge's /metrics is read while it builds its last records: each read costs it about 1.6 ms
# of CPU, which counts in its CPU per span (at 0.05 s, about 0.6 us/span in a run of 2 x 30,000 spans)
POLL_S = 0.2
SPANS_PER_STEP, RECORDS_PER_STEP = 33, 9  # bench_bridge.step_spans: a log() span, 8 trajectories of 4 spans

MINIMAL_RECEIVER = r"""
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

OK = pb.ExportTraceServiceResponse().SerializeToString()
count = [0]
lock = threading.Lock()

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = pb.ExportTraceServiceRequest()
        req.ParseFromString(body)
        n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        with lock:
            count[0] += n
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(OK)))
        self.end_headers()
        self.wfile.write(OK)

    def do_GET(self):
        body = str(count[0]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(json.dumps({"event": "ready", "http": "127.0.0.1:%d" % server.server_address[1]}), flush=True)
server.serve_forever()
"""


class Minimal:
    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-c", MINIMAL_RECEIVER], env=env, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.http = json.loads(self.proc.stdout.readline())["http"]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def count(self) -> int:
        import urllib.request

        with urllib.request.urlopen(f"http://{self.http}/count", timeout=10) as r:
            return int(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ----------------------------------------------------------------------------- client process


def client(endpoint: str, mode: str, n_spans: int, run_id: str) -> None:
    """Build the batches, say ready, wait for the go line, send them all, report."""
    bs: list = bb.batches(n_spans, run_id, SPANS_PER_REQUEST)
    if mode == "pre":
        bs = bb.pre_encode(bs)
    n = sum(len(b) for b in bs)
    print(json.dumps({"ready": n}), flush=True)
    sys.stdin.readline()
    t0 = time.time()
    bb.send_all(endpoint, bs)
    print(json.dumps({"start": t0, "end": time.time(), "spans": n}), flush=True)


def run_clients(
    endpoint: str, mode: str, n_clients: int, n_spans: int, tag: str, env: dict[str, str]
) -> tuple[int, float, float]:
    """Spans sent, and the wall-clock time the first client started and the last one was done."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--client", endpoint, mode, str(n_spans), f"{tag}-c{i}"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n_clients)
    ]
    total = 0
    for p in procs:
        total += json.loads(p.stdout.readline())["ready"]  # type: ignore[union-attr]
    for p in procs:
        p.stdin.write("go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    done = []
    for p in procs:
        done.append(json.loads(p.stdout.readline()))  # type: ignore[union-attr]
        if p.wait(600) != 0:
            raise RuntimeError("client failed")
    return total, min(d["start"] for d in done), max(d["end"] for d in done)


def measure(kind: str, rx, mode: str, n_clients: int, n_spans: int, tag: str, env: dict[str, str]) -> dict:
    endpoint = f"http://{rx.http}/v1/traces"
    before = rx.count() if kind == "baseline" else rx.value("otel_rl_bridge_spans_total", outcome="accepted")
    records0 = rx.value("otel_rl_exporter_items_total", exporter="discard", outcome="exported") if kind == "bridge" else 0
    cpu0 = rx.cpu_s()  # (the receiver is idle while the clients build their batches)
    n, start, end = run_clients(endpoint, mode, n_clients, n_spans, tag, env)
    acked = end - start  # every request answered 200: the spans accepted
    if kind == "bridge":
        bb.wait_drained(rx, "discard", every_s=POLL_S)
        end = max(end, time.time())
    took = end - start
    cpu = rx.cpu_s() - cpu0
    after = rx.count() if kind == "baseline" else rx.value("otel_rl_bridge_spans_total", outcome="accepted")
    if after - before != n:
        raise RuntimeError(f"{kind}: {after - before} spans accepted of {n}")
    if kind == "bridge":
        # every step: one log() record and 8 whole trajectories (a trajectory cut in two would count twice)
        records = rx.value("otel_rl_exporter_items_total", exporter="discard", outcome="exported") - records0
        if records != n // SPANS_PER_STEP * RECORDS_PER_STEP:
            raise RuntimeError(f"bridge: {records:.0f} records built of {n // SPANS_PER_STEP * RECORDS_PER_STEP}")
    return {"rate": n / took, "acked": n / acked, "cpu_us": cpu / n * 1e6, "spans": n}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--modes", default="encode,pre")
    p.add_argument("--spans", type=int, default=None, help="spans per client (default 30,000; --quick 10,000)")
    a = p.parse_args()
    n_spans = a.spans or (10_000 if a.quick else 30_000)  # per client
    repeats = a.repeats or (2 if a.quick else 4)
    modes = a.modes.split(",")
    print(
        f"bench_bridge_ingest: Python {platform.python_version()} on {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.2f}; {a.clients} clients x {n_spans:,} spans, {SPANS_PER_REQUEST} spans/request; "
        f"{repeats} repeats"
    )
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        env = bb.clean_env(PYTHONPATH=os.pathsep.join([str(bb.ROOT), os.environ.get("PYTHONPATH", "")]))
        baseline = Minimal(env)
        bridge = bb.Bridge(["--exporters", "discard", "--queue-size", "2000000"], env, tmp)
        rxs = {"baseline": baseline, "bridge": bridge}
        try:
            for kind, rx in rxs.items():  # warm up (imports, first runs)
                measure(kind, rx, "pre", 1, 2048, f"warm-{kind}", env)
            results: dict[tuple[str, str], list[dict]] = {}
            for r in range(repeats):
                for mode in modes:
                    order = ["baseline", "bridge"] if r % 2 == 0 else ["bridge", "baseline"]
                    for kind in order:
                        m = measure(kind, rxs[kind], mode, a.clients, n_spans, f"r{r}-{mode}-{kind}", env)
                        results.setdefault((mode, kind), []).append(m)
                        print(
                            f"  repeat {r} {mode:<6} {kind:<8} {m['rate']:>9,.0f} spans/s (accepted "
                            f"{m['acked']:>9,.0f}/s)   "
                            f"receiver CPU {m['cpu_us']:5.1f} us/span",
                            flush=True,
                        )
        finally:
            bridge.stop()
            baseline.stop()
    print(
        f"\n{'client mode':<12} {'baseline spans/s':>17} {'bridge spans/s':>15} {'ratio':>12} "
        f"{'baseline CPU':>13} {'bridge CPU':>11}"
    )
    for mode in modes:
        base, brg = results[(mode, "baseline")], results[(mode, "bridge")]
        ratios = [g["rate"] / b["rate"] for b, g in zip(base, brg)]
        accepted = [g["acked"] / b["acked"] for b, g in zip(base, brg)]
        print(
            f"{mode:<12} {statistics.median(x['rate'] for x in base):>17,.0f} "
            f"{statistics.median(x['rate'] for x in brg):>15,.0f} "
            f"{statistics.median(ratios):>5.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"{statistics.median(x['cpu_us'] for x in base):>8.1f} us/span "
            f"{statistics.median(x['cpu_us'] for x in brg):>6.1f} us/span\n"
            f"{'':<12} accepted (until every request is answered): baseline "
            f"{statistics.median(x['acked'] for x in base):,.0f}/s, bridge "
            f"{statistics.median(x['acked'] for x in brg):,.0f}/s, "
            f"ratio {statistics.median(accepted):.2f} ({min(accepted):.2f}-{max(accepted):.2f})"
        )
    print(
        "ratio: bridge / baseline per repeat, median (min-max); spans/s until the bridge has built every record "
        "(its 1 s root grace included), accepted: until the last request is answered; CPU: the receiver "
        "process's own, per span"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
