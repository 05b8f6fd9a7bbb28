"""Memory of the training process and the export process while the tracker is stalled, beside the OTel SDK.

    .venv/bin/python benchmarks/bench_outage_memory.py                  # 1,000,000 spans
    .venv/bin/python benchmarks/bench_outage_memory.py --quick          # 100,000 spans
    .venv/bin/python benchmarks/bench_outage_memory.py --tree /tmp/old  # the otel-rl of another checkout

The tracker is a real ``mlflow server`` (sqlite store) on 127.0.0.1.  A trainer process opens its run
while the server is up, then the server is stopped with ``SIGSTOP``: a hung tracker.  Its socket still
accepts connections (the kernel completes them) and takes the requests' bytes, but nothing answers:
the client's call hangs until its own timeout, the case where nothing tells the queue that the tracker
is gone (a dead port, which refuses at once, is the easy case).  It is also the one that can be resumed
(``SIGCONT``) so that what was kept can be counted in the store.

The trainer emits ``--spans`` spans at ``--rate`` spans a second, in steps of: one ``step`` span, one
``log()`` of 20 keys (an ``rl.log`` span), and ``--trajectories`` trajectories of one root span and
``--ops`` op spans (``@op`` with a small input and output: a prompt of ~60 characters, a dict reply).
Meanwhile this script samples ``VmRSS`` of the trainer and of its export process (``/proc/<pid>/status``)
every 0.1 s.  Once everything is emitted, the outage lasts ``--hold`` seconds more; then the server is
continued, the trainer flushes (delivery complete), and its memory is sampled again after delivery.
What reached the store is counted in the server's sqlite file: every trajectory span
(``spans``) and every metric point (``metrics``) against what was emitted.

Beside it, in the same run: a process with the OpenTelemetry SDK's ``BatchSpanProcessor`` and the
official ``OTLPSpanExporter`` (HTTP) sending the same spans (the same attributes as JSON strings) to the
same stalled server's OTLP endpoint (``/v1/traces``), at the same rate; its memory, and how many spans
reached the store after the server is continued.

Growth is against each process's RSS just before the outage (after the run is open and a first step
delivered).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VENV_BIN = Path(sys.executable).parent
KEYS = 20
MB = 1024 * 1024


# ----------------------------------------------------------------------------- the tracker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "MLFLOW_", "WANDB_", "SWANLAB_"))
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "NO_PROXY": "127.0.0.1,localhost"})
    return env


class Server:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = root / "server.db"
        env = _clean_env()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        cmd = [
            str(VENV_BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.db}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = open(root / "server.log", "ab")  # noqa: SIM115 - kept open for the server's life
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("mlflow server did not start")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def experiment_id(self, name: str) -> str | None:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=60)
        try:
            row = con.execute(
                "SELECT experiment_id, name FROM experiments WHERE name LIKE ?", (f"%{name}%",)
            ).fetchone()
        finally:
            con.close()
        return str(row[0]) if row else None

    def create_experiment(self, name: str) -> str:
        req = urllib.request.Request(
            f"{self.url}/api/2.0/mlflow/experiments/create",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(json.load(r)["experiment_id"])

    def count(self, experiment_id: str) -> tuple[int, int]:
        """(trace spans, metric points) of the experiment, read from the server's sqlite file."""
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=60)
        try:
            spans = con.execute(
                "SELECT count(*) FROM spans WHERE experiment_id = ?",
                (experiment_id,),
            ).fetchone()[0]
            points = con.execute(
                "SELECT count(*) FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid WHERE r.experiment_id = ?",
                (experiment_id,),
            ).fetchone()[0]
        finally:
            con.close()
        return int(spans), int(points)


# ----------------------------------------------------------------------------- sampling


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB; (0, 0) once the process is gone."""
    rss = hwm = 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, hwm


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


class Child:
    """A trainer process driven line by line: it says where it is, we say when the outage ends."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        self.lines: list[str] = []
        self.samples: list[tuple[float, str, float, float]] = []  # (t, phase, trainer MB, export process MB)
        self.phase = "start"
        self.t0 = time.monotonic()
        self.export_pid: int | None = None
        self.base = (0.0, 0.0)
        self.msgs: dict[str, dict] = {}

    def sample(self) -> None:
        if self.export_pid is None:
            kids = children(self.proc.pid)
            self.export_pid = kids[0] if kids else None
        t = rss_mb(self.proc.pid)[0]
        e = rss_mb(self.export_pid)[0] if self.export_pid else 0.0
        self.samples.append((time.monotonic() - self.t0, self.phase, t, e))

    def wait_for(self, word: str, timeout_s: float = 3600.0) -> dict:
        """Sample every 0.1 s until the child prints `word {json}`."""
        deadline = time.monotonic() + timeout_s
        out = self.proc.stdout
        assert out is not None
        while time.monotonic() < deadline:
            self.sample()
            r, _, _ = select.select([out], [], [], 0.1)
            if r:
                line = out.readline()
                if not line:
                    raise RuntimeError(f"trainer ended before {word!r}")
                if not line.startswith("@bench "):
                    sys.stdout.write("  | " + line)  # what the trainer printed itself
                    continue
                w, _, rest = line[7:].strip().partition(" ")
                self.msgs[w] = json.loads(rest) if rest else {}
                if w == word:
                    return self.msgs[w]
        raise RuntimeError(f"no {word!r} within {timeout_s} s")

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def peak(self, phases: set[str]) -> tuple[float, float, float]:
        """Peak growth over `phases`: trainer, export process, and their sum at one moment."""
        s = [x for x in self.samples if x[1] in phases]
        bt, be = self.base
        return (
            max(x[2] - bt for x in s),
            max((x[3] - be for x in s if x[3]), default=0.0),
            max(x[2] - bt + (x[3] - be if x[3] else 0.0) for x in s),
        )

    def last(self) -> tuple[float, float]:
        s = self.samples[-1]
        return s[2] - self.base[0], (s[3] - self.base[1]) if s[3] else 0.0


# ----------------------------------------------------------------------------- the trainers (child side)


PROMPT = "Solve: a train leaves at 9:00 at 60 km/h; when does it arrive?"


def _pace(i_span: int, rate: float, t0: float) -> None:
    ahead = i_span / rate - (time.monotonic() - t0)
    if ahead > 0:
        time.sleep(ahead)


def _say(word: str, **kw: object) -> None:
    print("@bench", word, json.dumps(kw), flush=True)


def trainer_otel_rl(args: argparse.Namespace) -> None:
    import otel_rl

    @otel_rl.op
    def act(turn: int, prompt: str) -> dict:
        return {"turn": turn, "text": "the answer is 10:30", "tokens": 12}

    per_step = 2 + args.trajectories * (1 + args.ops)
    steps = max(1, args.spans // per_step)
    h = otel_rl.init(
        project=args.project,
        experiment=args.project,
        exporters=["mlflow"],
        trace_backend="mlflow",
        spool_dir=args.spool,
        **json.loads(args.settings),
    )

    def step(n: int) -> None:
        with otel_rl.step(n):
            for k in range(args.trajectories):
                with otel_rl.trajectory(sample_index=k):
                    for j in range(args.ops):
                        act(j, PROMPT)
            h.log({f"m/{i}": n + i / 100 for i in range(KEYS)}, step=n)

    step(0)
    h.flush(120)
    _say("OPEN", pid=os.getpid())
    sys.stdin.readline()  # the tracker is stopped now
    t0 = time.monotonic()
    for n in range(1, steps + 1):
        step(n)
        _pace(n * per_step, args.rate, t0)
    emitted_s = time.monotonic() - t0
    s = h.stats()
    _say("EMITTED", steps=steps + 1, per_step=per_step, seconds=emitted_s, shed=sum(s.get("shed", {}).values()))
    sys.stdin.readline()  # the tracker is continued
    t1 = time.monotonic()
    ok = h.flush(3600)
    ex = h.stats()["exporters"]["mlflow"]
    _say("DELIVERED", ok=ok, seconds=time.monotonic() - t1, stats=ex)
    sys.stdin.readline()  # memory after delivery sampled
    h.shutdown()
    _say("END")


def trainer_sdk(args: argparse.Namespace) -> None:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    tp = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    exp = OTLPSpanExporter(
        endpoint=args.endpoint + "/v1/traces", headers={"x-mlflow-experiment-id": args.experiment_id}
    )
    tp.add_span_processor(BatchSpanProcessor(exp))
    tracer = tp.get_tracer("bench")
    per_step = 2 + args.trajectories * (1 + args.ops)
    steps = max(1, args.spans // per_step)
    out = json.dumps({"turn": 0, "text": "the answer is 10:30", "tokens": 12})

    def step(n: int) -> None:
        with tracer.start_as_current_span("step", attributes={"rl.step": n}) as st:
            for k in range(args.trajectories):
                with tracer.start_as_current_span(
                    "trajectory",
                    context=trace.set_span_in_context(trace.INVALID_SPAN),
                    links=[trace.Link(st.get_span_context())],
                ) as root:
                    root.set_attribute("rl.sample_index", k)
                    for j in range(args.ops):
                        with tracer.start_as_current_span("act") as sp:
                            sp.set_attribute("mlflow.spanInputs", json.dumps({"turn": j, "prompt": PROMPT}))
                            sp.set_attribute("mlflow.spanOutputs", out)
            with tracer.start_as_current_span("rl.log", attributes={f"m/{i}": n + i / 100 for i in range(KEYS)}):
                pass

    step(0)
    tp.force_flush(60_000)
    _say("OPEN", pid=os.getpid())
    sys.stdin.readline()
    t0 = time.monotonic()
    for n in range(1, steps + 1):
        step(n)
        _pace(n * per_step, args.rate, t0)
    _say("EMITTED", steps=steps + 1, per_step=per_step, seconds=time.monotonic() - t0, shed=0)
    sys.stdin.readline()
    t1 = time.monotonic()
    ok = tp.force_flush(600_000)
    _say("DELIVERED", ok=ok, seconds=time.monotonic() - t1, stats={})
    sys.stdin.readline()
    tp.shutdown()
    _say("END")


# ----------------------------------------------------------------------------- the run


def run_variant(name: str, server: Server, args: argparse.Namespace, tmp: Path, env: dict[str, str]) -> dict:
    project = f"outage-{name}-{os.getpid()}"
    argv = [
        "--child",
        name,
        "--spans",
        str(args.spans),
        "--rate",
        str(args.rate),
        "--trajectories",
        str(args.trajectories),
        "--ops",
        str(args.ops),
        "--project",
        project,
        "--spool",
        str(tmp / f"spool-{name}"),
        "--settings",
        args.settings,
        "--endpoint",
        server.url,
    ]
    exp_id = None
    if name == "sdk":
        exp_id = server.create_experiment(project)
        argv += ["--experiment-id", exp_id]
    c = Child(argv, dict(env, MLFLOW_TRACKING_URI=server.url))
    c.wait_for("OPEN", 600)
    for _ in range(10):  # settle, then the baseline: the mean of a second
        time.sleep(0.1)
        c.sample()
    base = c.samples[-10:]
    c.base = (sum(x[2] for x in base) / 10, sum(x[3] for x in base) / 10)
    server.signal(signal.SIGSTOP)
    c.phase = "outage"
    c.tell("go")
    emitted = c.wait_for("EMITTED")
    hold_end = time.monotonic() + args.hold
    while time.monotonic() < hold_end:
        c.sample()
        time.sleep(0.1)
    at_hold = c.last()
    pk = c.peak({"outage"})
    print(
        f"  [{name}] outage: peak growth trainer {pk[0]:+.0f} MB, export process {pk[1]:+.0f} MB, sum {pk[2]:+.0f} MB; "
        f"at its end {at_hold[0]:+.0f} / {at_hold[1]:+.0f} MB",
        flush=True,
    )
    server.signal(signal.SIGCONT)
    c.phase = "delivery"
    c.tell("go")
    delivered = c.wait_for("DELIVERED")
    c.phase = "after"
    for _ in range(20):
        c.sample()
        time.sleep(0.1)
    after = c.last()
    c.tell("go")
    c.wait_for("END", 300)
    c.proc.wait(120)
    if exp_id is None:
        exp_id = server.experiment_id(project)
    time.sleep(1.0)
    n_steps, per_step = emitted["steps"], emitted["per_step"]
    want_spans = n_steps * args.trajectories * (1 + args.ops)
    want_points = n_steps * KEYS
    got_spans, got_points = server.count(exp_id or "")
    if name == "sdk":  # its rl.log and step spans are spans too
        want_spans = n_steps * per_step
    peak = c.peak({"outage"})
    peak_all = c.peak({"outage", "delivery"})
    return {
        "name": name,
        "spans_emitted": n_steps * per_step,
        "emit_s": emitted["seconds"],
        "shed": emitted["shed"],
        "base_mb": c.base,
        "peak_outage_mb": peak,
        "peak_incl_delivery_mb": peak_all,
        "at_end_of_outage_mb": at_hold,
        "after_delivery_mb": after,
        "deliver_s": delivered["seconds"],
        "flush_ok": delivered["ok"],
        "stored_spans": got_spans,
        "want_spans": want_spans,
        "stored_points": got_points,
        "want_points": want_points if name != "sdk" else 0,
        "stats": delivered["stats"],
        "samples": c.samples,
    }


def report(r: dict) -> None:
    bt, be = r["base_mb"]
    pt, pe, ps = r["peak_outage_mb"]
    dt, de, ds = r["peak_incl_delivery_mb"]
    ht, he = r["at_end_of_outage_mb"]
    at, ae = r["after_delivery_mb"]
    lost_spans = r["want_spans"] - r["stored_spans"]
    print(f"\n== {r['name']}: {r['spans_emitted']:,} spans emitted in {r['emit_s']:.1f} s (shed {r['shed']})")
    print(f"  baseline RSS: trainer {bt:.0f} MB, export process {be:.0f} MB")
    print(f"  growth, peak during the outage:    trainer {pt:+.0f} MB, export process {pe:+.0f} MB, sum {ps:+.0f} MB")
    print(f"  growth, peak incl. the delivery:   trainer {dt:+.0f} MB, export process {de:+.0f} MB, sum {ds:+.0f} MB")
    print(f"  growth at the end of the outage:   trainer {ht:+.0f} MB, export process {he:+.0f} MB")
    print(f"  growth 2 s after delivery:         trainer {at:+.0f} MB, export process {ae:+.0f} MB")
    print(f"  delivery after resume: {r['deliver_s']:.1f} s (flush ok: {r['flush_ok']})")
    print(
        f"  in the store: {r['stored_spans']:,} / {r['want_spans']:,} trace spans (lost {lost_spans:,}, "
        f"{100 * lost_spans / max(1, r['want_spans']):.1f} %)"
        + (f", {r['stored_points']:,} / {r['want_points']:,} metric points" if r["want_points"] else "")
    )
    st = r["stats"]
    if st:
        print(
            f"  queue: exported {st.get('exported')}, spooled {st.get('spooled')}, dropped {st.get('dropped')}, "
            f"replayed {st.get('replayed')}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--quick", action="store_true", help="100,000 spans, 5 s of outage after them")
    ap.add_argument("--rate", type=float, default=20_000.0, help="spans a second")
    ap.add_argument("--trajectories", type=int, default=16, help="trajectories a step")
    ap.add_argument("--ops", type=int, default=7, help="op spans a trajectory")
    ap.add_argument("--hold", type=float, default=15.0, help="seconds of outage after the last span")
    ap.add_argument("--tree", default=str(REPO), help="the otel-rl checkout to run (its root)")
    ap.add_argument("--variants", default="otel-rl,sdk")
    ap.add_argument("--settings", default="{}", help="otel_rl.init keywords, as JSON")
    ap.add_argument("--json", default=None, help="write the results (with the samples) here")
    # child side
    ap.add_argument("--child", default=None)
    ap.add_argument("--project", default="")
    ap.add_argument("--spool", default="")
    ap.add_argument("--endpoint", default="")
    ap.add_argument("--experiment-id", default="")
    args = ap.parse_args()
    if args.child == "otel-rl":
        trainer_otel_rl(args)
        return 0
    if args.child == "sdk":
        trainer_sdk(args)
        return 0
    if args.quick:
        args.spans, args.hold = 100_000, 5.0
    tree = Path(args.tree).resolve()
    env = _clean_env()
    paths = [str(tree)] + [str(p) for p in sorted((tree / "exporters").glob("*")) if p.is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # the queue retries
    env["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "120"  # MLflow's default
    env["OTEL_RL_SHUTDOWN_TIMEOUT_S"] = "600"
    rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"otel-rl tree: {tree} ({rev.stdout.strip()})")
    print(
        f"{args.spans:,} spans at {args.rate:,.0f}/s; a step: 1 step span, 1 log() of {KEYS} keys, "
        f"{args.trajectories} trajectories of 1 root + {args.ops} ops; "
        f"outage held {args.hold:.0f} s after the last span"
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as d:
        tmp = Path(d)
        server = Server(tmp)
        try:
            for name in args.variants.split(","):
                r = run_variant(name, server, args, tmp, env)
                report(r)
                results.append(r)
        finally:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
