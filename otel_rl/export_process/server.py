"""The export process itself: the exporters' queues, fed from the training process's pipe.

It starts its trackers at the training process's priority, without the cyclic GC, and settles once their
runs are open (`Server._settle`): the idle class and its niceness (`ostune.lower_priority`), the GC back on.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import _memory
from .._batch import ExporterStats
from .._delivery import DeliveryQueue, wait_all_idle
from .._exit import Outcome, quick_exit, tell_outcome
from .._memory import SHIPPED_FACTOR
from .._values import warn_once
from .frames import read_frame, write_frame
from .ostune import lower_priority, mark_absent, set_cpus
from .protocol import (
    Batch,
    Console,
    Done,
    Flush,
    Flushed,
    Hello,
    Ready,
    Routing,
    Stats,
    Stop,
    Stopped,
    Tokenizer,
)
from .receiver import Receiver

_log = logging.getLogger("otel_rl")
_STATS_INTERVAL_S = 0.5
#: the export process starts its trackers at the training process's priority, without the cyclic GC, until
#: their runs are open (at most this long); then it settles: the idle class, its niceness, the GC back on
_START_S = 60.0
#: how often it looks whether its runs are open, while it starts
_START_LOOK_S = 0.1
#: how long it delivers when the training process is gone without a `Stop` (its pipe ended)
GONE_TIMEOUT_S = 30.0
#: how the runs of a training process that is gone without a word end, in a tracker that cannot leave a
#: run as it is (wandb's exit code 137: killed, as SIGKILL and the OOM killer end a process)
GONE = Outcome(
    "crashed", 128 + signal.SIGKILL, "the training process ended without saying how (SIGKILL, the OOM killer)"
)


class Server:
    """The export process: its exporters' queues, fed from the training process's pipe."""

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
                write_frame(self.w, msg)
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
        from ..exporters import registry

        self.config = config
        _memory.collect_cycles = True  # this process's heap is its own work: collected after a backlog
        set_cpus(getattr(config, "export_process_cpus", None))
        self.receiver.max_chars = int(getattr(config, "max_value_chars", self.receiver.max_chars))
        self._start_by = time.monotonic() + _START_S
        if gc.isenabled():
            # The trackers import large libraries and open their runs first (hundreds of thousands of
            # objects): collecting meanwhile re-scans them all, again and again.  The GC stays off until
            # the runs are open; then all of it is frozen out of later collections (`_settle`).
            gc.disable()
            self._gc_off = True
        ready: dict[str, str | None] = {}
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
                mark_absent(getattr(exp, "probed_modules", ()))
                ready[name] = None
            except Exception as exc:
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                ready[name] = self.errors[name]
        self.send(Ready(ready))
        threading.Thread(target=self._stats_loop, name="otel-rl-export-process-stats", daemon=True).start()

    def add_tokenizer(self, key: int, blob: bytes) -> None:
        """token2text: a tokenizer of the trainer, pickled; the ids of shipped spans name it by `key`."""
        try:
            self.receiver.tokenizers[key] = pickle.loads(blob)
        except Exception as exc:  # its outputs keep their ids (_wire.unpack warns)
            _log.warning(
                "otel-rl: export process: token2text tokenizer could not be loaded (%s: %s)", type(exc).__name__, exc
            )

    def _stats_loop(self) -> None:
        next_stats = time.monotonic() + _STATS_INTERVAL_S
        while not self.stop_event.wait(_START_LOOK_S if self._start_by is not None else _STATS_INTERVAL_S):
            if self._start_by is not None:
                self._settle()
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + _STATS_INTERVAL_S
                self.send(Stats(self.stats(), self.settled()))

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
        # all under the lock: a caller that comes while another settles returns once that one is done
        # (a flush's reply must not overtake the priority change)
        with self._settle_lock:
            if self._start_by is None:
                return
            if not (stopping or self._runs_open() or time.monotonic() >= self._start_by):
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

    def put(
        self,
        seq: int,
        records: list,
        names: Sequence[str],
        wire: list | None = None,
        resource_attrs: dict | None = None,
        nbytes: int = 0,
    ) -> None:
        self.receiver.put(records, names, wire, resource_attrs, seq, nbytes)
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
                warn_once(
                    f"console:{q.name}", "otel-rl: exporter %r could not take the console output: %s", q.name, exc
                )

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
        self.send(Flushed(seq, ok, self.stats(), self.settled()))

    def stop(self, timeout_s: float, failure: tuple | None = None, gone: bool = False) -> None:
        """Deliver what there is and end the tracker runs as the training process ends (`failure`: (state,
        text, exit code); None: well).  `gone`: the training process disappeared without a `Stop` (SIGKILL,
        the OOM killer): nothing says how it ended, so the runs are not marked finished: a tracker that
        can leave a run as it is does (MLflow: ``RUNNING``, as after a trainer killed with its tracker
        in-process), the others end theirs as crashed with exit code 137 (killed); and a spool left
        behind notes no end, so that `otel-rl replay` leaves the runs as it finds them too."""
        deadline = time.monotonic() + timeout_s
        self._settle(stopping=True)
        # trajectories whose root never came (the trainer stopped or died mid-trajectory): what there is
        self.receiver.flush_partial()
        ended = None
        if failure is not None:  # how the training process ends: (state, text, exit code)
            ended = Outcome(failure[0], int(failure[2]) if len(failure) > 2 else 1, failure[1])
            for q in self.queues.values():
                tell_outcome(q.exporter, ended)
        elif gone:
            for q in self.queues.values():
                leave = getattr(q.exporter, "leave_runs_open", None)
                if callable(leave):
                    leave(True)
                else:
                    tell_outcome(q.exporter, GONE)
        # Each exporter finishes on its own thread: its last delivery, its flush, its tracker run closed.
        # None waits for another's: the trainer waits for the slowest of them, not for their sum.
        threads = [
            threading.Thread(target=_finish_queue, args=(q, deadline, ended, not gone), name=f"otel-rl-stop-{q.name}")
            for q in self.queues.values()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.stop_event.set()
        self.send(Stopped(self.stats()))

    def serve(self) -> None:
        """Handle the training process's messages until `Stop`, or the end of its pipe (it is gone: what there
        is gets delivered all the same); then stop."""
        handlers: dict[type, Callable[[Any], None]] = {
            Batch: self._on_batch,
            Flush: self._on_flush,
            Routing: self._on_routing,
            Hello: self._on_hello,
            Tokenizer: self._on_tokenizer,
            Console: self._on_console,
        }
        stop = None
        while True:
            try:
                msg = read_frame(self.r)
            except Exception as exc:
                _log.error("otel-rl: export process: unreadable message (%s); stopping", exc)
                msg = None
            if msg is None:
                break
            if type(msg) is Stop:
                stop = msg
                break
            handler = handlers.get(type(msg))
            if handler is None:
                warn_once(
                    f"export-process-message:{type(msg).__name__}",
                    "otel-rl: export process: unknown message (%s); ignored",
                    type(msg).__name__,
                )
                continue
            handler(msg)
        if stop is None:  # the training process is gone without a word
            self.stop(GONE_TIMEOUT_S, gone=True)
        else:
            self.stop(float(stop.timeout_s), stop.failure)

    def _on_batch(self, msg: Batch) -> None:
        records, names, wire, resource_attrs = pickle.loads(msg.payload)  # a `protocol.Shipment`
        self.put(msg.seq, records, names, wire, resource_attrs, nbytes=len(msg.payload) * SHIPPED_FACTOR)

    def _on_flush(self, msg: Flush) -> None:
        threading.Thread(target=self.flush, args=(msg.seq, float(msg.timeout_s)), daemon=True).start()

    def _on_routing(self, msg: Routing) -> None:
        q = self.queues.get(msg.name)
        if q is not None:
            q.exporter.wants_trajectories = bool(msg.wants_trajectories)

    def _on_hello(self, msg: Hello) -> None:
        self.start(msg.config, msg.exporters, msg.queue_size)

    def _on_tokenizer(self, msg: Tokenizer) -> None:
        self.add_tokenizer(msg.key, msg.blob)

    def _on_console(self, msg: Console) -> None:
        self.console(msg.chunks)


def _finish_queue(q: DeliveryQueue, deadline: float, ended: Outcome | None = None, note: bool = True) -> None:
    """The end of one exporter in the export process: what its queue holds delivered (retried until
    `deadline`; no more gathering), its queue stopped, the exporter flushed and shut down (its tracker
    run closed).  `ended`: how the training process ends (None: well), noted in a spool left behind
    (unless not `note`: nobody said)."""
    from ..spool.replay import note_run_end

    q.wait_idle(max(0.0, deadline - time.monotonic()))
    q.request_stop()
    q.join(max(0.05, deadline - time.monotonic()))
    if note:
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
    # before the trainer's last batches reach it (see client.CHILD)
    # (SIGTERM: a handler that does nothing rather than SIG_IGN, which the processes trackers start would inherit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ignore_signal)
    r = os.fdopen(int(argv[0]), "rb", buffering=1 << 16)
    w = os.fdopen(int(argv[1]), "wb", buffering=1 << 16)
    server = Server(r, w)
    server.serve()  # ends with `Stopped`: every tracker run finished

    def done() -> None:
        # The trackers' own exit hooks have run too (`quick_exit` has just run them) and the output is
        # flushed: the trainer goes on without waiting for this process's end (the kernel's teardown of
        # its memory, ~20 ms).
        server.send(Done())
        try:
            w.close()
        except (OSError, ValueError):  # the trainer is gone: what it would have read does not matter
            pass

    # What is left is the interpreter tearing down MLflow's, wandb's and SwanLab's module graphs, over a
    # second of CPU that the trainer would wait for: skipped.
    quick_exit(0, join_timeout_s=60.0, before_exit=done)
