"""`otel_rl._console.ConsoleTee`: the training process's console copied for the tracker runs in the export
process (the runs' logs themselves: tests/test_export_process.py)."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

from otel_rl._console import ConsoleTee
from otel_rl.config import resolve
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import RunIdentity, StepMetrics


@contextlib.contextmanager
def own_streams(out=None, err=None):
    """sys.stdout / sys.stderr as new StringIOs inside the test body (pytest's capture sets its own at each
    test phase, so a fixture cannot)."""
    out = io.StringIO() if out is None else out
    err = io.StringIO() if err is None else err
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = saved


def test_writes_go_through_unchanged_and_are_copied_in_order():
    tee = ConsoleTee()
    with own_streams() as (out, err):
        tee.install()
        try:
            print("step 1", 0.5)
            sys.stderr.write("warn 1\n")
            assert sys.stdout.write("a, ") == 3  # the stream's own return value
            sys.stdout.write("b\n")
            print("训练", file=sys.stderr)
        finally:
            tee.uninstall()
    assert out.getvalue() == "step 1 0.5\na, b\n" and err.getvalue() == "warn 1\n训练\n"
    # consecutive writes to one stream come as one piece
    assert tee.take() == [("stdout", "step 1 0.5\n"), ("stderr", "warn 1\n"), ("stdout", "a, b\n"),
                          ("stderr", "训练\n")]
    assert tee.take() == []
    with own_streams(out, err):
        print("after")
    assert tee.take() == [] and out.getvalue().endswith("after\n")
    assert "write" not in vars(out) and "write" not in vars(err)  # the streams' own write methods again


def test_bounded_what_does_not_fit_is_counted():
    tee = ConsoleTee(max_chars=10)
    with own_streams() as (out, _):
        tee.install()
        try:
            sys.stdout.write("12345678")
            sys.stdout.write("abcdef")  # would exceed 10: counted, not kept
            sys.stdout.write("xy")
        finally:
            tee.uninstall()
    assert out.getvalue() == "12345678abcdefxy"  # the terminal gets everything
    assert tee.take() == [("stdout", "12345678xy")] and tee.lost_chars == 6
    with own_streams():
        tee.install()
        try:
            sys.stdout.write("0123456789")  # room again once taken
        finally:
            tee.uninstall()
    assert tee.take() == [("stdout", "0123456789")] and tee.lost_chars == 6


def test_a_failing_write_raises_as_before_and_records_nothing():
    tee = ConsoleTee()
    with own_streams() as (out, _):
        tee.install()
        try:
            with pytest.raises(TypeError):
                sys.stdout.write(b"bytes on a text stream")
            out.close()
            with pytest.raises(ValueError):
                print("on a closed stream")
        finally:
            tee.uninstall()
    assert tee.take() == []


def test_a_wrapper_installed_after_it_keeps_working_after_uninstall():
    tee = ConsoleTee()
    seen = []
    with own_streams() as (out, _):
        tee.install()
        ours = sys.stdout.write

        def theirs(data):  # another capture (a tracker in this process, say) wraps the write it finds
            seen.append(data)
            return ours(data)

        sys.stdout.write = theirs
        print("one")
        tee.uninstall()
        print("two")  # their wrapper still in place; ours only passes the write on
        assert sys.stdout.write is theirs
    assert seen == ["one", "\n", "two", "\n"]
    assert out.getvalue() == "one\ntwo\n" and tee.take() == [("stdout", "one\n")]


def test_a_stream_that_takes_no_attributes_is_left_alone():
    class Slotted:
        __slots__ = ("buf",)

        def __init__(self):
            self.buf = []

        def write(self, data):
            self.buf.append(data)
            return len(data)

        def flush(self):
            pass

    s = Slotted()
    tee = ConsoleTee()
    with own_streams(out=s):
        tee.install()
        try:
            print("x")
        finally:
            tee.uninstall()
    assert s.buf == ["x", "\n"] and tee.take() == []


def test_forward_console_setting():
    assert resolve(env={}).forward_console is True
    assert resolve(env={"OTEL_RL_FORWARD_CONSOLE": "false"}).forward_console is False
    assert resolve(env={}, forward_console=False).forward_console is False


class ConsoleTracker(TrackerExporter):
    """A tracker whose runs record a console (as wandb's and SwanLab's do)."""

    tracker_name = "console-tracker"
    captures_console = True

    def __init__(self, config, pending_max=1 << 20):
        super().__init__(config)
        self.console_pending_max = pending_max
        self.got: list = []

    def open_run(self, run, start):
        return run.run_id

    def console_to_run(self, handle, chunks):
        self.got.extend((handle, stream, text) for stream, text in chunks)


def test_tracker_console_waits_for_the_first_run_then_goes_to_every_open_run():
    ex = ConsoleTracker(resolve(env={}))
    ex.write_console([("stdout", "early 1\n"), ("stderr", "early 2\n")])
    assert ex.got == []  # no run open yet: kept
    ex.export_records([StepMetrics(RunIdentity("p", "e", "r1"), 1, {"x": 1.0}, 1)])
    assert ex.got == [("r1", "stdout", "early 1\n"), ("r1", "stderr", "early 2\n")]
    ex.write_console([("stdout", "later\n")])
    ex.export_records([StepMetrics(RunIdentity("p", "e", "r2"), 1, {"x": 1.0}, 1)])
    ex.write_console([("stdout", "both\n")])
    assert ex.got[2:] == [("r1", "stdout", "later\n"), ("r1", "stdout", "both\n"), ("r2", "stdout", "both\n")]
    ex.shutdown()
    ex.write_console([("stdout", "after shutdown\n")])  # no run open: kept, never shown
    assert len(ex.got) == 5


def test_tracker_console_kept_before_the_run_is_bounded_and_says_what_is_missing():
    ex = ConsoleTracker(resolve(env={}), pending_max=10)
    ex.write_console([("stdout", "12345"), ("stdout", "abcdefgh"), ("stdout", "xyz")])
    ex.export_records([StepMetrics(RunIdentity("p", "e", "r1"), 1, {"x": 1.0}, 1)])
    assert [t for _, _, t in ex.got[:2]] == ["12345", "xyz"]
    assert ex.got[2][1] == "stderr" and "8 characters" in ex.got[2][2] and "missing" in ex.got[2][2]
    assert len(ex.got) == 3


def test_trackers_without_a_console_take_none():
    class Plain(ConsoleTracker):
        captures_console = False

    ex = Plain(resolve(env={}))
    ex.export_records([StepMetrics(RunIdentity("p", "e", "r1"), 1, {"x": 1.0}, 1)])
    ex.write_console([("stdout", "x\n")])
    assert ex.got == []
