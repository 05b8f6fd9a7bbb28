"""`otel_rl._exit.quick_exit`: the exit of the `otel-rl demo` program and of the export process without
the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)


def test_exit_handlers_run_streams_are_flushed_and_the_code_is_kept(tmp_path):
    proc = _run("""
        import atexit, pathlib, sys, tempfile
        from otel_rl._exit import quick_exit
        out = pathlib.Path(sys.argv[1])
        left = tempfile.mkdtemp(dir=out)          # a temporary directory object cleans up at exit (weakref.finalize)
        keep = tempfile.TemporaryDirectory(dir=out)
        (out / "where").write_text(keep.name)
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        class Teardown:
            def __del__(self):
                (out / "teardown").write_text("ran")
        obj = Teardown()                           # destroyed only by the interpreter's teardown
        sys.stdout.write("no newline at the end")  # still in the stream's buffer
        sys.stderr.write("err text")
        quick_exit(3)
        print("not reached")
    """, tmp_path)
    assert proc.returncode == 3
    assert proc.stdout == "no newline at the end"
    assert proc.stderr == "err text"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / (tmp_path / "where").read_text()).exists()  # its finalizer ran
    assert not (tmp_path / "teardown").exists()  # no teardown: what makes the exit quick


def test_a_thread_still_working_is_waited_for(tmp_path):
    proc = _run("""
        import pathlib, sys, threading, time
        from otel_rl._exit import quick_exit
        out = pathlib.Path(sys.argv[1])
        def work():
            time.sleep(0.3)
            (out / "done").write_text("written")
        threading.Thread(target=work).start()
        daemon = threading.Thread(target=time.sleep, args=(60,), daemon=True)
        daemon.start()                             # a daemon thread does not hold the exit up
        quick_exit(0)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "done").read_text() == "written"


def test_the_console_script_runs_the_program():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "otel-rl"]
    assert ep.value == "otel_rl.cli:program"


def test_with_a_join_timeout_a_thread_that_does_not_end_is_left(tmp_path):
    """The export process's exit: a stuck thread is waited for up to the timeout, then the process ends
    anyway (without the timeout the exit would wait for it, as a normal exit does)."""
    proc = _run("""
        import pathlib, sys, threading, time
        from otel_rl._exit import quick_exit
        out = pathlib.Path(sys.argv[1])
        threading.Thread(target=time.sleep, args=(600,)).start()
        import atexit
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        quick_exit(5, join_timeout_s=0.2)
    """, tmp_path)  # (_run's timeout, 60 s, fails the test if the exit waited for the thread)
    assert proc.returncode == 5, proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran"


def test_an_idle_thread_pool_does_not_hold_the_exit_up(tmp_path):
    """An executor's idle workers never end by themselves (threading's exit hook tells them to): the
    exit is then a normal one, which runs that hook, rather than a wait for them that would not end."""
    proc = _run("""
        import pathlib, sys
        from concurrent.futures import ThreadPoolExecutor
        from otel_rl._exit import quick_exit
        out = pathlib.Path(sys.argv[1])
        pool = ThreadPoolExecutor(2)
        pool.submit(lambda: (out / "task").write_text("done")).result()
        quick_exit(4)
    """, tmp_path)  # (_run's timeout, 60 s, fails the test if the exit waited for the idle workers)
    assert proc.returncode == 4, proc.stderr
    assert (tmp_path / "task").read_text() == "done"


#: a program that logs what runs, in order, to <tmp>/order; an exit handler logs "exit handler"
_ORDER_LOG = """
        import atexit, pathlib, sys
        from otel_rl._exit import quick_exit
        out = pathlib.Path(sys.argv[1])
        def log(what):
            with open(out / "order", "a") as f:
                f.write(what + "\\n")
        atexit.register(log, "exit handler")
"""


def test_before_exit_runs_after_the_exit_handlers_and_the_flush(tmp_path):
    """The export process says "done" from `before_exit`: only once the trackers' exit hooks have run and
    what they printed is out, so the trainer need not wait for the process's end."""
    proc = _run(_ORDER_LOG + """
        sys.stdout.write("buffered")
        def before_exit():
            log("before_exit")
            raise RuntimeError("ignored")
        quick_exit(6, join_timeout_s=1.0, before_exit=before_exit)
    """, tmp_path)
    assert proc.returncode == 6, proc.stderr
    assert proc.stdout == "buffered"
    assert (tmp_path / "order").read_text().splitlines() == ["exit handler", "before_exit"]
    assert "RuntimeError" not in proc.stderr


def test_before_exit_on_the_normal_exit_path(tmp_path):
    """Called from a thread other than the main one, quick_exit is sys.exit: `before_exit` runs too (there,
    before the exit handlers)."""
    proc = _run(_ORDER_LOG + """
        import threading
        def worker():
            quick_exit(0, before_exit=lambda: log("before_exit"))
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        log("main goes on")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "order").read_text().splitlines() == ["before_exit", "main goes on", "exit handler"]
