"""The training process's console as SwanLab log lines (otel_rl_swanlab._console.ConsoleLines), against
SwanLab's own terminal emulator, and through a real offline SwanLab run read back."""

from __future__ import annotations

import random

import pytest

swanlab = pytest.importorskip("swanlab")
emulator_mod = pytest.importorskip("swanlab.sdk.internal.run.components.terminal.emulator")

from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, StepMetrics  # noqa: E402
import otel_rl_swanlab._exporter  # noqa: E402
from otel_rl_swanlab import SwanlabExporter  # noqa: E402
from otel_rl_swanlab._console import _NOT_PLAIN, ConsoleLines  # noqa: E402
from otel_rl_swanlab.offline import read_run, run_dirs  # noqa: E402

from .test_swanlab import swan_env  # noqa: E402,F401  (offline SwanLab in a temporary directory)

TerminalEmulator = emulator_mod.TerminalEmulator


def swanlab_lines(chunks: list[tuple[str, str]]) -> list[str]:
    """What SwanLab's proxy records of `chunks`: an emulator per stream, the lines each write finishes,
    then (as when it stops) the unfinished ones of stdout and stderr."""
    emulators = {"stdout": TerminalEmulator(), "stderr": TerminalEmulator()}
    out = []
    for stream, text in chunks:
        emulators[stream].write(text)
        out.extend(line for line, finished in emulators[stream].read() if finished)
    for stream in ("stdout", "stderr"):
        emulators[stream].finalize()
        out.extend(line for line, finished in emulators[stream].read() if finished)
    return out


def our_lines(chunks: list[tuple[str, str]]) -> list[str]:
    lines = ConsoleLines(TerminalEmulator)
    out = []
    for stream, text in chunks:
        out.extend(lines.write(stream, text))
    return out + lines.finish()


def test_what_is_not_plain_text_is_what_swanlabs_emulator_treats_as_such():
    """Every Latin-1 character SwanLab's emulator handles as a separator or control (its SEP_RE) but the
    newline is one ConsoleLines leaves to the emulator, and no other."""
    theirs = {chr(i) for i in range(256) if emulator_mod.SEP_RE.fullmatch(chr(i))} - {"\n"}
    ours = {chr(i) for i in range(256) if _NOT_PLAIN.fullmatch(chr(i))}
    assert ours == theirs
    assert "\x1b" in ours and "\r" in ours and "\t" not in ours


CASES = {
    "plain lines": [("stdout", "step:1 - a:1\nstep:2 - a:2\n")],
    "a line in several writes": [("stdout", "step:1 - "), ("stdout", "a:1"), ("stdout", " - b:2\nnext")],
    "empty and blank lines, trailing blanks": [("stdout", "\n\n   \nx   \n  y  \n\t\n")],
    "unicode and tabs": [("stdout", "中文 ünïcødé 🙂\tcol\n"), ("stderr", "警告\n")],
    "both streams, each unfinished in turn": [("stdout", "out-a"), ("stderr", "err-a"), ("stdout", "1\n"),
                                              ("stderr", "1\nerr-b"), ("stdout", "out-b\n")],
    "a progress bar on stderr": [("stderr", "  0%|          |\r 50%|#####     |\r100%|##########|\n"),
                                 ("stdout", "done\n")],
    "a carriage return after plain text on the same line": [("stdout", "plain start"), ("stdout", "\rover\n")],
    "colours": [("stdout", "\x1b[31mred\x1b[0m plain \x1b[1mbold\x1b[22m\n")],
    "backspaces": [("stdout", "abc\b\bX\n")],
    "cursor up into lines written as plain text": [("stdout", "one\ntwo\nthree\n"), ("stdout", "\x1b[A\x1b[Anew\n")],
    "cursor up after more lines than the terminal keeps": [("stdout", "".join(f"l{i}\n" for i in range(1500))),
                                                             ("stdout", "\x1b[3Areplaced\n\x1b[2000Atop\n")],
    "cursor up over two bars": [("stderr", "bar1 10%\nbar2 10%\n\x1b[A\x1b[Abar1 90%\nbar2 90%\n")],
    "erase line": [("stdout", "something long\r\x1b[Kshort\n")],
    "osc title": [("stdout", "\x1b]0;title\x07text\n")],
    "control characters": [("stdout", "a\x00b\x07c\x7fd\xa0e\xadf\n")],
    "unfinished at the end": [("stdout", "last words   "), ("stderr", "\x1b[32mlast err")],
    "plain after a special write on the other stream": [("stderr", "x\ry\n"), ("stdout", "plain\n")],
    "many lines in one write": [("stdout", "".join(f"line {i}\n" for i in range(2500)))],
    "many lines after a carriage return": [("stdout", "\r" + "".join(f"line {i}\n" for i in range(1500)))],
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_lines_are_swanlabs(name):
    assert our_lines(CASES[name]) == swanlab_lines(CASES[name])


def test_random_text_in_random_writes_gives_swanlabs_lines():
    rng = random.Random(7)
    alphabet = ["a", "b", " ", "  ", "\t", "中", "\n", "\n", "\n", "\r", "\b", "\x1b[31m", "\x1b[0m", "\x1b[K",
                "\x1b[A", "\x00", "\xa0", "xyz"]
    for _ in range(300):
        chunks = []
        for _ in range(rng.randint(1, 12)):
            stream = rng.choice(["stdout", "stdout", "stderr"])
            # mostly plain text, now and then a character a terminal rearranges
            plain = rng.random() < 0.7
            parts = [p for p in alphabet if not (plain and _NOT_PLAIN.search(p))]
            chunks.append((stream, "".join(rng.choice(parts) for _ in range(rng.randint(0, 20)))))
        assert our_lines(chunks) == swanlab_lines(chunks), chunks


def test_a_line_written_a_character_at_a_time_is_kept_in_pieces():
    """A line that grows over many writes is joined once, when it ends (not copied at every write)."""
    lines = ConsoleLines(TerminalEmulator)
    for _ in range(100_000):
        assert lines.write("stdout", ".") == []
    assert lines._partial["stdout"][:2] == [".", "."]
    assert lines.write("stdout", "!\nnext") == ["." * 100_000 + "!"]
    assert lines.finish() == ["next"]


def test_without_swanlabs_emulator_text_is_taken_as_it_comes():
    lines = ConsoleLines(None)
    assert lines.write("stdout", "a\rb\n c  \nd") == ["a\rb", " c"]
    assert lines.finish() == ["d"]


@pytest.mark.parametrize("swanlab_parts", ["emit_line", "capture_queues_only"])
def test_the_console_lines_reach_the_run_and_its_offline_log(swan_env, swanlab_parts, monkeypatch):
    """A real offline SwanLab run: the forwarded console (a progress bar on stderr, metric lines on
    stdout, a line left unfinished at the end) is in its log as SwanLab would have recorded it, in order,
    once.  For a SwanLab without the parts ConsoleLines uses, the text goes through its capture's queues:
    the finished lines are there too, but the training process's streams share a terminal with this
    process's own (its unfinished line is continued by what SwanLab prints at the end)."""
    if swanlab_parts == "capture_queues_only":
        monkeypatch.setattr(otel_rl_swanlab._exporter, "_console_parts", lambda proxy: None)
    cfg = resolve(env={}, exporters=[])
    ex = SwanlabExporter(cfg)
    ident = RunIdentity(cfg.project, cfg.experiment, cfg.run_id)
    ex.write_console([("stdout", "before the run opened\n")])  # kept for the run
    ex.export_records([StepMetrics(ident, 1, {"x": 1.0}, 1)])
    chunks = [("stderr", "  0%|     |\r"), ("stdout", "step:1 - x:1.0\n"), ("stderr", "100%|#####|\n"),
              ("stdout", "step:2 - "), ("stdout", "x:2.0\n\x1b[33mwarn\x1b[0m\n"), ("stdout", "unfinished")]
    ex.write_console(chunks)
    ex.shutdown()
    run = read_run(run_dirs(swan_env)[0])
    expected = swanlab_lines([("stdout", "before the run opened\n")] + chunks)
    assert expected == ["before the run opened", "step:1 - x:1.0", "100%|#####|", "step:2 - x:2.0", "warn",
                        "unfinished"]
    logged = [line for _, line in run.logs]
    if swanlab_parts == "capture_queues_only":
        assert set(expected[:-1]) <= set(logged), logged
        assert any(line.startswith("unfinished") for line in logged), logged
        return
    # the run's log also holds what this process printed meanwhile (SwanLab's own capture): ours in order
    it = iter(logged)
    assert all(any(line == got for got in it) for line in expected), logged
    assert sum(line in expected for line in logged) == len(expected)
