"""Leaving a process quickly once its work is done: `quick_exit`."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def quick_exit(code: int, join_timeout_s: float | None = None) -> NoReturn:
    """Exit with `code` as a normal exit would, less the interpreter's teardown of its modules and
    objects (torch's alone takes ~0.4 s, MLflow's, wandb's and SwanLab's together over a second): threads
    that are not daemons are waited for first (each up to `join_timeout_s`, None: as long as they run),
    the ``atexit`` handlers run (files and temporary directories left to them are closed and removed),
    stdout and stderr are flushed, then the process ends.  Called from another thread than the main
    one, it is `sys.exit`."""
    me = threading.current_thread()
    if me is not threading.main_thread():
        sys.exit(code)
    try:
        while True:  # a thread may start another before it ends
            left = [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
            if not left:
                break
            for t in left:
                t.join(join_timeout_s)
            if join_timeout_s is not None:
                break
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # a closed or broken stream: nothing more can be written to it
                pass
        os._exit(code)
