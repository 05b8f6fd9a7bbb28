"""What the export process asks of the operating system: its CPUs, its priority once its trackers have
started, modules it marks absent, and the training process's wait for its exit."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

_log = logging.getLogger("otel_rl")


def mark_absent(names: Sequence[str]) -> None:
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


def set_cpus(spec: str | None) -> None:
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
            from ..config import parse_cpu_list

            cpus = parse_cpu_list(spec) & allowed
            if not cpus:
                _log.warning(
                    "otel-rl: export_process_cpus=%s: none of these CPUs is available (%s); not set",
                    spec,
                    sorted(allowed),
                )
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


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int:
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
