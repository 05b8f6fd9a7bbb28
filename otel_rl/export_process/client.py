"""The training process's end of the export process: starts it, feeds it, takes its exporters back if it dies."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._batch import ExporterStats
from .._console import ConsoleTee
from .._memory import RELEASE_BYTES, release_memory
from .._values import warn_once
from ..exporters.base import Exporter
from ..records import Trajectory
from .backlog import backlog_for
from .frames import read_frame, write_frame
from .ostune import wait_exit
from .protocol import (
    IN_EXPORT_PROCESS,
    Batch,
    Console,
    Done,
    Flush,
    Flushed,
    Hello,
    Ready,
    Routing,
    Shipment,
    Stats,
    Stop,
    Stopped,
    Tokenizer,
)

_log = logging.getLogger("otel_rl")
#: the child's shutdown budget is the trainer's less this (or a tenth of it): time to say it is done
STOP_MARGIN_S = 0.5

# Ctrl-C and SIGTERM are the trainer's to handle (a job scheduler may send them to every process of the job): it
# stops the export process in order, after its last batches.  Set first thing, before the imports (`server.main`
# again)
CHILD = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, lambda s, f: None); "
    "from otel_rl.export_process.server import main; sys.exit(main(sys.argv[1:]))"
)


class _OnDisk:
    """A batch in `_out` whose payload waits in the backlog file."""

    __slots__ = ("ref", "seq")

    def __init__(self, seq: int, ref: tuple[int, int]) -> None:
        self.seq = seq
        self.ref = ref


class RemoteExporter(Exporter):
    """Stands for an exporter running in the export process (what `Handle.exporters` lists)."""

    remote = True

    def __init__(self, name: str, cls: type, wants_trajectories: bool, client: ExportProcessClient):
        self.name = name
        self.exporter_class = cls
        self.tracker_name = getattr(cls, "tracker_name", name)
        self._wants_trajectories = wants_trajectories
        self._client = client

    @property
    def wants_trajectories(self) -> bool:
        return self._wants_trajectories

    @wants_trajectories.setter
    def wants_trajectories(self, value: bool) -> None:
        value = bool(value)
        if value != self._wants_trajectories:
            self._wants_trajectories = value
            self._client.control(Routing(self.name, value))

    def __repr__(self) -> str:
        return f"<{self.exporter_class.__name__} {self.name!r} in the export process>"


class RemoteQueue:
    """The pipeline's view of one exporter in the export process (stats, flush, stop)."""

    remote = True
    adopted = False
    spool = None

    def __init__(self, exporter: RemoteExporter, client: ExportProcessClient):
        self.exporter = exporter
        self.name = exporter.name
        self.stats = ExporterStats()
        self._client = client

    def put(self, spans: list, records: list) -> bool:
        self._client.send(records, (self.name,))
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        return self._client.flush(timeout_s)

    def request_stop(self) -> None:
        self._client.request_stop()

    def join(self, timeout_s: float) -> None:
        self._client.join(timeout_s)

    def stop(self, timeout_s: float) -> None:
        self.request_stop()
        self.join(timeout_s)


class ExportProcessClient:
    """Starts the export process and feeds it (one sender and one reader thread)."""

    def __init__(
        self,
        config: Any,
        exporters: Sequence[tuple[str, type, bool]],
        on_death: Callable[[ExportProcessClient, list], None] | None = None,
    ):
        self.config = config
        self.exporters = [RemoteExporter(n, cls, wt, self) for n, cls, wt in exporters]
        self.queues = [RemoteQueue(e, self) for e in self.exporters]
        self._by_name = {q.name: q for q in self.queues}
        self.names = tuple(q.name for q in self.queues)
        self._on_death = on_death
        self._cond = threading.Condition()
        self._out: deque = deque()
        self._seq = 0  # batches handed to send()
        self._flushed = 0  # the child confirmed delivery of every batch up to here
        self._settled = 0  # the child delivered or spooled every batch up to here
        # (seq, items, pickled Shipment): delivered again if the child dies
        self._unsettled: deque = deque()
        self._unsettled_items = 0
        self._unsettled_bytes = 0
        self._max_unsettled = max(1000, int(getattr(config, "queue_size", 100_000)))
        # (queue_max_bytes: with the tracker stalled, the child spools what it cannot hold and settles it;
        # copies beyond this are forgotten oldest first all the same)
        self._max_unsettled_bytes = max(1 << 20, int(getattr(config, "queue_max_bytes", 32 << 20) or 32 << 20))
        self._released = 0  # bytes of copies forgotten since memory was last given back to the system
        self._out_bytes = 0  # of the batches waiting in `_out` in memory
        self._backlog = backlog_for(config)  # where batches beyond the budget wait instead (None: memory)
        self._stop_sent = False
        self._stopped = threading.Event()
        self._done = threading.Event()  # its exit hooks have run (`Done`), or it has ended
        self.alive = True
        self._adopted = threading.Event()
        self.fallback: Callable[..., None] | None = None  # (records, names, wire, resource_attrs) after a takeover
        self.dropped = 0
        self.outcome: Any = None  # how the training process ends (otel_rl._exit.Outcome), sent with `Stop`
        self._handlers: dict[type, Callable[[Any], None]] = {
            Stats: self._on_stats,
            Flushed: self._on_flushed,
            Ready: self._on_ready,
            Stopped: self._on_stopped,
            Done: self._on_done,
        }
        r_in, w_in = os.pipe()  # trainer -> child
        r_out, w_out = os.pipe()  # child -> trainer
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env[IN_EXPORT_PROCESS] = "1"
        try:
            # in a session of its own: Ctrl-C in a terminal, or a signal to the trainer's process group, is the
            # trainer's to handle (it stops this process in order, after its last batches; a trainer that dies
            # closes the pipe, and this process delivers what it has and ends)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(r_in), str(w_out)],
                pass_fds=(r_in, w_out),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(r_in)
            os.close(w_out)
        self._w = os.fdopen(w_in, "wb", buffering=1 << 16)
        self._r = os.fdopen(r_out, "rb", buffering=1 << 16)
        # this process's console, for the tracker runs there that record one (`otel_rl._console`)
        self.console: ConsoleTee | None = None
        self._console_lost = 0
        if getattr(config, "forward_console", True) and any(
            getattr(e.exporter_class, "captures_console", False) for e in self.exporters
        ):
            self.console = ConsoleTee()
            self.console.install()
        self._out.append(
            Hello(
                config, [(e.name, e.wants_trajectories) for e in self.exporters], getattr(config, "queue_size", 100_000)
            )
        )
        self._sender = threading.Thread(target=self._send_loop, name="otel-rl-export-process-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="otel-rl-export-process-read", daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    # -- feeding -------------------------------------------------------------------------
    def wants_trajectories(self) -> bool:
        return any(e.wants_trajectories for e in self.exporters)

    def send(
        self, records: list, names: Sequence[str], wire: list | None = None, resource_attrs: dict | None = None
    ) -> None:
        """Hand `records`, and the packed spans `wire` (`otel_rl._wire`) of which the export process
        builds the trajectories, to its exporters `names`.  Never blocks on it."""
        if not any(self._by_name[n].exporter.wants_trajectories for n in names if n in self._by_name):
            records = [r for r in records if not isinstance(r, Trajectory)]
            wire = None
        if not records and not wire:
            return
        n_items = len(records) + (len(wire) if wire else 0)
        # Pickled here, once: what is sent, and what is kept for re-delivery until the child settles it.
        # The batch's lists and tuples then die at once instead of living, tracked by the cyclic GC,
        # for as long as the child takes to deliver it (its collections would scan them again and again).
        payload = None
        if self.alive:  # (once the child is gone, the batch goes to its in-process takeover as it is)
            try:
                payload = pickle.dumps(
                    Shipment(records, tuple(names), wire, resource_attrs), protocol=pickle.HIGHEST_PROTOCOL
                )
            except Exception as exc:  # not expected: records and packed spans are plain data
                _log.error(
                    "otel-rl: a batch for the export process could not be pickled (%s); %d items dropped", exc, n_items
                )
                self.dropped += n_items
                return
        with self._cond:
            if self.alive and payload is not None:
                self._seq += 1
                keep: Any = payload
                if self._backlog is not None and self._out_bytes + len(payload) > self._max_unsettled_bytes:
                    try:  # the export process is behind: the batch waits on disk, not in this process
                        keep = self._backlog.put(payload)
                    except OSError:
                        keep = payload
                if keep is payload:
                    self._out.append(Batch(self._seq, payload))
                    self._out_bytes += len(payload)
                else:
                    self._out.append(_OnDisk(self._seq, keep))
                size = len(payload) if keep is payload else 0
                self._unsettled.append((self._seq, n_items, keep, size))
                self._unsettled_items += n_items
                self._unsettled_bytes += size
                while (
                    self._unsettled_items > self._max_unsettled or self._unsettled_bytes > self._max_unsettled_bytes
                ) and len(self._unsettled) > 1:
                    # the oldest batch stays queued in the child; it only loses its re-delivery copy
                    self._forget(self._unsettled.popleft())
                self._cond.notify_all()
                return
        self._adopted.wait(30.0)
        fb = self.fallback
        if fb is not None:
            fb(records, names, wire, resource_attrs)
        else:
            self.dropped += n_items

    def ship_console(self) -> None:
        """Hand what this process wrote to its console since the last call to the export process (the
        pipeline's worker calls it after each batch; also `flush` and `request_stop`)."""
        tee = self.console
        if tee is None:
            return
        chunks = tee.take()
        lost = tee.lost_chars - self._console_lost
        if lost > 0:
            self._console_lost = tee.lost_chars
            chunks.append(
                (
                    "stderr",
                    f"otel-rl: {lost} characters of the console output are missing here (more than "
                    f"{tee.max_chars} were waiting to be forwarded to the tracker runs)\n",
                )
            )
        if chunks:
            self.control(Console(chunks))

    def _stop_console(self) -> None:
        if self.console is not None:
            self.console.uninstall()
            self.ship_console()

    def send_tokenizer(self, key: int, blob: bytes) -> None:
        """token2text: a pickled tokenizer, which the packed spans sent after this name by `key`."""
        self.control(Tokenizer(key, blob))

    def control(self, msg: Any) -> None:
        """Send `msg` (a `protocol` message) after what is queued, unless the child is gone."""
        with self._cond:
            if self.alive:
                self._out.append(msg)
                self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """True once the child has delivered everything sent before this call."""
        deadline = time.monotonic() + timeout_s
        self.ship_console()
        with self._cond:
            target = self._seq
            if self.alive and self._flushed >= target:
                return True
            if self.alive:
                self._out.append(Flush(target, max(0.0, timeout_s)))
                self._cond.notify_all()
            while self.alive and self._flushed < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if self._flushed >= target:
                return True
        # the child died: its exporters are being taken over in-process; the pipeline's flush
        # then waits for the queues that took them (Pipeline.flush re-reads its queue list)
        return self._adopted.wait(max(0.0, deadline - time.monotonic()))

    def request_stop(self, timeout_s: float | None = None) -> None:
        self._stop_console()  # the tracker runs are about to finish: what is printed later stays here
        with self._cond:
            if self._stop_sent or not self.alive:
                return
            self._stop_sent = True
            budget = timeout_s if timeout_s is not None else float(getattr(self.config, "shutdown_timeout_s", 10.0))
            # its own budget a little shorter than the trainer's wait for it: what it could not deliver is
            # in its spools, and it says so, before the trainer stops waiting
            budget = max(0.0, budget - min(STOP_MARGIN_S, budget / 10))
            o = self.outcome
            self._out.append(Stop(budget, None if o is None else (o.state, o.text, o.exit_code)))
            self._cond.notify_all()

    def join(self, timeout_s: float) -> None:
        """Wait for the child to finish (its tracker runs closed), then for its exit hooks (`Done`, or the end
        of the process), up to `timeout_s` in all (the shutdown budget).  The process's end itself (the
        kernel's teardown of it) is not waited for: the reader thread reaps it."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._stop_sent:
            self.request_stop(timeout_s)
        stopped = self._stopped.wait(max(0.0, deadline - time.monotonic()))
        if not self._done.wait(max(0.5 if stopped else 0.0, deadline - time.monotonic())):
            _log.warning(
                "otel-rl: the export process (pid %d) is still finishing its tracker runs; "
                "it exits on its own when done",
                self.proc.pid,
            )
        self._sender.join(1.0)

    # -- threads ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        # one message at a time, left in `_out` until written: what the pipe has not taken yet stays
        # counted against the budget (and a batch waiting on disk is read back only now)
        while True:
            with self._cond:
                while not self._out and self.alive:
                    self._cond.wait()
                if not self.alive:
                    return
                m = self._out[0]
            try:
                if type(m) is _OnDisk:
                    with self._cond:
                        payload = self._copy(m.ref)
                    write_frame(self._w, Batch(m.seq, payload))
                else:
                    write_frame(self._w, m)
                if type(m) is Stop:
                    self._w.close()
                    return
            except (OSError, ValueError):
                return  # the reader sees the child end and takes over
            with self._cond:
                self._out.popleft()
                if type(m) is Batch:
                    self._out_bytes -= len(m.payload)
                elif type(m) is _OnDisk and self._backlog is not None:
                    self._backlog.done(m.ref)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = read_frame(self._r)
                if msg is None:
                    break
                self._handle(msg)
        except Exception as exc:  # a torn frame: the child is gone or broken
            _log.error("otel-rl: export process pipe error: %s", exc)
        finally:
            self._ended()

    def _handle(self, msg: Any) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            warn_once(
                f"export-process-message:{type(msg).__name__}",
                "otel-rl: the export process sent an unknown message (%s); ignored",
                type(msg).__name__,
            )
            return
        handler(msg)

    def _on_stats(self, msg: Stats) -> None:
        self._apply_stats(msg.stats)
        self._settle(msg.settled)

    def _on_flushed(self, msg: Flushed) -> None:
        self._apply_stats(msg.stats)
        with self._cond:
            if msg.ok:
                self._flushed = max(self._flushed, msg.seq)
            self._cond.notify_all()
        self._settle(msg.settled)

    def _on_ready(self, msg: Ready) -> None:
        for name, err in msg.errors.items():
            if err:
                _log.error("otel-rl: exporter %r could not start in the export process: %s", name, err)

    def _on_stopped(self, msg: Stopped) -> None:
        self._apply_stats(msg.stats)
        with self._cond:
            self._flushed = self._seq
        self._settle(self._seq)
        self._stopped.set()

    def _on_done(self, msg: Done) -> None:
        self._done.set()

    def _apply_stats(self, stats: dict) -> None:
        for name, d in stats.items():
            q = self._by_name.get(name)
            if q is not None:
                for k, v in d.items():
                    setattr(q.stats, k, v)

    def _settle(self, seq: int) -> None:
        with self._cond:
            self._settled = max(self._settled, seq)
            while self._unsettled and self._unsettled[0][0] <= self._settled:
                old = self._unsettled.popleft()
                self._forget(old)
                self._released += old[3]
            release = self._released >= RELEASE_BYTES and not self._unsettled
            if release:
                self._released = 0
        if release:  # a backlog settled (a tracker that was stalled): its memory back to the system
            release_memory()

    def _forget(self, old: tuple) -> None:
        """A re-delivery copy let go.  Under _cond."""
        self._unsettled_items -= old[1]
        self._unsettled_bytes -= old[3]
        if self._backlog is not None and type(old[2]) is tuple:
            self._backlog.done(old[2])

    def _copy(self, keep: Any) -> bytes:
        return keep if type(keep) is not tuple or self._backlog is None else self._backlog.get(keep)

    def _ended(self) -> None:
        if self.console is not None:
            self.console.uninstall()  # exporters taken over in this process capture its console themselves
        with self._cond:
            self.alive = False
            stopped = self._stopped.is_set()
            left = [(seq, pickle.loads(self._copy(keep))) for seq, _, keep, _ in self._unsettled]
            self._unsettled.clear()
            self._unsettled_items = 0
            self._unsettled_bytes = 0
            self._cond.notify_all()
        try:
            wait_exit(self.proc, 5.0)
        except subprocess.TimeoutExpired:
            pass
        self._done.set()
        if stopped:
            self._adopted.set()
            return
        code = self.proc.returncode
        _log.error(
            "otel-rl: the export process ended unexpectedly (exit code %s); its exporters (%s) continue "
            "in the training process, %d batches not confirmed by it are delivered again",
            code,
            ", ".join(self.names),
            len(left),
        )
        try:
            if self._on_death is not None:
                self._on_death(self, left)
        except Exception:
            _log.exception("otel-rl: could not restart the export process's exporters in the training process")
        finally:
            self._adopted.set()
            self._stopped.set()


# ----------------------------------------------------------------------------- child side
