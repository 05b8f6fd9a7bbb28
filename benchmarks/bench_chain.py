"""The whole chain under load: N trainer processes -> agent -> gateway -> 2 bridges -> MLflow sqlite.

    .venv/bin/python benchmarks/bench_chain.py             # N = 1, 2, 4 x 200, 600 trajectories/s, 20 s; ~8 min
    .venv/bin/python benchmarks/bench_chain.py --quick     # N = 1, 2 x 200, 600 trajectories/s, 10 s; ~3 min
    .venv/bin/python benchmarks/bench_chain.py --trainers 4 --rates 1200 --seconds 20

Every process is a real one on 127.0.0.1, in the topology tests/deploy/test_collector_sharding.py tests
(its helpers start them): `otelcol-rl` with deploy/collector/agent.yaml (OTLP in, disk queue, OTLP/gRPC out),
one gateway with gateway.yaml + gateway-sharded.yaml (disk queue, `load_balancing` by `rl.run.id`) and two
`otel-rl bridge --exporters mlflow --trace-backend mlflow` replicas, each with its own MLflow sqlite store,
bearer token as deploy/ configures it.  Default settings everywhere (trainer batch delay 0.5 s, bridge root
grace 1 s; the bridge builds records as requests arrive).  Which bridge a run lands on is the gateway's hash of its run id.

Each trainer process (`otel_rl.init(exporters=["otlp"])`, OTLP/HTTP to the agent, its own run id) offers its
share of the given rate (trajectories/s, all trainers together) for the given time: per training step an
`rl.step` span with 8 trajectories (AGENT root, a CHAIN op, an LLM generation with token usage, a tool call, a
REWARD op: 5 spans each) and one `log()` of 40 metrics; then it flushes and reports what it dropped.
Measured per run:

- 0 lost: the stores hold every trajectory (MLflow traces) and every metric point the trainers made, exactly
  (a duplicated point would show as an extra one), and the trainers dropped nothing;
- stored/s: the stores' intake from the first trajectory to the last (the offered rate when the chain keeps
  up, its limit when it does not: latency then grows with the backlog);
- latency span end -> in the store: each trajectory's root span end (MLflow's trace timestamp + duration)
  against the moment this process first saw it in its store (sqlite read every 0.2 s, which adds 0.1 s on
  average), p50 / p95 / max;
- where the limit is: each process's CPU (/proc/<pid>/stat, a trainer with its children), as the busiest 3 s
  in cores (a Python process cannot use more than one) and as CPU ms per stored trajectory.  The machine's
  other load shows in `load` (first line): on a shared machine a process gets less than a core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bridge.helpers import BridgeProcess, clean_env, tracker_env  # noqa: E402
from deploy._collector import COLLECTOR_DIR, Collector, otelcol_available  # noqa: E402
from deploy._stack import free_port  # noqa: E402
from deploy.test_collector_sharding import gateway_extra  # noqa: E402

METRICS_PER_STEP = 40
TRAJECTORIES_PER_STEP = 8

TRAINER = r"""
import json, sys, time
import otel_rl

endpoint, project, run_id, seconds, rate = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
h = otel_rl.init(exporters=["otlp"], otlp_protocol="http/protobuf", otlp_endpoint=endpoint, project=project,
             experiment="chain", run_id=run_id)

@otel_rl.op
def plan(question):
    return {"question": question, "plan": ["think", "compute"]}

@otel_rl.generate(model="policy-7b")
def generate(prompt_ids):
    return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9], "text": "x = 4"}

@otel_rl.tool(name="calculator")
def calculator(expression, tool_call_id):
    return 4.0

@otel_rl.op(kind="REWARD")
def score(answer):
    return 1.0 if answer == 4.0 else 0.0

keys = [f"actor/metric_{i:02d}" for i in range(%(metrics)d)]
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
start = time.time()
step = trajectories = 0
every = %(trajectories)d / rate  # seconds per step
while time.time() - start < seconds:
    step += 1
    pause = start + (step - 1) * every - time.time()
    if pause > 0:
        time.sleep(pause)
    with otel_rl.step(step):
        for i in range(%(trajectories)d):
            with otel_rl.trajectory(sample_index=i) as t:
                plan(f"q{step}-{i}")
                generate(list(range(16)))
                t.set_reward(score(calculator("2+2", tool_call_id=f"call-{step}-{i}")))
            trajectories += 1
        otel_rl.log({k: step * 0.5 + j for j, k in enumerate(keys)}, step=step)
end = time.time()
h.flush(300)
stats = h.stats()
otel_rl.shutdown()
lost = stats["pipeline_dropped"] + sum(e.get("dropped", 0) for e in stats["exporters"].values())
print(json.dumps({"start": start, "end": end, "steps": step, "trajectories": trajectories, "lost": lost}), flush=True)
""" % {"metrics": METRICS_PER_STEP, "trajectories": TRAJECTORIES_PER_STEP}


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (a trainer may run its exporters in a child process)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


class Stores:
    """Watches the bridges' MLflow sqlite stores: when each trace first appears, and the metric points."""

    def __init__(self, dbs: list[Path]):
        self.dbs = dbs
        self.last_rowid = [0] * len(dbs)
        self.seen: dict[str, tuple[float, float]] = {}  # trace id -> (root span end, first seen), seconds

    def poll(self) -> None:
        now = time.time()
        for i, db in enumerate(self.dbs):
            try:
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
                try:
                    rows = con.execute(
                        "SELECT rowid, request_id, timestamp_ms, execution_time_ms FROM trace_info WHERE rowid > ?",
                        (self.last_rowid[i],),
                    ).fetchall()
                finally:
                    con.close()
            except sqlite3.Error:
                continue
            for rowid, rid, ts, dur in rows:
                self.last_rowid[i] = max(self.last_rowid[i], rowid)
                self.seen.setdefault(rid, ((ts + (dur or 0)) / 1000.0, now))

    def metric_points(self, project: str) -> int:
        n = 0
        for db in self.dbs:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                n += con.execute(
                    "SELECT count(*) FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid "
                    "JOIN experiments e ON r.experiment_id = e.experiment_id WHERE e.name LIKE ?",
                    (f"{project}%",),
                ).fetchone()[0]
            finally:
                con.close()
        return n


def start_bridge(store: Path, token: str) -> BridgeProcess:
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{store}/mlflow.db").search_experiments()  # the tables exist before the bridge writes
    return BridgeProcess(
        [
            "--exporters",
            "mlflow",
            "--trace-backend",
            "mlflow",
            "--prometheus-port",
            "0",
            "--auth-token-env",
            "OTEL_RL_BRIDGE_TOKEN",
            "--http-address",
            f"127.0.0.1:{free_port()}",
        ],
        clean_env(**tracker_env(store), OTEL_RL_BRIDGE_TOKEN=token),
        store,
    )


def run(n: int, rate: float, seconds: float, root: Path, chain: dict, stores: Stores) -> dict:
    project = f"chain{n}-{uuid.uuid4().hex[:6]}"
    trainers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TRAINER,
                f"http://{chain['agent'].http}",
                project,
                f"{project}-run{i}",
                str(seconds),
                str(rate / n),
            ],
            env=clean_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    for t in trainers:
        assert json.loads(t.stdout.readline())["ready"]  # type: ignore[union-attr]
    before_seen = set(stores.seen)
    procs = {"agent": [chain["agent"].proc.pid], "gateway": [chain["gateway"].proc.pid]}
    procs.update({f"bridge-{i}": [b.pid] for i, b in enumerate(chain["bridges"])})
    for i, t in enumerate(trainers):
        procs[f"trainer-{i}"] = tree(t.pid)
    samples: list[tuple[float, dict[str, float]]] = []  # (time, CPU seconds so far per process)
    last_cpu: dict[str, float] = {}

    def sample() -> None:
        for k, pids in procs.items():  # an ended trainer keeps its last reading (its children went with it)
            last_cpu[k] = max(last_cpu.get(k, 0.0), sum(cpu_s(p) for p in pids))
        samples.append((time.time(), dict(last_cpu)))

    sample()
    t0 = time.time()
    for t in trainers:
        t.stdin.write("go\n")  # type: ignore[union-attr]
        t.stdin.flush()  # type: ignore[union-attr]
    time.sleep(1.0)
    for i, t in enumerate(trainers):  # the export process of a trainer starts with its pipeline
        procs[f"trainer-{i}"] = tree(t.pid)
    done: list[dict] = []
    while any(t.poll() is None for t in trainers):
        stores.poll()
        sample()
        time.sleep(0.2)
    for t in trainers:
        out, _ = t.communicate(timeout=120)
        if t.returncode != 0:
            raise RuntimeError(f"trainer failed ({t.returncode}): {out[-2000:]}")
        done.append(json.loads(out.strip().splitlines()[-1]))
    made = sum(d["trajectories"] for d in done)
    steps = sum(d["steps"] for d in done)
    deadline = time.time() + 300
    while len(set(stores.seen) - before_seen) < made and time.time() < deadline:
        stores.poll()
        sample()
        time.sleep(0.2)
    mine = {k: v for k, v in stores.seen.items() if k not in before_seen}
    first = min(seen for _, seen in mine.values()) if mine else t0
    last = max(seen for _, seen in mine.values()) if mine else time.time()
    # CPU: the busiest 3 s of each process (cores), and its CPU time per stored trajectory (ms)
    peak: dict[str, float] = {}
    for i, (ta, ca) in enumerate(samples):
        for tb, cb in samples[i + 1 :]:
            if tb - ta >= 3.0:
                for k in procs:
                    peak[k] = max(peak.get(k, 0.0), (cb[k] - ca[k]) / (tb - ta))
                break
    used = {k: samples[-1][1][k] - samples[0][1][k] for k in procs}
    cpu = {k: (peak.get(k, 0.0), used[k] / max(1, len(mine)) * 1e3) for k in procs}
    points = stores.metric_points(project)
    lat = sorted(seen - end for end, seen in mine.values())
    return {
        "n": n,
        "rate": rate,
        "lost_in_trainers": sum(d["lost"] for d in done),
        "trajectories": made,
        "stored": len(mine),
        "steps": steps,
        "points": points,
        "points_expected": steps * METRICS_PER_STEP,
        "offered": made / (max(d["end"] for d in done) - min(d["start"] for d in done)),
        "sustained": len(mine) / max(1e-9, last - first),  # the stores' intake, first to last arrival
        "p50": statistics.median(lat) if lat else float("nan"),
        "p95": statistics.quantiles(lat, n=20)[18] if len(lat) > 20 else float("nan"),
        "max": lat[-1] if lat else float("nan"),
        "cpu": cpu,
    }


HEADER = (
    f"{'N':>2} {'offered/s':>9} {'made':>6} {'stored':>6} {'points':>13} {'made/s':>7} {'stored/s':>8} "
    f"{'p50 s':>6} {'p95 s':>6} {'max s':>6}   CPU per process: busiest 3 s (cores) / ms per trajectory"
)


def report(r: dict) -> str:
    cpu = "  ".join(f"{k} {v[0]:.2f}/{v[1]:.2f}" for k, v in r["cpu"].items())
    return (
        f"{r['n']:>2} {r['rate']:>9,.0f} {r['trajectories']:>6} {r['stored']:>6} "
        f"{r['points']:>6}/{r['points_expected']:<6} "
        f"{r['offered']:>7,.0f} {r['sustained']:>8,.0f} {r['p50']:>6.2f} {r['p95']:>6.2f} {r['max']:>6.2f}   {cpu}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--trainers", default=None, help="comma list of N, e.g. 1,2,4")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--rates", default=None, help="offered trajectories/s, all trainers together, e.g. 100,200")
    a = p.parse_args()
    if not otelcol_available():
        print("otelcol-rl is not built (bash scripts/build-collector.sh)")
        return 1
    ns = [int(x) for x in (a.trainers or ("1,2" if a.quick else "1,2,4")).split(",")]
    seconds = a.seconds or (10.0 if a.quick else 20.0)
    rates = [float(x) for x in (a.rates or "200,600").split(",")]
    print(
        f"bench_chain: Python {platform.python_version()} on {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.2f}; trainers {ns} x offered {rates} trajectories/s, {seconds:.0f} s; per step 8 "
        f"trajectories x 5 spans + 40 metrics"
    )
    with tempfile.TemporaryDirectory(prefix="bench-chain-") as tmp:
        root = Path(tmp)
        token = uuid.uuid4().hex
        chain: dict = {"bridges": []}
        try:
            dbs = []
            for i in range(2):
                store = root / f"store-{i}"
                store.mkdir()
                dbs.append(store / "mlflow.db")
                chain["bridges"].append(start_bridge(store, token))
            chain["gateway"] = Collector(
                root,
                "gateway",
                [COLLECTOR_DIR / "gateway.yaml", COLLECTOR_DIR / "gateway-sharded.yaml"],
                extra=gateway_extra([b.grpc for b in chain["bridges"]]),
                env={"OTEL_RL_BRIDGE_TOKEN": token},
            )
            chain["agent"] = Collector(
                root, "agent", [COLLECTOR_DIR / "agent.yaml"], env={"OTEL_GATEWAY_ENDPOINT": chain["gateway"].grpc}
            )
            stores = Stores(dbs)
            results = []
            for n in ns:
                for rate in rates:
                    results.append(run(n, rate, seconds, root, chain, stores))
                    print(report(results[-1]), flush=True)
        finally:
            for k in ("agent", "gateway"):
                if k in chain:
                    chain[k].stop()
            for b in chain["bridges"]:
                b.terminate(60)
    print(f"\n{HEADER}")
    for r in results:
        print(report(r))
    lost = [
        r
        for r in results
        if r["stored"] != r["trajectories"] or r["points"] != r["points_expected"] or r["lost_in_trainers"]
    ]
    print("0 lost, 0 duplicated" if not lost else f"MISMATCH in N={[r['n'] for r in lost]}")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
