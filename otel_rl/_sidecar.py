"""The export process: tracker exporters run in a child process of the trainer.

Tracker libraries are heavy Python (MLflow's store writes, wandb's and SwanLab's
run bookkeeping).  In the training process they compete with the training loop
for the GIL even on their own threads; in a child process they run on another
core and the training process only pays for handing records over (a pickle and
a pipe write, on the pipeline's threads).  ``export_process`` (docs/configuration.md):

- ``auto`` (default) / ``true``: the tracker exporters named in the config (MLflow,
  WandB, SwanLab, Weave, any `TrackerExporter` that does not opt out) run in one
  export process; console, file, OTLP, Prometheus and exporter *instances* given
  to `init()` stay in the training process;
- ``false``: everything in the training process.

Protocol (two pipes; frames are a 4-byte little-endian length and a pickle):

    trainer -> child   ("hello", config, [(name, wants_trajectories)], queue_size)
                       ("batch", seq, pickle of (records, names, wire, resource attributes))
                                                          records (and packed spans) for these exporters
                       ("flush", seq, timeout_s)          reply when all up to seq is delivered
                       ("routing", name, wants_trajectories)
                       ("stop", timeout_s, failure)       deliver, finish the tracker runs, exit
                                                          (failure: None, or the trainer's uncaught
                                                          exception as (state, traceback text))
    child -> trainer   ("ready", {name: error or None})
                       ("stats", {name: stats}, settled_seq)   about twice a second
                       ("flushed", seq, ok, {name: stats})
                       ("stopped", {name: stats})         every tracker run finished
                       ("done",)                          the exit hooks have run too; the child ends
                                                          right after (its end is not waited for)

Each exporter has the same `DeliveryQueue` in the child as it would have in the
trainer: retries with backoff, spool on disk when the tracker fails or falls
behind, replay at the next start.  The child ignores SIGINT (a Ctrl-C in the
terminal reaches the whole process group; the trainer stops it in order) and,
when the trainer disappears (EOF on its pipe, e.g. the trainer was killed), it
delivers what it holds and exits.  If the child dies, the trainer takes the
exporters back in-process and re-delivers the batches the child had not yet
settled (delivered or written to its spool): at least once, never silently lost.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ._console import ConsoleTee
from ._exit import Outcome, quick_exit, tell_outcome
from ._pipeline import DeliveryQueue, ExporterStats, wait_all_idle
from .export_process.receiver import Receiver
from ._values import warn_once
from .exporters.base import Exporter
from .records import Trajectory

_log = logging.getLogger("otel_rl")
_HDR = struct.Struct("<I")
_STATS_INTERVAL_S = 0.5
#: the export process starts its trackers at the training process's priority, without the cyclic GC, until
#: their runs are open (at most this long); then it settles: the idle class, its niceness, the GC back on
_START_S = 60.0
#: how often it looks whether its runs are open, while it starts
_START_LOOK_S = 0.1
#: set in the export process's environment: an `init()` there keeps every exporter in-process
IN_EXPORT_PROCESS = "OTEL_RL_IN_EXPORT_PROCESS"
#: the child's shutdown budget is the trainer's less this (or a tenth of it): time to say it is done
STOP_MARGIN_S = 0.5


# Ctrl-C and SIGTERM are the trainer's to handle (a job scheduler may send them to every process of the job): it
# stops this process in order, after its last batches.  Set first thing, before the imports (`main` again)
_CHILD = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
          "signal.signal(signal.SIGTERM, lambda s, f: None); "
          "from otel_rl._sidecar import main; sys.exit(main(sys.argv[1:]))")


def _mark_absent(names: Sequence[str]) -> None:
    """In the export process: a module of `names` that is not installed is entered in ``sys.modules`` as
    None, which makes every later ``import`` of it fail at once (as it would after the search)."""
    import importlib.util

    for name in names:
        if name in sys.modules:
            continue
        try:
            missing = importlib.util.find_spec(name) is None
        except (ImportError, ValueError):
            missing = False
        if missing:
            sys.modules[name] = None  # type: ignore[assignment]


def _set_cpus(spec: str | None) -> None:
    """export_process_cpus: keep the export process (and the threads and processes it starts: the
    exporters', wandb's service) on these CPUs, off the ones the training thread runs on.  Where
    both share a core, the export process runs there whenever the trainer waits a moment (the idle
    class does not prevent that), and the trainer finds that core's caches filled with the export
    process's data.  ``last``: the highest CPU this process may use, when it may use two or more."""
    if not spec or not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = os.sched_getaffinity(0)
        if spec == "last":
            if len(allowed) < 2:
                return
            cpus = {max(allowed)}
        else:
            from .config import parse_cpu_list

            cpus = parse_cpu_list(spec) & allowed
            if not cpus:
                _log.warning("otel-rl: export_process_cpus=%s: none of these CPUs is available (%s); not set",
                             spec, sorted(allowed))
                return
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:  # every thread there is now; later ones inherit it
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:
                pass
    except (OSError, ValueError) as exc:
        _log.warning("otel-rl: export_process_cpus=%s could not be applied (%s)", spec, exc)


def _process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (the processes the trackers start, and theirs)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pid]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, ()))
    return tree


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def lower_priority(config: Any, base_nice: int) -> None:
    """This process, every thread of it and every process it has started (wandb's service) at the export
    process's niceness (`export_process_nice` more than `base_nice`, the training process's) and in the idle
    scheduling class (`export_process_idle`).  What starts later inherits both."""
    nice = int(getattr(config, "export_process_nice", 0) or 0)
    target = min(19, base_nice + nice) if nice > 0 and hasattr(os, "setpriority") else None
    # the idle class: a CPU that runs only this process counts as free for the trainer's threads, which then
    # never queue behind it
    idle = bool(getattr(config, "export_process_idle", False)) and hasattr(os, "SCHED_IDLE")
    if target is None and not idle:
        return
    for pid in _process_tree(os.getpid()):
        for tid in _threads(pid):
            try:
                if target is not None and os.getpriority(os.PRIO_PROCESS, tid) < target:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
                if idle and os.sched_getscheduler(tid) != os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # ended meanwhile, or not ours to change
                pass


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> int:
    """`proc.wait(timeout_s)`, woken by the process's exit itself where Linux offers a pidfd: with a
    timeout, Popen.wait polls, sleeping up to 50 ms between looks (time that shutdown would wait for
    nothing).  Raises subprocess.TimeoutExpired as Popen.wait does."""
    if proc.returncode is None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # already reaped, or no pidfd here: Popen.wait knows
            pass
        else:
            try:
                # (reaped meanwhile by the other thread that waits, the pid might even be another
                # process's by now: poll() knows, and then nothing is waited for)
                if proc.poll() is None:
                    select.select([fd], [], [], max(0.0, timeout_s))
            except (OSError, ValueError):
                pass
            finally:
                os.close(fd)
    return proc.wait(timeout_s)


def _write(f: Any, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HDR.pack(len(data)))
    f.write(data)
    f.flush()


def _read(f: Any) -> Any:
    hdr = f.read(4)
    if len(hdr) < 4:
        return None
    (n,) = _HDR.unpack(hdr)
    data = f.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


# ----------------------------------------------------------------------------- trainer side

class RemoteExporter(Exporter):
    """Stands for an exporter running in the export process (what `Handle.exporters` lists)."""

    remote = True

    def __init__(self, name: str, cls: type, wants_trajectories: bool, client: SidecarClient):
        self.name = name
        self.exporter_class = cls
        self.tracker_name = getattr(cls, "tracker_name", name)
        self._wants_trajectories = wants_trajectories
        self._client = client

    @property
    def wants_trajectories(self) -> bool:  # type: ignore[override]
        return self._wants_trajectories

    @wants_trajectories.setter
    def wants_trajectories(self, value: bool) -> None:
        value = bool(value)
        if value != self._wants_trajectories:
            self._wants_trajectories = value
            self._client.control(("routing", self.name, value))

    def __repr__(self) -> str:
        return f"<{self.exporter_class.__name__} {self.name!r} in the export process>"


class RemoteQueue:
    """The pipeline's view of one exporter in the export process (stats, flush, stop)."""

    remote = True
    adopted = False
    spool = None

    def __init__(self, exporter: RemoteExporter, client: SidecarClient):
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


class SidecarClient:
    """Starts the export process and feeds it (one sender and one reader thread)."""

    def __init__(self, config: Any, exporters: Sequence[tuple[str, type, bool]],
                 on_death: Callable[[SidecarClient, list], None] | None = None):
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
        # (seq, items, pickled (records, names, wire, resource)): re-delivered if the child dies
        self._unsettled: deque = deque()
        self._unsettled_items = 0
        self._max_unsettled = max(1000, int(getattr(config, "queue_size", 100_000)))
        self._stop_sent = False
        self._stopped = threading.Event()
        self._done = threading.Event()  # its exit hooks have run ("done"), or it has ended
        self.alive = True
        self._adopted = threading.Event()
        self.fallback: Callable[[list, Sequence[str]], None] | None = None
        self.dropped = 0
        self.outcome: Any = None  # how the training process ends (otel_rl._exit.Outcome), sent with "stop"
        r_in, w_in = os.pipe()  # trainer -> child
        r_out, w_out = os.pipe()  # child -> trainer
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env[IN_EXPORT_PROCESS] = "1"
        try:
            # in a session of its own: Ctrl-C in a terminal, or a signal to the trainer's process group, is the
            # trainer's to handle (it stops this process in order, after its last batches; a trainer that dies
            # closes the pipe, and this process delivers what it has and ends)
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(r_in), str(w_out)],
                                         pass_fds=(r_in, w_out), env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            os.close(r_in)
            os.close(w_out)
        self._w = os.fdopen(w_in, "wb", buffering=1 << 16)
        self._r = os.fdopen(r_out, "rb", buffering=1 << 16)
        # this process's console, for the tracker runs there that record one (`otel_rl._console`)
        self.console: ConsoleTee | None = None
        self._console_lost = 0
        if getattr(config, "forward_console", True) and any(getattr(e.exporter_class, "captures_console", False)
                                                            for e in self.exporters):
            self.console = ConsoleTee()
            self.console.install()
        self._out.append(("hello", config, [(e.name, e.wants_trajectories) for e in self.exporters],
                          getattr(config, "queue_size", 100_000)))
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

    def send(self, records: list, names: Sequence[str], wire: list | None = None,
             resource_attrs: dict | None = None) -> None:
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
                payload = pickle.dumps((records, tuple(names), wire, resource_attrs),
                                       protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # not expected: records and packed spans are plain data
                _log.error("otel-rl: a batch for the export process could not be pickled (%s); %d items dropped",
                           exc, n_items)
                self.dropped += n_items
                return
        with self._cond:
            if self.alive and payload is not None:
                self._seq += 1
                self._out.append(("batch", self._seq, payload))
                self._unsettled.append((self._seq, n_items, payload))
                self._unsettled_items += n_items
                while self._unsettled_items > self._max_unsettled and len(self._unsettled) > 1:
                    # the oldest batch stays queued in the child; it only loses its re-delivery copy
                    old = self._unsettled.popleft()
                    self._unsettled_items -= old[1]
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
            chunks.append(("stderr", f"otel-rl: {lost} characters of the console output are missing here (more than "
                                     f"{tee.max_chars} were waiting to be forwarded to the tracker runs)\n"))
        if chunks:
            self.control(("console", chunks))

    def _stop_console(self) -> None:
        if self.console is not None:
            self.console.uninstall()
            self.ship_console()

    def control(self, msg: tuple) -> None:
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
                self._out.append(("flush", target, max(0.0, timeout_s)))
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
            self._out.append(("stop", budget, None if o is None else (o.state, o.text, o.exit_code)))
            self._cond.notify_all()

    def join(self, timeout_s: float) -> None:
        """Wait for the child to finish (its tracker runs closed), then for its exit hooks ("done", or the end
        of the process), up to `timeout_s` in all (the shutdown budget).  The process's end itself (the
        kernel's teardown of it) is not waited for: the reader thread reaps it."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        if not self._stop_sent:
            self.request_stop(timeout_s)
        stopped = self._stopped.wait(max(0.0, deadline - time.monotonic()))
        if not self._done.wait(max(0.5 if stopped else 0.0, deadline - time.monotonic())):
            _log.warning("otel-rl: the export process (pid %d) is still finishing its tracker runs; "
                         "it exits on its own when done", self.proc.pid)
        self._sender.join(1.0)

    # -- threads ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._out and self.alive:
                    self._cond.wait()
                if not self.alive:
                    return
                msgs = list(self._out)
                self._out.clear()
            try:
                for m in msgs:
                    _write(self._w, m)
                    if m[0] == "stop":
                        self._w.close()
                        return
            except (OSError, ValueError):
                return  # the reader sees the child end and takes over

    def _read_loop(self) -> None:
        try:
            while True:
                msg = _read(self._r)
                if msg is None:
                    break
                self._handle(msg)
        except Exception as exc:  # a torn frame: the child is gone or broken
            _log.error("otel-rl: export process pipe error: %s", exc)
        finally:
            self._ended()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "stats":
            self._apply_stats(msg[1])
            self._settle(msg[2])
        elif kind == "flushed":
            _, seq, ok, stats, settled = msg
            self._apply_stats(stats)
            with self._cond:
                if ok:
                    self._flushed = max(self._flushed, seq)
                self._cond.notify_all()
            self._settle(settled)
        elif kind == "ready":
            for name, err in msg[1].items():
                if err:
                    _log.error("otel-rl: exporter %r could not start in the export process: %s", name, err)
        elif kind == "stopped":
            self._apply_stats(msg[1])
            with self._cond:
                self._flushed = self._seq
            self._settle(self._seq)
            self._stopped.set()
        elif kind == "done":
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
                self._unsettled_items -= self._unsettled.popleft()[1]

    def _ended(self) -> None:
        if self.console is not None:
            self.console.uninstall()  # exporters taken over in this process capture its console themselves
        with self._cond:
            self.alive = False
            stopped = self._stopped.is_set()
            left = [(seq, *pickle.loads(payload)) for seq, _, payload in self._unsettled]
            self._unsettled.clear()
            self._unsettled_items = 0
            self._cond.notify_all()
        try:
            _wait_exit(self.proc, 5.0)
        except subprocess.TimeoutExpired:
            pass
        self._done.set()
        if stopped:
            self._adopted.set()
            return
        code = self.proc.returncode
        _log.error("otel-rl: the export process ended unexpectedly (exit code %s); its exporters (%s) continue "
                   "in the training process, %d batches not confirmed by it are delivered again",
                   code, ", ".join(self.names), len(left))
        try:
            if self._on_death is not None:
                self._on_death(self, left)
        except Exception:
            _log.exception("otel-rl: could not restart the export process's exporters in the training process")
        finally:
            self._adopted.set()
            self._stopped.set()


# ----------------------------------------------------------------------------- child side


class _Server:
    def __init__(self, r: Any, w: Any):
        self.r = r
        self.w = w
        self.wlock = threading.Lock()
        self.queues: dict[str, DeliveryQueue] = {}
        self.errors: dict[str, str] = {}
        self.received = 0  # highest batch seq put into the queues
        self.receiver = Receiver(self.queues, on_missing=self._missing)  # builds trajectories of packed spans
        self.stop_event = threading.Event()
        self._dropped_failed: dict[str, int] = {}
        self._start_by: float | None = None  # set while the trackers start (until `_settle`)
        self._settle_lock = threading.Lock()
        self._gc_off = False  # the cyclic GC is off while the trackers start
        self._held: list[DeliveryQueue] = []  # queues that do not gather while the trackers start
        self.config: Any = None
        self._base_nice = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
        self.training_pid = os.getppid()  # the training process started this one

    def send(self, msg: Any) -> None:
        with self.wlock:
            try:
                _write(self.w, msg)
            except (OSError, ValueError):
                pass  # the trainer is gone; keep delivering

    def stats(self) -> dict[str, dict]:
        out = {n: q.stats.as_dict() for n, q in self.queues.items()}
        for n in self.errors:
            out[n] = dict(ExporterStats().as_dict(), dropped=self._dropped_failed.get(n, 0))
        return out

    def settled(self) -> int:
        """The highest batch seq up to which everything received is delivered or spooled: each queue's
        oldest batch held only in memory holds back the ones from its own on (the training process keeps
        their copies to send again should this process die); so do spans held for a trajectory whose
        root has not come yet.  A queue that always has something in memory (one that gathers batches)
        thus still lets the training process forget what it has delivered."""
        seq = self.received
        for q in list(self.queues.values()):
            oldest = q.oldest_unsafe_seq()
            if oldest is not None:
                seq = min(seq, oldest - 1)
        held = self.receiver.held_since()
        if held is not None:
            seq = min(seq, held - 1)
        return max(seq, 0)

    def start(self, config: Any, exporters: list, queue_size: int) -> None:
        """Start the exporters.  Until their tracker runs are open this process runs at the training
        process's priority (the trackers start during the first steps, not in `shutdown()`), without the
        cyclic GC; then it settles (`_settle`)."""
        from .exporters import registry

        self.config = config
        _set_cpus(getattr(config, "export_process_cpus", None))
        self.receiver.max_chars = int(getattr(config, "max_value_chars", self.receiver.max_chars))
        self._start_by = time.monotonic() + _START_S
        if gc.isenabled():
            # The trackers import large libraries and open their runs first (hundreds of thousands of
            # objects): collecting meanwhile re-scans them all, again and again.  The GC stays off until
            # the runs are open; then all of it is frozen out of later collections (`_settle`).
            gc.disable()
            self._gc_off = True
        ready = {}
        for name, wants_trajectories in exporters:
            try:
                exp = registry.create(name, config)
                exp.wants_trajectories = bool(wants_trajectories)  # the trainer's routing decides
                exp.training_pid = self.training_pid  # (and so `in_export_process`)
                q = self.queues[name] = DeliveryQueue(exp, queue_size, config=config)
                q.hold_flush()  # no gathering while it starts: its run opens with the first batch (`_settle`)
                self._held.append(q)
                # optional modules its library tries to import again and again: a missing one is searched
                # for on the whole sys.path at every attempt
                _mark_absent(getattr(exp, "probed_modules", ()))
                ready[name] = None
            except Exception as exc:
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                ready[name] = self.errors[name]
        self.send(("ready", ready))
        threading.Thread(target=self._stats_loop, name="otel-rl-export-process-stats", daemon=True).start()

    def add_tokenizer(self, key: int, blob: bytes) -> None:
        """token2text: a tokenizer of the trainer, pickled; the ids of shipped spans name it by `key`."""
        try:
            self.receiver.tokenizers[key] = pickle.loads(blob)
        except Exception as exc:  # its outputs keep their ids (decode_packed warns)
            _log.warning("otel-rl: export process: token2text tokenizer could not be loaded (%s: %s)",
                         type(exc).__name__, exc)

    def _stats_loop(self) -> None:
        next_stats = time.monotonic() + _STATS_INTERVAL_S
        while not self.stop_event.wait(_START_LOOK_S if self._start_by is not None else _STATS_INTERVAL_S):
            if self._start_by is not None:
                self._settle()
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + _STATS_INTERVAL_S
                self.send(("stats", self.stats(), self.settled()))

    def _runs_open(self) -> bool:
        """Every tracker exporter here has opened a run (the others open nothing)."""
        for q in self.queues.values():
            runs = getattr(q.exporter, "runs", None)
            if runs is not None and not runs and q.stats.failed_attempts == 0:
                return False
        return True

    def _settle(self, stopping: bool = False) -> None:
        """Once the runs are open (or the time is up), the trackers have started: this process and what it
        started go down to the export process's priority (`lower_priority`), and the cyclic GC comes back
        on, with what there is (the libraries, the runs) frozen out of later collections.  `stopping`: the
        training process waits for this one now, which keeps its priority.

        Without a collection first: with the trackers' libraries loaded it would look at ~350,000 objects
        (0.3-0.4 s of CPU time, beside the training) to free ~5,000 (the import-time cycles, ~2 MB), which
        instead stay, frozen, for the export process's life."""
        if self._start_by is None:
            return
        if not (stopping or self._runs_open() or time.monotonic() >= self._start_by):
            return
        with self._settle_lock:
            if self._start_by is None:
                return
            self._start_by = None
            for q in self._held:
                q.release_flush()
            self._held.clear()
            if not stopping:
                lower_priority(self.config, self._base_nice)
            if self._gc_off:
                self._gc_off = False
                gc.freeze()
                gc.enable()

    def put(self, seq: int, records: list, names: Sequence[str], wire: list | None = None,
            resource_attrs: dict | None = None) -> None:
        self.receiver.put(records, names, wire, resource_attrs, seq)
        self.received = seq

    def console(self, chunks: list[tuple[str, str]]) -> None:
        """The training process's console output, for the exporters whose tracker records one."""
        for q in self.queues.values():
            write = getattr(q.exporter, "write_console", None)
            if write is None:
                continue
            try:
                write(chunks)
            except Exception as exc:
                warn_once(f"console:{q.name}", "otel-rl: exporter %r could not take the console output: %s",
                          q.name, exc)

    def _missing(self, name: str, n: int) -> None:
        if name in self.errors:  # an exporter that could not start: what it misses is counted as dropped
            self._dropped_failed[name] = self._dropped_failed.get(name, 0) + n

    def flush(self, seq: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ok = wait_all_idle(list(self.queues.values()), timeout_s)
        self._settle()  # (before the reply: what is delivered opened the runs)
        for q in self.queues.values():
            try:
                q.exporter.flush(max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
        self.send(("flushed", seq, ok, self.stats(), self.settled()))

    def stop(self, timeout_s: float, failure: tuple[str, str] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        self._settle(stopping=True)
        # trajectories whose root never came (the trainer stopped or died mid-trajectory): what there is
        self.receiver.flush_partial()
        ended = None
        if failure is not None:  # how the training process ends: (state, text, exit code)
            ended = Outcome(failure[0], int(failure[2]) if len(failure) > 2 else 1, failure[1])
            for q in self.queues.values():
                tell_outcome(q.exporter, ended)
        # Each exporter finishes on its own thread: its last delivery, its flush, its tracker run closed.
        # None waits for another's: the trainer waits for the slowest of them, not for their sum.
        threads = [threading.Thread(target=_finish_queue, args=(q, deadline, ended), name=f"otel-rl-stop-{q.name}")
                   for q in self.queues.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.stop_event.set()
        self.send(("stopped", self.stats()))

    def serve(self) -> None:
        stop_budget = 30.0
        failure = None
        while True:
            try:
                msg = _read(self.r)
            except Exception as exc:
                _log.error("otel-rl: export process: unreadable message (%s); stopping", exc)
                msg = None
            if msg is None:  # the trainer is gone: deliver what we have
                break
            kind = msg[0]
            if kind == "batch":
                self.put(msg[1], *pickle.loads(msg[2]))
            elif kind == "flush":
                threading.Thread(target=self.flush, args=(msg[1], float(msg[2])), daemon=True).start()
            elif kind == "routing":
                q = self.queues.get(msg[1])
                if q is not None:
                    q.exporter.wants_trajectories = bool(msg[2])
            elif kind == "stop":
                stop_budget, failure = float(msg[1]), msg[2]
                break
            elif kind == "hello":
                self.start(*msg[1:])
            elif kind == "tokenizer":
                self.add_tokenizer(msg[1], msg[2])
            elif kind == "console":
                self.console(msg[1])
        self.stop(stop_budget, failure)


def _finish_queue(q: DeliveryQueue, deadline: float, ended: Outcome | None = None) -> None:
    """The end of one exporter in the export process: what its queue holds delivered (retried until
    `deadline`; no more gathering), its queue stopped, the exporter flushed and shut down (its tracker
    run closed).  `ended`: how the training process ends (None: well), noted in a spool left behind."""
    from .spool.replay import note_run_end

    q.wait_idle(max(0.0, deadline - time.monotonic()))
    q.request_stop()
    q.join(max(0.05, deadline - time.monotonic()))
    note_run_end(q, ended)
    try:
        q.exporter.flush(max(0.1, deadline - time.monotonic()))
    except Exception:
        pass
    try:
        q.exporter.shutdown()
    except Exception as exc:
        _log.warning("otel-rl: exporter %r shutdown failed: %s", q.name, exc)


def _ignore_signal(signum: int, frame: Any) -> None:
    return None


def main(argv: Sequence[str]) -> NoReturn:
    # the trainer stops us in order: Ctrl-C, or a SIGTERM sent to every process of the job, would end this process
    # before the trainer's last batches reach it (see _CHILD)
    # (SIGTERM: a handler that does nothing rather than SIG_IGN, which the processes trackers start would inherit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignore_signal)
    r = os.fdopen(int(argv[0]), "rb", buffering=1 << 16)
    w = os.fdopen(int(argv[1]), "wb", buffering=1 << 16)
    server = _Server(r, w)
    server.serve()  # ends with "stopped": every tracker run finished

    def done() -> None:
        # The trackers' own exit hooks have run too (`quick_exit` has just run them) and the output is
        # flushed: the trainer goes on without waiting for this process's end (the kernel's teardown of
        # its memory, ~20 ms).
        server.send(("done",))
        try:
            w.close()
        except (OSError, ValueError):  # the trainer is gone: what it would have read does not matter
            pass

    # What is left is the interpreter tearing down MLflow's, wandb's and SwanLab's module graphs, over a
    # second of CPU that the trainer would wait for: skipped.
    quick_exit(0, join_timeout_s=60.0, before_exit=done)
