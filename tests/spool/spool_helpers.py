"""Shared by the spool crash tests, and imported by their subprocesses (trainer, `otel-rl replay`) as
``spool_helpers`` (``PYTHONPATH=tests/spool``): a non-idempotent sink exporter, a real `mlflow server`,
process helpers, and a reader of what a spool directory holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import otel_rl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
from _mlflow_server import VENV_BIN, MlflowServer, free_port  # noqa: E402,F401  (tests/ is on sys.path)

OTEL_RL = VENV_BIN / "otel-rl"


class AppendLogExporter(otel_rl.Exporter):
    """Appends one JSON line per record to ``$SPOOL_TEST_SINK`` (O_APPEND: a batch delivered twice shows
    up twice, unlike MLflow, which deduplicates equal metric points).  Fails (ConnectionError) while
    ``$SPOOL_TEST_SINK.down`` exists.  Spooled (``spool = True``), rebuilt by ``otel-rl replay`` by class."""

    spool = True
    wants_trajectories = True

    def __init__(self, config: Any = None):
        self.name = "appendlog"
        self.path = os.environ["SPOOL_TEST_SINK"]

    def export_records(self, records: Any) -> None:
        if os.path.exists(self.path + ".down"):
            raise ConnectionError("sink down")
        lines = "".join(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "kind": type(r).__name__,
                    "run_id": r.run.run_id,
                    "step": getattr(r, "step", None),
                    "trace_id": getattr(r, "trace_id", None),
                }
            )
            + "\n"
            for r in records
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)


class GatheringAppendLog(AppendLogExporter):
    """`AppendLogExporter` whose queue gathers, as a tracker's: each line also names the call it came in
    (``"call"``), so a test counts the deliveries."""

    gathers = True

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.name = "gathering-appendlog"
        self._calls = 0

    def export_records(self, records: Any) -> None:
        if os.path.exists(self.path + ".down"):
            raise ConnectionError("sink down")
        self._calls += 1
        call = f"{os.getpid()}-{self._calls}"
        lines = "".join(json.dumps({"call": call, "step": getattr(r, "step", None)}) + "\n" for r in records)
        with open(self.path, "a") as f:
            f.write(lines)


#: the span `RejectingAppendLog` refuses
BAD_SPAN = "bad-span"


class RejectingAppendLog(AppendLogExporter):
    """`AppendLogExporter` whose sink refuses one record: a call holding the record at step
    ``$SPOOL_TEST_BAD_STEP`` (or the span named `BAD_SPAN`) fails with a ValueError, a data error, every
    time; it does not find the bad record itself, as a tracker exporter would: its queue has to.  Spans are
    appended as ``{"span": name}`` lines.  With ``$SPOOL_TEST_CRASH_MID_SPLIT`` set, the process exits
    (``os._exit(9)``, as a SIGKILL would end it) right after the first call that went through after a
    refused one: in the middle of a batch delivered in parts."""

    gathers = True
    wants_spans = True

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.name = "rejecting"
        self.bad_step = int(os.environ.get("SPOOL_TEST_BAD_STEP", "-1"))
        self.refused = 0

    def _check(self, bad: bool, what: str) -> None:
        if os.path.exists(self.path + ".down"):
            raise ConnectionError("sink down")
        if bad:
            self.refused += 1
            raise ValueError(f"the sink cannot store {what}")

    def _went_through(self) -> None:
        if self.refused and os.environ.get("SPOOL_TEST_CRASH_MID_SPLIT"):
            os._exit(9)

    def export_records(self, records: Any) -> None:
        self._check(any(getattr(r, "step", None) == self.bad_step for r in records), f"step {self.bad_step}")
        super().export_records(records)
        self._went_through()

    def export_spans(self, spans: Any) -> None:
        self._check(any(s.name == BAD_SPAN for s in spans), f"span {BAD_SPAN}")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, "".join(json.dumps({"span": s.name}) + "\n" for s in spans).encode())
        finally:
            os.close(fd)
        self._went_through()


def read_sink(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def spool_contents(path: Path) -> list[Any]:
    """The records still waiting in one exporter's spool directory (read-only; the owner must be gone)."""
    from otel_rl.spool.codec import decode_batch
    from otel_rl.spool.store import Spool, SpoolOptions

    sp = Spool(SpoolOptions(path=str(path), exact=True))
    if not sp.open(create=False):
        return []
    try:
        out: list[Any] = []
        for frame in sp.iter_pending():
            out.extend(decode_batch(frame.payload)[1])
        return out
    finally:
        sp.close(remove_if_empty=False)


def wait_for(cond, timeout_s: float = 30.0) -> bool:
    """Polls `cond` every 10 ms until it is true (True) or `timeout_s` passes (its last value)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def clean_env(**extra: str) -> dict[str, str]:
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
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            # this tree's core and its own plug-ins (not the installed ones, which may be another checkout's)
            "PYTHONPATH": os.pathsep.join(
                (
                    str(HERE),
                    str(HERE.parent),
                    str(ROOT),
                    *(str(p) for p in sorted((ROOT / "exporters").iterdir()) if p.is_dir()),
                )
            ),
        }
    )
    env.update(extra)
    return env


class LineProcess:
    """A subprocess in its own process group whose stdout lines are collected (JSON events parsed)."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, name: str):
        self.log_path = cwd / f"{name}.stderr"
        self._err = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=self._err, start_new_session=True
        )
        self.events: list[dict] = []
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._cond:
                self.lines.append(line)
                if line.startswith("{"):
                    try:
                        self.events.append(json.loads(line))
                    except ValueError:
                        pass
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_event(self, pred: Any, timeout_s: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"event not seen; stderr:\n{self.stderr()[-4000:]}\nstdout:\n" + "\n".join(self.lines[-30:])
                    )
                self._cond.wait(min(left, 0.5))

    def stderr(self) -> str:
        self._err.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self._reader.join(10)

    def wait(self, timeout_s: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._reader.join(10)


def run_replay(args: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 300.0) -> tuple[int, str]:
    proc = subprocess.run(
        [str(OTEL_RL), "replay", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )
    return proc.returncode, proc.stdout + proc.stderr


def scan_spool_files(path: Path) -> list[Any]:
    """Records in the segment files of a spool another live process owns (no lock, no ack: a snapshot
    of everything written so far; a frame being written is not complete yet and is left out)."""
    from otel_rl.spool.codec import decode_batch
    from otel_rl.spool.files import FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES, frame_at

    out: list[Any] = []
    for seg in sorted(path.glob("*.seg")):
        try:
            data = seg.read_bytes()
        except FileNotFoundError:
            continue
        pos = SEGMENT_HEADER_BYTES
        while pos < len(data):
            n = frame_at(data, pos, len(data))
            if n < 0:
                break
            out.extend(decode_batch(data[pos + FRAME_HEADER_BYTES : pos + FRAME_HEADER_BYTES + n])[1])
            pos += FRAME_HEADER_BYTES + n
    return out
