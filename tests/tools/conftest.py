"""Real broken setups for `otel-rl doctor`: dead and blackholed ports, a refusing proxy, size-limited and
read-only mounts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def dead_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def blackhole():
    """A listening socket that never accepts nor answers: connections complete in the kernel, then silence."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


class RefusingProxy:
    """An HTTP proxy that answers every request (CONNECT or absolute URI) with 403 and records what it was asked."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                c.settimeout(2)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = c.recv(4096)
                        if not chunk:
                            break
                        data += chunk
                    self.requests.append(data.split(b"\r\n", 1)[0].decode())
                    c.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def refusing_proxy():
    p = RefusingProxy()
    yield p
    p.close()


def _mount(args: list[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited or read-only filesystem needs root")
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def full_fs(tmp_path: Path):
    """A 1 MiB tmpfs filled to the last byte."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)])
    try:
        with open(mnt / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def readonly_dir(tmp_path: Path):
    """A directory bind-mounted read-only onto itself (read-only even for root)."""
    d = tmp_path / "ro"
    d.mkdir()
    _mount(["--bind", "-o", "ro", str(d), str(d)])
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without tracker/OTel settings or proxies from outside, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "WANDB_", "SWANLAB_", "MLFLOW_", "VERL_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    env.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})
    env.update(extra)
    return env


# ----------------------------------------------------------------------------- a real MLflow store

STEPS, SAMPLES = 12, 3
FAILED = {(3, 1), (8, 0), (12, 2)}  # (step, sample) whose trajectory raises
VALIDATION_STEPS = (4, 8, 12)
PROJECT = "prune-store"
# the sqlite tables that hold a trace's rows: none may keep a row of a deleted trace
TRACE_TABLES = ("trace_info", "spans", "trace_tags", "trace_request_metadata", "trace_metrics", "span_metrics",
                "assessments")


def _workload() -> None:
    import otel_rl

    for n in range(1, STEPS + 1):
        with otel_rl.step(n):
            for i in range(SAMPLES):
                try:
                    with otel_rl.trajectory(sample_index=i, rollout_n=0) as t:
                        if (n, i) in FAILED:
                            raise RuntimeError(f"tool crashed at step {n}")
                        t.set_reward(i / 2)
                except RuntimeError:
                    pass
            if n in VALIDATION_STEPS:
                for i in range(2):
                    with otel_rl.trajectory(sample_index=i, rollout_n=0, validate=True) as t:
                        t.set_reward(1.0)
            otel_rl.log({"critic/score/mean": n / STEPS}, step=n)


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    """One real MLflow sqlite store written by the mlflow exporter; each test prunes a copy."""
    import otel_rl

    root = tmp_path_factory.mktemp("prune-store")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    mp.setenv("OTEL_RL_MLFLOW_ARTIFACT_LOCATION", str(root / "artifacts"))
    mp.chdir(root)
    try:
        h = otel_rl.init(project=PROJECT, experiment="grpo", exporters=["mlflow"], trace_backend="mlflow",
                         spool_dir="off", export_process="false", batch_delay_s=0.05)
        _workload()
        assert h.flush(120)
        h.shutdown()
    finally:
        mp.undo()
    return root / "mlflow.db"
