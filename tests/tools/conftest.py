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
