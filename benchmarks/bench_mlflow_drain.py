"""Draining a backlog of trajectories into a remote `mlflow server`, against the fastest ingest that
server offers, in one run.

    .venv/bin/python benchmarks/bench_mlflow_drain.py            # ~9 min
    .venv/bin/python benchmarks/bench_mlflow_drain.py --quick    # ~3 min, noisier

A real `mlflow server` (sqlite backend, 127.0.0.1, `--workers` as given: MLflow's default 4) is started
and stopped here.  The backlog: trajectories of 5 spans, as the demo makes them (an AGENT root with
step, sample index, rollout and reward; `plan` CHAIN, a chat LLM call with a system + user message and
token usage, a calculator TOOL call, a second chat call), captured from `otel_rl.init()`.

  floor   the server's OTLP endpoint (`POST /v1/traces`, `x-mlflow-experiment-id`), fed requests of B
          trajectories, encoded beforehand by MLflow's own client code (`Span.to_otel_proto`), by C
          connections at once; no run link.  Every (B, C) pair is run; the floor is the best of them.
  drains  a real backlog: a spool directory of frames of F trajectories (F=100: what a pipeline batch of
          ~512 spans makes, one frame per batch while the tracker was down), drained by the exporter's
          own delivery queue (`DeliveryQueue`, the exporter's run settings; the clock runs from the queue's
          start until it is idle: reading and decoding the frames, delivery, acknowledgement):
    client, frame by frame   through MLflow's client (OTEL_RL_MLFLOW_OTLP_TRACES=false: `log_spans` +
                             `link_traces_to_run`), one frame per delivery
    OTLP, frame by frame     the exporter's OTLP writer (otel_rl_mlflow/_remote.py), one frame per
                             delivery (what a queue did before it gathered its spool's frames)
    OTLP, gathered           the same, the queue reading its frames back together as it gathers
                             (up to 20,000 items and half of `queue_max_bytes` per delivery)
Each round runs every variant once on new trajectories, in an order rotated round by round, so load
drift on a shared machine hits all alike; a rate is total traces / total seconds over the rounds.
Afterwards every trace the exporter wrote is checked in the store: the count, its run link
(`search_traces(run_id=...)`), its tags and request / response previews, and for a sample its spans.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "exporters" / "mlflow"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import logging  # noqa: E402

logging.getLogger("mlflow").setLevel(logging.WARNING)

from _mlflow_server import MlflowServer  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from otel_rl_mlflow import MlflowExporter, mlflow_trace_id  # noqa: E402
from otel_rl_mlflow._traces import ATTR_INPUTS, ATTR_OUTPUTS, SpanBuilder, preview, trace_tags  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl._delivery import DeliveryQueue  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, Trajectory  # noqa: E402
from otel_rl.spool import Spool, SpoolOptions  # noqa: E402
from otel_rl.spool.codec import encode_batch  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402

SYSTEM = "You are a careful math tutor. Think step by step and use the calculator for arithmetic. " * 4


@otel_rl.op
def plan(question: str) -> dict:
    return {"question": question, "steps": ["read", "compute", "answer"]}


@otel_rl.generate(model="qwen2.5-7b-instruct")
def chat(messages: list) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": "17 * 23 = 391. " * 8}}],
            "usage": {"prompt_tokens": 180, "completion_tokens": 64}}


@otel_rl.tool(name="calculator")
def calculator(expression: str, tool_call_id: str) -> float:
    return 391.0


def make_trajectories(n: int, ident: RunIdentity) -> list[Trajectory]:
    cap = CaptureExporter()
    h = otel_rl.init(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, exporters=[cap],
                     tracing=True, batch_delay_s=0.05)
    for i in range(n):
        with otel_rl.trajectory(step=i // 64, sample_index=i % 64, rollout_n=i % 4) as t:
            q = f"What is 17 * {23 + i}?"
            plan(q)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            chat(messages)
            calculator(f"17*{23 + i}", tool_call_id=f"call-{i}")
            chat(messages + [{"role": "tool", "content": "391"}])
            t.set_reward(1.0)
        if i % 5000 == 4999:
            h.flush(120)  # (a backlog made faster than the capture takes it would be shed)
    h.flush(120)
    h.shutdown()
    out = cap.of_type(Trajectory)
    assert len(out) == n and all(sum(1 for _ in t.root.walk()) == 5 for t in out)
    return out


class Result:
    def __init__(self, name: str):
        self.name = name
        self.rounds: list[tuple[int, float]] = []

    def add(self, n: int, secs: float) -> None:
        self.rounds.append((n, secs))

    @property
    def rate(self) -> float:
        return sum(n for n, _ in self.rounds) / sum(s for _, s in self.rounds)

    def round_rates(self) -> list[float]:
        return [n / s for n, s in self.rounds]


def floor_variant(port: int, exp_id: str, trajs: list[Trajectory], batch: int, conns: int) -> tuple[int, float]:
    builder = SpanBuilder()
    bodies = []
    for i in range(0, len(trajs), batch):  # encoded by MLflow's client code, before the clock starts
        req = ExportTraceServiceRequest()
        scope = req.resource_spans.add().scope_spans.add()
        scope.spans.extend(s.mlflow().to_otel_proto() for t in trajs[i:i + batch] for s in builder.spans(t))
        bodies.append(req.SerializeToString())
    todo = iter(bodies)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def send() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            while True:
                with lock:
                    body = next(todo, None)
                if body is None:
                    return
                conn.request("POST", "/v1/traces", body=body,
                             headers={"Content-Type": "application/x-protobuf", "x-mlflow-experiment-id": exp_id})
                r = conn.getresponse()
                text = r.read()
                if r.status != 200:
                    raise RuntimeError(f"/v1/traces answered {r.status}: {text[:300]!r}")
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=send) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return len(trajs), secs


def search_all(client: MlflowClient, exp_id: str, run_id: str | None = None) -> list:
    out, token = [], None
    while True:
        page = client.search_traces(locations=[exp_id], run_id=run_id, max_results=500, page_token=token,
                                    include_spans=False)
        out.extend(page)
        token = page.token
        if not token:
            return out


def verify(client: MlflowClient, exp_id: str, run_id: str, trajs: list[Trajectory], name: str) -> str:
    """Every trajectory stored once, linked to the run, with its tags and previews; a sample's spans."""
    infos = {t.info.trace_id: t.info for t in search_all(client, exp_id)}
    linked = {t.info.trace_id for t in search_all(client, exp_id, run_id)}
    want = {mlflow_trace_id(t.trace_id): t for t in trajs}
    problems = []
    if set(infos) != set(want):
        problems.append(f"{len(infos)} traces stored, {len(want)} written, {len(set(want) - set(infos))} missing")
    if linked != set(want):
        problems.append(f"{len(linked)} of {len(want)} traces linked to the run")
    builder = SpanBuilder()
    for i, (tid, t) in enumerate(want.items()):
        info = infos.get(tid)
        if info is None:
            continue
        missing = {k: v for k, v in trace_tags(t).items() if info.tags.get(k) != v}
        if missing:
            problems.append(f"{tid}: tags differ: {missing}")
        root = builder.spans(t)[0].mlflow()
        for got, key, role in ((info.request_preview, ATTR_INPUTS, "user"),
                               (info.response_preview, ATTR_OUTPUTS, "assistant")):
            if got != preview(root, key, role):
                problems.append(f"{tid}: {role} preview {got!r}")
        if i % max(1, len(want) // 20) == 0:  # a sample: the whole trace
            spans = client.get_trace(tid).data.spans
            if sorted((s.name, s.span_type) for s in spans) != sorted(
                    (s.name, s.span_type) for s in builder.mlflow_spans(t)):
                problems.append(f"{tid}: spans differ")
    if problems:
        raise AssertionError(f"{name}: " + "; ".join(problems[:5]))
    return f"{name}: {len(want)} traces stored once, all linked to the run, tags and previews as written"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--per-round", type=int, help="trajectories per variant per round")
    ap.add_argument("--frame", type=int, default=100, help="trajectories per spool frame")
    ap.add_argument("--workers", type=int, default=4, help="mlflow server --workers (MLflow's default: 4)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the `finally` still stops the server
    rounds = args.rounds or (2 if args.quick else 3)
    per_round = args.per_round or (600 if args.quick else 2000)
    configs = [(100, 1), (500, 1), (500, 2), (1000, 2)] if args.quick else \
        [(100, 1), (100, 2), (500, 1), (500, 2), (1000, 1), (1000, 2), (2000, 2)]
    print(f"# {platform.python_version()} on {os.cpu_count()} cpus; load {os.getloadavg()[0]:.1f}; mlflow server "
          f"--workers {args.workers}; {rounds} rounds x {per_round} trajectories per variant; spool frames of "
          f"{args.frame}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        server = MlflowServer(Path(tmp), workers=args.workers)
        server.start()
        try:
            client = MlflowClient(server.url)
            n_variants = len(configs) + 3
            t0 = time.perf_counter()
            ident = RunIdentity("bench-drain", "backlog", "bench-drain-run")
            pool = make_trajectories(per_round * rounds * n_variants, ident)
            print(f"# backlog of {len(pool)} trajectories made in {time.perf_counter() - t0:.0f} s", flush=True)
            take = iter(range(0, len(pool), per_round))

            def batch() -> list[Trajectory]:
                i = next(take)
                return pool[i:i + per_round]

            floors: dict[tuple[int, int], Result] = {c: Result(f"floor: /v1/traces, {c[0]} per request, "
                                                              f"{c[1]} at once") for c in configs}
            floor_exp = {c: client.create_experiment(f"floor-{c[0]}-{c[1]}") for c in configs}

            def exporter(name: str, otlp: bool) -> tuple[MlflowExporter, RunIdentity, object]:
                cfg = resolve(project=f"drain-{name}", experiment=name, trace_backend="mlflow")
                ident = RunIdentity(cfg.project, cfg.experiment, cfg.run_id)
                e = MlflowExporter(cfg, tracking_uri=server.url)
                if not otlp:
                    e._remote = False  # as with OTEL_RL_MLFLOW_OTLP_TRACES=false: MLflow's log_spans + link
                e.export_records([RunStart(ident, {}, 0, time.time_ns())])
                return e, ident, cfg

            names = {"client": "client, frame by frame (log_spans + link)",
                     "frames": "OTLP, frame by frame",
                     "gathered": "OTLP, gathered"}
            ours = {"client": exporter("client", False), "frames": exporter("frames", True),
                    "gathered": exporter("gathered", True)}
            written: dict[str, list[Trajectory]] = {k: [] for k in ours}
            cpu = {k: 0.0 for k in ours}  # this process's CPU while it drains (all its threads)
            results = {k: Result(f"drain: {v}") for k, v in names.items()}
            spools = Path(tmp) / "spools"

            def run_ours(name: str) -> Callable[[], tuple[int, float]]:
                def go() -> tuple[int, float]:
                    e, ident, cfg = ours[name]
                    mine = [dataclasses.replace(t, run=ident) for t in batch()]
                    path = spools / f"{name}-{len(written[name])}"
                    sp = Spool(SpoolOptions(path=str(path), meta={"exporter": e.name}))
                    sp.open()
                    for i in range(0, len(mine), args.frame):
                        part = mine[i:i + args.frame]
                        sp.append(encode_batch([], part), len(part))
                    sp.close(remove_if_empty=False)
                    t0, c0 = time.perf_counter(), time.process_time()
                    q = DeliveryQueue(e, 1000, spool=SpoolOptions(path=str(path)), config=cfg,
                                      **({} if name == "gathered" else {"gather_s": 0.0}))
                    ok = q.wait_idle(1800)
                    secs = time.perf_counter() - t0
                    cpu[name] += time.process_time() - c0
                    q.stop(5)
                    st = q.stats
                    assert ok and st.replayed == len(mine) and not st.dropped and not st.spool_pending, st.as_dict()
                    written[name].extend(mine)
                    return len(mine), secs
                return go

            def run_floor(c: tuple[int, int]) -> Callable[[], tuple[int, float]]:
                return lambda: floor_variant(server.port, floor_exp[c], batch(), *c)

            variants: list[tuple[Result, Callable[[], tuple[int, float]]]] = \
                [(results[k], run_ours(k)) for k in ours] + [(floors[c], run_floor(c)) for c in configs]
            for r in range(rounds):
                k = r % len(variants)
                for res, fn in variants[k:] + variants[:k]:
                    n, secs = fn()
                    res.add(n, secs)
                    print(f"  round {r + 1}: {res.name}: {n / secs:.0f} traces/s", flush=True)

            print("\n## verification")
            for name in ours:
                e, ident, _ = ours[name]
                handle = e.runs[ident]
                print(verify(client, handle.experiment_id, handle.run_id, written[name], name), flush=True)
            for c in configs:
                stored = len(search_all(client, floor_exp[c]))
                assert stored == per_round * rounds, (c, stored)
            for e, _, _ in ours.values():
                e.shutdown()
        finally:
            server.kill()

    best = max(floors.values(), key=lambda r: r.rate)
    print("\n## traces/s (total over rounds; min / median / max of rounds)")
    for res in [*floors.values(), *results.values()]:
        rr = res.round_rates()
        mark = "  <- floor" if res is best else ""
        print(f"  {res.name:<58} {res.rate:7.1f}   ({min(rr):.0f} / {statistics.median(rr):.0f} / {max(rr):.0f})"
              f"{mark}")
    print("\n## the exporter's own CPU (this process, all threads) per trace drained")
    for name, res in results.items():
        print(f"  {names[name]:<45} {cpu[name] / sum(n for n, _ in res.rounds) * 1e3:.2f} ms")
    print("\n## ratios to the floor")
    for name, res in results.items():
        paired = [a / b for a, b in zip(res.round_rates(), best.round_rates())]
        print(f"  {names[name]}: {res.rate / best.rate:.2f} x floor (median of per-round ratios "
              f"{statistics.median(paired):.2f}); {res.rate / results['client'].rate:.2f} x through MLflow's client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
