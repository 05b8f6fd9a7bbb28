"""Leaving a process quickly once its work is done: `quick_exit`."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def quick_exit(code: int, join_timeout_s: float | None = None,
               before_exit: Callable[[], None] | None = None) -> NoReturn:
    """Exit with `code` as a normal exit would, less the interpreter's teardown of its modules and
    objects (torch's alone takes ~0.4 s, MLflow's, wandb's and SwanLab's together over a second): the
    ``atexit`` handlers run (files and temporary directories left to them are closed and removed), stdout
    and stderr are flushed, then the process ends.

    Threads that are not daemons: with `join_timeout_s` None, while any is alive the exit is a normal one
    (`sys.exit`), which first lets ``threading``'s own exit hooks stop what would otherwise never end (an
    idle ``ThreadPoolExecutor``'s workers) and then waits for them; with `join_timeout_s`, each is waited
    for up to that long, then the process ends anyway.  Called from another thread than the main one,
    it is `sys.exit`.  `before_exit`: called last, after the exit handlers and the flush of the streams,
    right before the process ends (on the `sys.exit` paths: before the exit handlers); its errors are
    ignored."""
    me = threading.current_thread()
    left = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    if me is not threading.main_thread() or (left and join_timeout_s is None):
        if before_exit is not None:
            _call_quietly(before_exit)  # (here before the exit handlers, which run after this function)
        sys.exit(code)
    try:
        for t in left:
            t.join(join_timeout_s)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # a closed or broken stream: nothing more can be written to it
                pass
        if before_exit is not None:
            _call_quietly(before_exit)
        os._exit(code)


def _call_quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        pass
