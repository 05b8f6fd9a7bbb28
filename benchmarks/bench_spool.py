"""Durable delivery: what the spool costs and how fast it moves data.

    .venv/bin/python benchmarks/bench_spool.py            # full run (~1-2 min)
    .venv/bin/python benchmarks/bench_spool.py --quick    # smoke run, noisier
    .venv/bin/python benchmarks/bench_spool.py --json out.json

1. `log()` on the training thread, a verl-like dict of 100 keys (90 floats, 10 ints), with
   (a) no exporter, (b) a tracker that is up, (c) a tracker that is down (every delivery raises
   ConnectionError: the queue spills everything to the spool), (d) MLflow with its server down
   (connection refused; real MLflow client) when mlflow is installed.  Two ways:
   - "caller": chunks of 200 calls timed with perf_counter_ns, gc off, the variants interleaved
     chunk by chunk; between chunks (outside the timing) `flush()` lets the background threads
     finish (for a down tracker flush spills and returns False).  Min and median over chunks.
   - "background": after N calls, the time the background threads take to process them (the
     pipeline worker building spans, records and OTel instruments, then the queue delivering, or
     encoding and writing them to the spool when the tracker is down), per item.  This runs off
     the training thread but holds the GIL.
2. Spool write throughput: `Spool.append` of ready payloads (MB/s, frames/s) under each fsync
   policy, and encode + append of real batches (records/s): step metrics and trajectories.
3. Replay: a `DeliveryQueue` over a filled spool delivering to a no-op exporter (read, CRC check,
   decode, deliver, ack per batch): records/s and MB/s; and into a real MLflow sqlite store.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import otel_rl  # noqa: E402
from otel_rl._handle import Handle  # noqa: E402
from otel_rl._delivery import DeliveryQueue  # noqa: E402
from otel_rl._items import FlushMarker  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.exporters.tracker import TrackerExporter  # noqa: E402
from otel_rl.records import RunIdentity, SpanNode, StepMetrics, Trajectory  # noqa: E402
from otel_rl.spool import Spool, SpoolOptions  # noqa: E402
from otel_rl.spool.codec import encode_batch  # noqa: E402

pc = time.perf_counter_ns
RESULTS: dict[str, Any] = {}
DOWN: set[int] = set()  # ids of the handles whose tracker is down


class NullTracker(TrackerExporter):
    """A tracker that accepts everything instantly (up) or refuses every delivery (down)."""

    tracker_name = "null"

    def __init__(self, config: Any, down: bool):
        super().__init__(config)
        self.down = down
        self.name = "tracker"

    def open_run(self, run: Any, start: Any) -> Any:
        if self.down:
            raise ConnectionError("tracker down")
        return run

    def write_metrics(self, handle: Any, metrics: Any) -> None:
        if self.down:
            raise ConnectionError("tracker down")


class NullExporter(otel_rl.Exporter):
    wants_trajectories = True

    def __init__(self) -> None:
        self.name = "null"
        self.items = 0

    def export_records(self, records: Any) -> None:
        self.items += len(records)


def verl_dict(step: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for i in range(90):
        d[f"actor/metric_{i:02d}/mean"] = step * 0.001 + i
    for i in range(10):
        d[f"perf/count_{i}"] = step * 10 + i
    return d


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- 1. log()


def make_handles(tmp: str, with_mlflow: bool) -> dict[str, Handle]:
    base = dict(batch_delay_s=5.0, project="bench-spool", experiment="log")
    out: dict[str, Handle] = {}
    out["no exporter"] = Handle(resolve(env={}, exporters=[], **base), [])
    for label, down in (("tracker up", False), ("tracker down (spooling)", True)):
        cfg = resolve(env={}, exporters=[], spool_dir=os.path.join(tmp, label.split()[1]), **base)
        out[label] = Handle(cfg, [NullTracker(cfg, down)])
        if down:
            DOWN.add(id(out[label]))
    if with_mlflow:
        from otel_rl_mlflow import MlflowExporter

        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "2"
        cfg = resolve(env={}, exporters=[], spool_dir=os.path.join(tmp, "mlflow"), **base)
        e = MlflowExporter(cfg, tracking_uri=f"http://127.0.0.1:{closed_port()}")
        e.name = "mlflow"
        out["mlflow server down (spooling)"] = Handle(cfg, [e])
        DOWN.add(id(out["mlflow server down (spooling)"]))
    return out


def settle(h: Handle, timeout_s: float = 300.0) -> None:
    """Everything logged so far processed by the pipeline worker, then delivered (tracker up) or
    written to the spool (tracker down: `wait_idle` times out at once and spills)."""
    p = h._pipeline
    marker = FlushMarker()  # what flush() waits on: set once the worker has processed what came before
    p._items.append(marker)
    p._wake.set()
    assert marker.event.wait(timeout_s), "pipeline worker did not catch up"
    for q in p.queues:
        q.wait_idle(0.0 if id(h) in DOWN else timeout_s)


def bench_log(handles: dict[str, Handle], chunks: int, chunk: int = 200) -> None:
    names = list(handles)
    times: dict[str, list[float]] = {n: [] for n in names}
    dicts = [verl_dict(i) for i in range(chunk)]
    for h in handles.values():  # warm-up; and the down trackers fail once, so they spill from here on
        for i in range(chunk):
            h.log(dicts[i], step=i)
        settle(h)
        settle(h)
    step = 1000
    for c in range(chunks):
        order = names[c % len(names):] + names[:c % len(names)]
        for n in order:
            h = handles[n]
            gc.disable()
            t0 = pc()
            for d in dicts:
                h.log(d, step)
            t1 = pc()
            gc.enable()
            times[n].append((t1 - t0) / chunk / 1000)
            settle(h)
            step += 1
    print("\n1. log(100 keys) on the training thread -- caller side (chunks of %d calls, %d chunks)" % (chunk, chunks))
    base = min(times["no exporter"])
    print(f"   {'variant':34s} {'min us':>8s} {'median us':>10s} {'min vs none':>12s}")
    for n in names:
        t = times[n]
        print(f"   {n:34s} {min(t):8.1f} {statistics.median(t):10.1f} {min(t) / base:11.2f}x")
        RESULTS[f"log_caller/{n}"] = {"min_us": min(t), "median_us": statistics.median(t)}


def bench_background(handles: dict[str, Handle], n_items: int, rounds: int) -> None:
    """What the background threads spend per logged item: the pipeline worker building spans, records
    and instruments, then delivering (tracker up) or encoding and writing to the spool (down)."""
    print(f"\n1b. background cost per log(100 keys) item: {n_items} calls, then the time until the pipeline "
          f"has processed them and the queue delivered (up) or spooled (down) them; median of {rounds} rounds")
    print(f"   {'variant':34s} {'us/item':>8s} {'vs none':>8s}   exporter stats after")
    dicts = [verl_dict(i) for i in range(100)]
    costs: dict[str, list[float]] = {n: [] for n in handles}
    for r in range(rounds):
        names = list(handles)
        for n in names[r % len(names):] + names[:r % len(names)]:
            h = handles[n]
            settle(h)
            for i in range(n_items):
                h.log(dicts[i % 100], i)
            t0 = time.perf_counter()
            settle(h)
            costs[n].append((time.perf_counter() - t0) / n_items * 1e6)
    base = statistics.median(costs["no exporter"])
    for n, h in handles.items():
        c = statistics.median(costs[n])
        st = {q.name: q.stats for q in h._pipeline.queues}
        info = ", ".join(f"{k}: exported={s.exported} spooled={s.spooled} dropped={s.dropped} "
                         f"spool={s.spool_bytes / 1e6:.1f}MB" for k, s in st.items()) or "-"
        print(f"   {n:34s} {c:8.1f} {c / base:7.2f}x   {info}")
        RESULTS[f"background/{n}"] = {"us_per_item": c, "rounds": costs[n]}


# ----------------------------------------------------------------------------- 2. spool writes


def trajectory(i: int, ident: RunIdentity) -> Trajectory:
    root = SpanNode("agent_loop", "AGENT", 1, None, 0, 10**9, {"rl.step": 1, "rl.sample_index": i}, None, None,
                    "OK", None, [])
    for j in range(9):
        kind = ("LLM", "TOOL", "CHAIN")[j % 3]
        root.children.append(SpanNode(f"op_{j}", kind, j + 2, 1, j, j + 1, {"gen_ai.usage.input_tokens": 512},
                                      '{"prompt": "' + "q" * 1000 + f'{i}"}}', '{"text": "' + "a" * 1000 + '"}',
                                      "OK", None, []))
    return Trajectory(ident, 10**30 + i, 1, i, 0, False, "agent_loop", root)


def bench_spool_writes(tmp: str, seconds: float) -> None:
    print("\n2. spool writes")
    ident = RunIdentity("p", "e", "r")
    metrics_batch = [StepMetrics(ident, s, verl_dict(s), s) for s in range(10)]
    payload = encode_batch([], metrics_batch)
    print(f"   append of a ready payload ({len(payload)} bytes = 10 StepMetrics of 100 keys, zlib)")
    for policy in ("never", "batch", "always"):
        d = os.path.join(tmp, f"w-{policy}")
        sp = Spool(SpoolOptions(path=d, fsync=policy, max_bytes=8 << 30))
        sp.open()
        n = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            for _ in range(50):
                sp.append(payload, 10)
            n += 50
        sp.sync()
        took = time.perf_counter() - t0
        mb = n * (len(payload) + 12) / 1e6
        print(f"   fsync={policy:7s} {mb / took:8.1f} MB/s  {n / took:9.0f} frames/s  {10 * n / took:9.0f} records/s")
        RESULTS[f"spool_append/{policy}"] = {"MB_per_s": mb / took, "frames_per_s": n / took}
        sp.close(remove_if_empty=False)
        shutil.rmtree(d)
    print("   encode + append (fsync=batch), the work a spill does per batch")
    cases = {"10 StepMetrics x 100 keys": (metrics_batch, 10),
             "10 trajectories x 10 spans, 2 KB text each": ([trajectory(i, ident) for i in range(10)], 10)}
    for label, (records, nrec) in cases.items():
        d = os.path.join(tmp, "enc")
        sp = Spool(SpoolOptions(path=d, fsync="batch", max_bytes=8 << 30))
        sp.open()
        n = nbytes = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            p = encode_batch([], records)
            sp.append(p, nrec)
            n += 1
            nbytes += len(p) + 12
        took = time.perf_counter() - t0
        print(f"   {label:44s} {n * nrec / took:9.0f} records/s  {nbytes / took / 1e6:7.1f} MB/s on disk"
              f"  ({nbytes / n / nrec:.0f} B/record)")
        RESULTS[f"encode_append/{label}"] = {"records_per_s": n * nrec / took, "MB_per_s": nbytes / took / 1e6}
        sp.close(remove_if_empty=False)
        shutil.rmtree(d)


# ----------------------------------------------------------------------------- 3. replay


def fill(path: str, batches: list[list[Any]], repeat: int) -> tuple[int, int]:
    sp = Spool(SpoolOptions(path=path, max_bytes=8 << 30, meta={"exporter": "null"}))
    sp.open()
    items = 0
    for _ in range(repeat):
        for b in batches:
            sp.append(encode_batch([], b), len(b))
            items += len(b)
    nbytes = sp.bytes
    sp.close(remove_if_empty=False)
    return items, nbytes


def bench_replay(tmp: str, repeat: int, with_mlflow: bool) -> None:
    print("\n3. replay: a DeliveryQueue over a filled spool (read, CRC, decode, deliver, ack per batch)")
    ident = RunIdentity("p", "e", "r")
    cases = {"StepMetrics (100 keys), 10 per batch": [[StepMetrics(ident, s, verl_dict(s), s) for s in range(10)]],
             "trajectories (10 spans), 10 per batch": [[trajectory(i, ident) for i in range(10)]]}
    for label, batches in cases.items():
        d = os.path.join(tmp, "replay")
        items, nbytes = fill(d, batches, repeat)
        exp = NullExporter()
        t0 = time.perf_counter()
        q = DeliveryQueue(exp, 1000, spool=SpoolOptions(path=d, exact=True))
        assert q.wait_idle(600)
        took = time.perf_counter() - t0
        q.stop(10)
        assert exp.items == items and not os.path.exists(d), (exp.items, items)
        print(f"   {label:40s} {items / took:9.0f} records/s  {nbytes / took / 1e6:7.1f} MB/s  "
              f"({items} records, {nbytes / 1e6:.1f} MB)")
        RESULTS[f"replay/{label}"] = {"records_per_s": items / took, "MB_per_s": nbytes / took / 1e6}
    if with_mlflow:
        from otel_rl.spool.replay import replay_one

        d = os.path.join(tmp, "mlflow-replay", "mlflow")
        uri = f"sqlite:///{tmp}/bench.db"
        os.environ["MLFLOW_TRACKING_URI"] = uri
        from mlflow import MlflowClient

        MlflowClient(uri).search_experiments()  # schema first, not timed
        n_steps = max(20, repeat // 10)
        batches = [[StepMetrics(ident, s * 10 + k, verl_dict(s * 10 + k), s * 10 + k) for k in range(10)]
                   for s in range(n_steps)]
        sp = Spool(SpoolOptions(path=d, max_bytes=8 << 30,
                                meta={"exporter": "mlflow", "class": "otel_rl_mlflow:MlflowExporter",
                                      "config": {"project": "bench-replay"}}))
        sp.open()
        for b in batches:
            sp.append(encode_batch([], b), len(b))
        sp.close(remove_if_empty=False)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            t0 = time.perf_counter()
            res = replay_one(d, timeout_s=600)
            took = time.perf_counter() - t0
        finally:
            os.chdir(cwd)
        assert res is not None and res.status == "delivered", res
        pts = n_steps * 10 * 100
        print(f"   {'into MLflow (sqlite), StepMetrics':40s} {res.delivered / took:9.0f} records/s  "
              f"{pts / took:7.0f} metric points/s  ({res.delivered} records)")
        RESULTS["replay/mlflow-sqlite"] = {"records_per_s": res.delivered / took, "points_per_s": pts / took}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-mlflow", action="store_true")
    args = ap.parse_args()
    with_mlflow = not args.no_mlflow
    if with_mlflow:
        try:
            import mlflow  # noqa: F401
            import otel_rl_mlflow  # noqa: F401
        except ImportError:
            with_mlflow = False
    import logging

    logging.getLogger("otel_rl").setLevel(logging.ERROR)  # the down trackers' warnings are expected
    print(f"bench_spool: python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus, "
          f"{'quick' if args.quick else 'full'} run")
    tmp = tempfile.mkdtemp(prefix="bench-spool-")
    try:
        handles = make_handles(tmp, with_mlflow)
        try:
            bench_log(handles, chunks=20 if args.quick else 60)
            bench_background(handles, 1000 if args.quick else 2000, 2 if args.quick else 3)
        finally:
            for h in handles.values():
                settle(h)
                h.shutdown(2)
        bench_spool_writes(tmp, 0.5 if args.quick else 1.5)
        bench_replay(tmp, 100 if args.quick else 400, with_mlflow)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
