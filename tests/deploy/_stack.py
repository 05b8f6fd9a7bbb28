"""What the deploy tests start for real: `otel-rl bridge`, a Prometheus server, an OTLP/HTTP sink, `otel-rl demo`,
and a short instrumented GRPO-shaped workload that logs the demo's verl metric names through otel-rl."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "WANDB_", "SWANLAB_", "MLFLOW_", "VERL_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")}
    env.update({"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM the process (its own group), then SIGKILL if it does not exit."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(5)


# ----------------------------------------------------------------------------- OTLP/HTTP sink


class OtlpSink:
    """Stores the OTLP/HTTP request bodies it receives (the bridge forwards what it accepts here)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with sink.lock:
                    sink.bodies.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict, dict, Any]]:
        """[(resource attributes, span attributes, span)] of every forwarded trace request."""
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        out = []
        with self.lock:
            bodies = [b for p, b in self.bodies if p.endswith("/v1/traces")]
        for body in bodies:
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                res = {kv.key: _any(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append((res, {kv.key: _any(kv.value) for kv in s.attributes}, s))
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _any(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_any(x) for x in v.array_value.values)
    return None if which is None else getattr(v, which)


# ----------------------------------------------------------------------------- otel-rl bridge


class Bridge:
    """`otel-rl bridge` as a subprocess: OTLP/HTTP in, `discard` exporter, forwarding, its own metrics."""

    def __init__(self, cwd: Path, forward: str, timeout_s: float = 120.0):
        self.log_path = cwd / "bridge.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "otel_rl.cli", "bridge", "--exporters", "discard",
               "--http-address", "127.0.0.1:0", "--grpc-address", "off", "--prometheus-port", "0",
               "--forward-endpoint", forward, "--batch-delay", "0.05", "--shutdown-timeout", "10"]
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        self.ready: dict[str, Any] | None = None
        got = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").strip()
                if line.startswith('{"event": "ready"'):
                    self.ready = json.loads(line)
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(timeout_s) or self.ready is None:
            self.close()
            raise RuntimeError("otel-rl bridge did not start:\n" + self.log_path.read_text(errors="replace")[-3000:])
        self.http = "http://" + self.ready["http"]
        self.prometheus = self.ready["prometheus"]

    def close(self) -> None:
        stop(self.proc)
        self._log.close()


# ----------------------------------------------------------------------------- Prometheus


class Prometheus:
    """The real Prometheus server on 127.0.0.1 scraping `targets` ({job: "host:port"}) twice a second."""

    def __init__(self, binary: str, cwd: Path, targets: dict[str, str], extra_args: tuple[str, ...] = ()):
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
               "scrape_configs": [{"job_name": job, "scrape_interval": "500ms", "scrape_timeout": "500ms",
                                   "static_configs": [{"targets": [t]}]} for job, t in targets.items()]}
        path = cwd / "prometheus.yml"
        path.write_text(json.dumps(cfg))  # JSON is YAML
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = cwd / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={cwd / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h", *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("prometheus exited:\n" + self.log())
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus not ready:\n" + self.log())
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(url, timeout=15) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400 for a bad expression: say which
            raise AssertionError(f"{path} {params}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None
        assert body["status"] == "success", body
        return body["data"]

    def targets_up(self) -> dict[str, str]:
        return {t["labels"]["job"]: t["health"] for t in self.api("targets")["activeTargets"]}

    def close(self) -> None:
        stop(self.proc)
        self._log.close()


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


# ----------------------------------------------------------------------------- the workload


PROJECT = "deploy_test"
EXPERIMENT = "grpo_arith_dashboards"
STEPS = 8
BATCH, N = 4, 2
VAL_EVERY = 4


def _stats(name: str, values: list[float]) -> dict[str, float]:
    return {f"{name}/mean": sum(values) / len(values), f"{name}/max": max(values), f"{name}/min": min(values)}


def run_workload(prometheus_port: int, otlp_endpoint: str, spool_dir: str | None, step_pause_s: float = 0.45) -> Any:
    """A short GRPO-shaped run through otel-rl's public API, logging the metric names of `otel_rl.demo` (verl's):
    steps with timers, n rollouts per prompt as trajectories with a generation and a tool call (some raise),
    validation rollouts, `log()` of the verl keys. Returns the handle, still open (its endpoint still serves)."""
    import otel_rl

    kwargs: dict[str, Any] = {}
    if spool_dir is not None:  # a spooled exporter, so the spool-size series exists
        kwargs.update(spool_dir=spool_dir, spool_exporters="memory")
    h = otel_rl.init(exporters=["prometheus", "otlp", "memory"], prometheus_port=prometheus_port,
                     otlp_endpoint=otlp_endpoint, otlp_protocol="http/protobuf", project=PROJECT,
                     experiment=EXPERIMENT, batch_delay_s=0.05, max_samples=2, **kwargs)
    rng = random.Random(0)

    @otel_rl.generate(model="tiny-policy")
    async def generate(prompt: list[int]) -> dict:
        await asyncio.sleep(rng.uniform(0.002, 0.02))
        return {"prompt_ids": prompt, "response_ids": [7] * rng.randint(2, 12)}

    @otel_rl.tool(name="calculator")
    def calculator(expression: str, tool_call_id: str) -> int:
        a, op, b = re.match(r"(\d+)([+*/])(\d+)", expression).groups()  # type: ignore[union-attr]
        if op == "/":
            return int(a) // int(b)  # raises ZeroDivisionError for b == 0
        return int(a) + int(b) if op == "+" else int(a) * int(b)

    async def rollout(step: int, i: int, r: int, validate: bool) -> dict:
        with otel_rl.trajectory(step=step, sample_index=i, rollout_n=r, validate=validate, name="agent_loop") as t:
            out = await generate([1] * (4 + i))
            turns, calls = 1, 0
            if (i + r + step) % 2 == 0:
                calls += 1
                try:
                    calculator(f"{i}{'/' if (step + i) % 3 == 0 else '+'}{r}", tool_call_id=f"call-{step}-{i}-{r}")
                except ZeroDivisionError:
                    pass
                out = await generate([1] * 6)
                turns += 1
            await asyncio.sleep(rng.uniform(0.01, 0.3))
            reward = float(rng.random() < 0.3 + 0.05 * step)
            t.set_reward(reward)
            return {"reward": reward, "turns": turns, "calls": calls, "resp": len(out["response_ids"]),
                    "prompt": 4 + i}

    async def main() -> None:
        for step in range(1, STEPS + 1):
            t_step = time.monotonic()
            with otel_rl.step(step):
                metrics: dict[str, float] = {}
                with otel_rl.timer("step"):
                    otel_rl.select_samples(step, range(BATCH))
                    with otel_rl.timer("gen"):
                        outs = await asyncio.gather(*[rollout(step, i, r, False)
                                                      for i in range(BATCH) for r in range(N)])
                    with otel_rl.timer("reward"):
                        scores = [o["reward"] for o in outs]
                        metrics.update(_stats("critic/score", scores))
                        metrics.update(_stats("critic/rewards", scores))
                        metrics.update(_stats("response_length", [o["resp"] for o in outs]))
                        metrics["response_length/clip_ratio"] = 0.0
                        metrics.update(_stats("prompt_length", [o["prompt"] for o in outs]))
                        metrics.update(_stats("num_turns", [o["turns"] for o in outs]))
                        metrics.update(_stats("tool_call_counts", [o["calls"] for o in outs]))
                    for phase in ("old_log_prob", "ref", "adv", "update_actor"):
                        with otel_rl.timer(phase):
                            time.sleep(0.01)
                    metrics.update({
                        "actor/entropy": 2.0 - 0.1 * step, "actor/pg_loss": 0.05 * rng.uniform(-1, 1),
                        "actor/pg_clipfrac": 0.02 * step, "actor/pg_clipfrac_lower": 0.001 * step,
                        "actor/ppo_kl": 1e-4 * step, "actor/kl_loss": 1e-3 * step, "actor/grad_norm": 0.5 + 0.1 * step,
                        "actor/lr": 3e-3, "actor/kl_coef": 0.001,
                        "critic/advantages/mean": 0.0, "critic/returns/mean": 0.0,
                    })
                    if step % VAL_EVERY == 0 or step == STEPS:
                        with otel_rl.timer("testing"):
                            val = await asyncio.gather(*[rollout(step, i, 0, True) for i in range(BATCH)])
                        metrics["val-core/arith/reward/mean@1"] = sum(v["reward"] for v in val) / len(val)
                        metrics["val-aux/arith/acc/mean@1"] = metrics["val-core/arith/reward/mean@1"]
                tokens = sum(o["resp"] + o["prompt"] for o in outs)
                elapsed = time.monotonic() - t_step
                metrics.update({"perf/total_num_tokens": tokens, "perf/time_per_step": elapsed,
                                "perf/throughput": tokens / elapsed, "training/global_step": step,
                                "training/epoch": 0})
                otel_rl.log(metrics, step=step)
            h.flush(10)
            time.sleep(step_pause_s)

    asyncio.run(main())
    h.flush(10)
    return h


# ----------------------------------------------------------------------------- otel-rl demo


DEMO_RUN_ID = "deploy-test-demo"


def demo_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("otel_rl.demo.cli") is not None
    except (ImportError, ValueError):
        return False


class Demo:
    """``otel-rl demo`` (a real GRPO training on CPU) as a subprocess: its Prometheus endpoint on `port`, OTLP to
    `otlp_endpoint`, a JSONL file of every logged step, an on-disk spool behind its OTLP exporter."""

    def __init__(self, cwd: Path, port: int, otlp_endpoint: str, steps: int = 60):
        self.out = cwd / "demo"
        self.log_path = cwd / "demo.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "otel_rl.cli", "demo", "--quick", "--no-progress", f"--steps={steps}",
               "--output-dir", str(self.out), "--prometheus-port", str(port), "--otlp-endpoint", otlp_endpoint,
               'trainer.logger=["console","file"]', "trainer.test_freq=10",
               "actor_rollout_ref.rollout.trace.backend=otlp"]
        env = clean_env(OTEL_RL_RUN_ID=DEMO_RUN_ID, OTEL_RL_SPOOL_DIR=str(cwd / "demo-spool"),
                        OTEL_RL_SPOOL_EXPORTERS="otlp", OTEL_RL_BATCH_DELAY_S="0.05")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.flush()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def logged_keys(self) -> set[str]:
        keys: set[str] = set()
        for path in self.out.rglob("*.jsonl"):
            for line in path.read_text().splitlines():
                if line.strip():
                    keys.update(json.loads(line)["data"])
        return keys

    def close(self) -> None:
        stop(self.proc)
        self._log.close()


# ----------------------------------------------------------------------------- dashboards


def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels") or [])
        else:
            out.append(p)
    return out


def substitute(expr: str, values: dict[str, str], rate_interval: str = "5s") -> str:
    """Grafana's variable interpolation for the forms the dashboards use: ``$name``, ``${name}``,
    ``${name:regex}``, ``$__rate_interval``, ``$__interval``."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)
    expr = expr.replace("$__interval", "1s")

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown variable {name!r} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)", repl, expr)
