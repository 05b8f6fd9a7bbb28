"""A real `mlflow server` for tests (sqlite backend, served artifacts), SIGKILL-able and restartable
on the same port. Shared by the tracker, spool, bridge and doctor tests; `bin_dir` runs another venv's MLflow
(an older server, built by `scripts/bootstrap.sh --test` under `.cache/`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """The environment without tracker/OTel settings or proxies from outside."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "MLFLOW_", "WANDB_", "SWANLAB_", "VERL_"))
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env.update(
        {
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            "NO_PROXY": "127.0.0.1,localhost",
            # no job runner (GenAI evaluation jobs, which these tests do not use): its task queues would be
            # left in a new directory under /dev/shm by every server the tests kill
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
    )
    return env


class MlflowServer:
    def __init__(
        self,
        root: Path,
        workers: int = 1,
        backend: str | None = None,
        env: dict[str, str] | None = None,
        bin_dir: Path = VENV_BIN,
    ):
        self.root = root
        self.bin_dir = bin_dir
        self.workers = workers
        self.backend = backend or f"sqlite:///{root}/server.db"
        self.env = {**server_env(), **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = root / "server.log"

    def start(self, timeout_s: float = 180.0) -> None:
        cmd = [
            str(self.bin_dir / "mlflow"),
            "server",
            "--backend-store-uri",
            self.backend,
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.workers),
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=self.env,
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"mlflow server did not answer /health: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the server and its workers (its own process group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.proc = None
