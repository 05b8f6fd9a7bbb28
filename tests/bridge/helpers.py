"""Shared by the bridge tests: start `otel-rl bridge` as a real subprocess, spec OTLP/JSON bodies."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, TraceFlags

from otel_rl import semconv as sc

VENV_BIN = Path(sys.executable).parent
OTEL_RL = VENV_BIN / "otel-rl"
HERE = Path(__file__).resolve().parent
TRAINER = HERE / "trainer.py"

_ID_KEYS = {"traceId", "spanId", "parentSpanId"}

_ids = iter(range(1, 1 << 60))


def log_spans(run_id: str, steps, project: str = "p", values=None) -> list[ReadableSpan]:
    """`rl.log` spans as the trainer's pipeline makes them, one per step."""
    res = Resource({sc.RL_PROJECT_NAME: project, sc.RL_EXPERIMENT_NAME: "e", sc.RL_RUN_ID: run_id})
    out = []
    for n in steps:
        vals = values or {"loss": 1.0 / (n + 1), "n": n}
        now = time.time_ns()
        out.append(ReadableSpan(
            sc.SPAN_LOG, context=SpanContext(next(_ids) << 64 | 1, next(_ids), False, TraceFlags(1)),
            resource=res, start_time=now, end_time=now,
            attributes={sc.RL_STEP: n, sc.RL_SPAN_KIND: sc.KIND_METRICS, sc.RL_METRICS_KEYS: tuple(vals),
                        sc.RL_METRICS_VALUES: tuple(float(v) for v in vals.values()),
                        sc.RL_METRICS_INT_KEYS: tuple(k for k, v in vals.items() if type(v) is int),
                        sc.RL_METRICS_INT_VALUES: tuple(v for v in vals.values() if type(v) is int)}))
    return out


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without OTEL_/tracker settings or proxies from outside, plus `extra` (ClearML
    marks the process that ran Task.init in its environment: a child would join that task)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "WANDB_", "SWANLAB_", "MLFLOW_", "VERL_", "CLEARML_", "TRAINS_", "TRACKIO_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")}
    env.update({"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
                "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def tracker_env(root: Path) -> dict[str, str]:
    """MLflow sqlite, wandb offline and SwanLab offline stores under `root`."""
    for d in ("wandb", "wandb/data", "wandb/cache", "wandb/config", "swanlog", "swanroot"):
        (root / d).mkdir(parents=True, exist_ok=True)
    return {
        "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
        "WANDB_MODE": "offline", "WANDB_DISABLE_WEAVE": "true", "WANDB_SILENT": "true",
        "WANDB_DIR": str(root / "wandb"), "WANDB_DATA_DIR": str(root / "wandb/data"),
        "WANDB_CACHE_DIR": str(root / "wandb/cache"), "WANDB_CONFIG_DIR": str(root / "wandb/config"),
        "SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(root / "swanlog"), "SWANLAB_ROOT": str(root / "swanroot"),
    }


class BridgeProcess:
    """`otel-rl bridge ...` in its own process group; `.http`, `.grpc`, `.prometheus` are host:port."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, start_timeout_s: float = 180.0):
        self.cwd = cwd
        self.log_path = cwd / f"bridge-{int(time.time() * 1000)}.log"
        self._log = open(self.log_path, "wb")
        cmd = [str(OTEL_RL), "bridge", "--http-address", "127.0.0.1:0", "--grpc-address", "127.0.0.1:0", *args]
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=self._log,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.ready: dict[str, Any] | None = None
        self.stopped: dict[str, Any] | None = None
        self._got_ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._got_ready.wait(start_timeout_s) or self.ready is None:
            self.kill()
            raise RuntimeError(f"bridge did not start: {self.log()[-3000:]}")
        self.http = self.ready["http"]
        self.grpc = self.ready["grpc"]
        self.prometheus = self.ready["prometheus"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if line.startswith('{"event": "ready"'):
                self.ready = json.loads(line)
                self._got_ready.set()
            elif line.startswith('{"event": "stopped"'):
                self.stopped = json.loads(line)
        self._got_ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def terminate(self, timeout_s: float = 180.0) -> int:
        """SIGTERM, wait for the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(10)
        self._close()
        return code

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self._reader.join(5)
        self._close()


def spec_json(message: Any) -> bytes:
    """An OTLP/JSON body per the specification, from a protobuf request: proto3 JSON with
    lowerCamelCase names and integer enums, trace/span ids as hex instead of base64."""
    from google.protobuf import json_format

    obj = json_format.MessageToDict(message, use_integers_for_enums=True)
    stack: list[Any] = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            for k, v in cur.items():
                if k in _ID_KEYS and isinstance(v, str):
                    cur[k] = base64.b64decode(v).hex()
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(cur, list):
            stack.extend(cur)
    return json.dumps(obj).encode()


def official_json_encoder() -> tuple[Any, Any] | None:
    """(encode_spans, encode_metrics) of opentelemetry-exporter-otlp-json-common, when installed."""
    try:
        from opentelemetry.exporter.otlp.json.common.metrics_encoder import encode_metrics
        from opentelemetry.exporter.otlp.json.common.trace_encoder import encode_spans
    except ImportError:
        return None
    return encode_spans, encode_metrics
