"""otelcol-rl (the project's Collector build, .cache/bin/otelcol-rl) as a test subprocess on 127.0.0.1.

deploy/'s configs listen on fixed ports (4317, 4318, 13133, 8888); a test runs them unchanged and merges a
second config file over them (the Collector's own `--config a.yaml --config b.yaml` merge) that moves every
listener to a free loopback port and writes the persistent queues under the test's directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ._stack import ROOT, clean_env, free_port

OTELCOL = ROOT / ".cache" / "bin" / "otelcol-rl"
COLLECTOR_DIR = ROOT / "deploy" / "collector"


def otelcol_available() -> bool:
    return OTELCOL.is_file() and os.access(OTELCOL, os.X_OK)


def validate(*configs: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [str(OTELCOL), "validate", *[f"--config={c}" for c in configs]]
    return subprocess.run(cmd, env=clean_env(**(env or {})), capture_output=True, text=True, timeout=60)


class Collector:
    """One otelcol-rl process: `configs` from deploy/ plus the loopback override; `.grpc`, `.http` are host:port.

    `extra` is merged last (a dict written as JSON, which is YAML); `env` fills the configs' ${env:...}."""

    def __init__(self, cwd: Path, name: str, configs: list[Path], env: dict[str, str], extra: dict | None = None,
                 storage: Path | None = None):
        self.cwd, self.name = cwd, name
        self.grpc = f"127.0.0.1:{free_port()}"
        self.http = f"127.0.0.1:{free_port()}"
        self.health = free_port()
        self.metrics_port = free_port()
        self.storage = storage or cwd / f"{name}-storage"
        self.storage.mkdir(parents=True, exist_ok=True)
        override: dict[str, Any] = {
            "extensions": {"health_check": {"endpoint": f"127.0.0.1:{self.health}"}},
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": self.grpc},
                                                 "http": {"endpoint": self.http}}}},
            "service": {"telemetry": {"metrics": {"level": "detailed", "readers": [{"pull": {"exporter": {
                "prometheus": {"host": "127.0.0.1", "port": self.metrics_port}}}}]}}},
        }
        self.override = cwd / f"{name}-override.yaml"
        self.override.write_text(json.dumps(override))
        self.configs = [*configs, self.override]
        if extra:
            path = cwd / f"{name}-extra.yaml"
            path.write_text(json.dumps(extra))
            self.configs.append(path)
        self.env = clean_env(OTELCOL_STORAGE_DIR=str(self.storage), **env)
        self.log_path = cwd / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 60.0) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(OTELCOL), *[f"--config={c}" for c in self.configs]], env=self.env,
                                     cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector {self.name} exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"collector {self.name} not healthy:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the Collector's own metric `name` over the series whose labels include `labels`."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def reload(self) -> None:
        """SIGHUP: the Collector reads its config files again."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)


# ----------------------------------------------------------------------------- trainers and the MLflow stores


def trainer(mode: str, endpoint: str, out: Path, env: dict, cwd: Path, project: str, run_id: str,
            steps: int = 3, samples: int = 2, step_pause_s: float = 0.0) -> subprocess.Popen:
    """tests/bridge/trainer.py: the instrumented workload over OTLP; what it recorded goes to `out` (JSON)."""
    from bridge.helpers import TRAINER

    cmd = [sys.executable, str(TRAINER), mode, endpoint, str(out), "--project", project, "--experiment", "grpo",
           "--run-id", run_id, "--steps", str(steps), "--samples", str(samples), "--step-pause", str(step_pause_s)]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_ok(proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out.decode(errors='replace')[-4000:]}"


def mlflow_snapshot(store: Path, project: str) -> dict:
    """{otel-rl run id: what the MLflow sqlite store under `store` holds for it}, {} before the project exists."""
    from bridge.test_trackers import _mlflow_snapshot

    try:
        return _mlflow_snapshot(f"sqlite:///{store}/mlflow.db", project)
    except AssertionError:  # no experiment yet
        return {}


def without_status(snapshot: dict) -> dict:
    """A store snapshot without the runs' status: the bridge ends its runs only when it stops (FINISHED), while the
    in-process store's run ended with its trainer."""
    return {rid: {k: v for k, v in run.items() if k != "status"} for rid, run in snapshot.items()}


def wait_for_store(store: Path, project: str, want: dict, timeout: float = 120) -> dict:
    """The store's snapshot once it equals `want` but for the runs' status (or the last one read, at the
    deadline)."""
    deadline = time.monotonic() + timeout
    want = without_status(want)
    while True:
        got = mlflow_snapshot(store, project)
        if without_status(got) == want or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def store_mismatch(run: dict | None, cap: dict) -> str | None:
    """None when the MLflow run holds exactly what the trainer recorded (`cap`): every metric point once, every
    trajectory as one trace with its spans, every table; else what differs."""
    from bridge.test_trackers import _check_mlflow_against_capture

    if run is None:
        return "no run"
    try:
        _check_mlflow_against_capture(run, cap)
    except AssertionError as e:
        return str(e)[:2000] or "differs"
    return None


def wait_until(check, timeout: float, every: float = 0.5):
    """Calls `check()` until it returns None; returns that None, or the last answer at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        answer = check()
        if answer is None or time.monotonic() > deadline:
            return answer
        time.sleep(every)


def start_bridge(store: Path, port: int, token: str):
    """`otel-rl bridge` with the MLflow exporter writing the sqlite store under `store`, bearer token `token`,
    OTLP/HTTP on 127.0.0.1:`port` (fixed, so a restarted bridge is found again), OTLP/gRPC on a free port."""
    from bridge.helpers import BridgeProcess, clean_env, tracker_env
    from mlflow import MlflowClient

    # the store's tables made here, so the test never reads a database the bridge is still creating
    MlflowClient(f"sqlite:///{store}/mlflow.db").search_experiments()
    return BridgeProcess(["--exporters", "mlflow", "--trace-backend", "mlflow", "--batch-delay", "0.05",
                          "--prometheus-port", "0", "--auth-token-env", "OTEL_RL_BRIDGE_TOKEN",
                          "--http-address", f"127.0.0.1:{port}", "--shutdown-timeout", "30"],
                         clean_env(**tracker_env(store), OTEL_RL_BRIDGE_TOKEN=token), store)
