"""The end of a process: leaving quickly once the work is done (`quick_exit`), and knowing how it
ends (`outcome`: an uncaught exception, a non-zero exit code, a termination signal) so that tracker
runs are marked as they end; SIGTERM handled so that what was logged is delivered first."""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

# (imported here, not where they are used: an import while the interpreter exits after Ctrl-C makes its exit
# status 1 instead of the SIGINT death that tells a shell or a job scheduler the job was interrupted)
from .exporters.tracker import on_uncaught_exception, run_failure


def quick_exit(
    code: int, join_timeout_s: float | None = None, before_exit: Callable[[], None] | None = None
) -> NoReturn:
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
    if code:
        note(Outcome("crashed", code, f"exit code {code}"))  # (the exit handlers below end the tracker runs)
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


# -- how the process ends -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How this process is ending when it does not end well; trackers mark their runs from it.

    `state`: ``crashed`` (an uncaught exception, a non-zero `sys.exit`), ``aborted`` (Ctrl-C: an uncaught
    KeyboardInterrupt) or ``killed`` (a termination signal).  `exit_code` as wandb records it: 1 for an
    exception, the code given to `sys.exit`, 255 for Ctrl-C, 128 + the signal's number for a signal."""

    state: str
    exit_code: int
    text: str


_outcome: Outcome | None = None
_installed = False
_original_exit: Callable[..., NoReturn] | None = None
#: the SIGTERM handler in place when ours was installed (chained)
_previous_sigterm: Any = None
#: what the SIGTERM handler does with the pipeline: set by `install`
_on_signal: Callable[[], None] | None = None


def outcome() -> Outcome | None:
    """The process's outcome so far: None while nothing says it ends badly."""
    return _outcome


def note(o: Outcome) -> None:
    """Record how the process ends; the first cause wins (a SystemExit raised by a signal handler is the
    signal's)."""
    global _outcome
    if _outcome is None:
        _outcome = o


def install(on_signal: Callable[[], None], handle_sigterm: bool = True) -> None:
    """Watch how this process ends, once: an uncaught exception, `sys.exit` with a non-zero code (wrapped,
    as wandb does), and, from the main thread with `handle_sigterm`, SIGTERM (see `_sigterm`).
    `on_signal()`: shuts down the pipeline, bounded, when SIGTERM is about to end the process."""
    global _installed, _original_exit, _on_signal, _previous_sigterm
    _on_signal = on_signal
    if _installed:
        return
    _installed = True
    on_uncaught_exception(_uncaught)
    _original_exit = sys.exit
    sys.exit = _exit
    if not handle_sigterm or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:  # ignored on purpose, or set outside Python
            return
        _previous_sigterm = previous
        signal.signal(signal.SIGTERM, _sigterm)
    except (ValueError, OSError):  # not the main interpreter / no signals here
        pass


def _uncaught(tp: Any, value: Any, tb: Any) -> None:
    failure = run_failure(tp, value, tb)  # None in an interactive session, which goes on
    if failure is not None:
        note(Outcome(failure[0], 255 if failure[0] == "aborted" else 1, failure[1]))


def _exit(code: Any = 0) -> NoReturn:
    n = 0 if code is None else code if isinstance(code, int) else 1
    if n:
        note(Outcome("crashed", n, f"sys.exit({code!r})"))
    assert _original_exit is not None
    _original_exit(code)


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (what Slurm, Kubernetes, Ray and `docker stop` send): a handler the program installed
    before `init()` runs first and decides; by default the pipeline is shut down (delivered, or spooled,
    within the shutdown budget) and the process then ends by the signal, as it would have without us."""
    previous = _previous_sigterm
    if callable(previous):
        try:
            previous(signum, frame)
        except BaseException as exc:  # it ends the process (SystemExit, KeyboardInterrupt, ...)
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code else 128 + signum
            note(Outcome("killed", code, f"signal {signal.Signals(signum).name}"))
            raise
        return  # the program goes on (a graceful stop of its own): its exit says how the run ends
    note(Outcome("killed", 128 + signum, f"signal {signal.Signals(signum).name}"))
    if _on_signal is not None:
        _call_quietly(_on_signal)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action: the process ends by the signal


def outcome_of(tp: Any, value: Any, tb: Any) -> Outcome | None:
    """The outcome an exception leaving a block means (None for none, or for `sys.exit(0)`)."""
    if tp is None:
        return None
    if isinstance(value, SystemExit):
        code = value.code
        n = 0 if code is None else code if isinstance(code, int) else 1
        return Outcome("crashed", n, f"sys.exit({code!r})") if n else None
    aborted = isinstance(tp, type) and issubclass(tp, KeyboardInterrupt)
    return Outcome(
        "aborted" if aborted else "crashed", 255 if aborted else 1, "".join(traceback.format_exception(tp, value, tb))
    )


def tell_outcome(exporter: Any, o: Outcome) -> None:
    """`exporter.process_failed(state, text, exit_code=...)` (without the code for an exporter whose
    method does not take it); its errors are ignored."""
    fn = getattr(exporter, "process_failed", None)
    if fn is None:
        return
    try:
        params = inspect.signature(fn).parameters
        takes_code = "exit_code" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_code = False
    try:
        fn(o.state, o.text, exit_code=o.exit_code) if takes_code else fn(o.state, o.text)
    except Exception:
        pass
