"""The training process's console as SwanLab log lines, in the export process.

SwanLab records a run's console through its terminal proxy: every write of the process's stdout and
stderr goes through a terminal emulator (one per stream) that places each character in a 2-D grid of
styled cells, so that carriage returns, backspaces and ANSI cursor and erase sequences (progress bars)
leave only what a terminal would show; each line the cursor leaves becomes a log record, without its
trailing blanks.

The training process's console reaches the export process as text.  Feeding it to the export process's
own proxy would mix two processes' streams in one emulator (a line the one leaves unfinished continued by
the other's), and costs a styled cell object per character: for the console lines of a training run
(verl's metric line at every step, a few kilobytes) most of the CPU time the SwanLab exporter spends.

`ConsoleLines` keeps a terminal per stream of the training process instead.  While a stream has written
only text a terminal does not rearrange (no carriage return, backspace, escape or other control
character), its lines are what lies between its newlines, trailing blanks removed: exactly what SwanLab's
emulator makes of such text (``tests/trackers/test_swanlab_console.py`` compares the two).  From the first
write that holds such a character on, that stream goes through an emulator of SwanLab's own class, as
SwanLab's capture would; it is first given the lines the stream finished before (as many as SwanLab's
emulator keeps), so that a cursor moved up lands where it would have.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from typing import Any

#: what SwanLab's emulator treats as other than plain text: the characters its separator pattern matches
#: (control characters of Latin-1 but tab and newline, DEL, C1, no-break space, soft hyphen), and so
#: escape sequences, which start with ESC
_NOT_PLAIN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\xa0\xad]")


class ConsoleLines:
    """Finished lines of the training process's stdout and stderr (see the module doc)."""

    __slots__ = ("_emulator_class", "_partial", "_emulators", "_history", "_kept")

    def __init__(self, emulator_class: Callable[[], Any] | None):
        self._emulator_class = emulator_class  # SwanLab's TerminalEmulator (None: plain text only)
        # stream -> its unfinished last line, in the pieces written (plain streams; joined once it ends)
        self._partial: dict[str, list[str]] = {}
        self._emulators: dict[str, Any] = {}  # stream -> its emulator, once it wrote more than plain text
        # stream -> its last finished lines (plain streams): what its emulator holds above the cursor line
        self._kept = int(getattr(emulator_class, "_MAX_LINES", 1024)) - 1
        self._history: dict[str, deque] = {}

    def write(self, stream: str, text: str) -> list[str]:
        """The lines `text` finishes on `stream` (``"stdout"`` or ``"stderr"``)."""
        emulator = self._emulators.get(stream)
        if emulator is None:
            if self._emulator_class is None or not _NOT_PLAIN.search(text):
                if "\n" not in text:
                    if text:
                        self._partial.setdefault(stream, []).append(text)
                    return []
                lines = ("".join(self._partial.pop(stream, ())) + text).split("\n")
                last = lines.pop()
                if last:
                    self._partial[stream] = [last]
                lines = [line.rstrip(" ") for line in lines]
                if lines and self._emulator_class is not None:
                    history = self._history.get(stream)
                    if history is None:
                        history = self._history[stream] = deque(maxlen=self._kept)
                    history.extend(lines)
                return lines
            emulator = self._emulators[stream] = self._emulator_class()
            kept = self._history.pop(stream, None) or ()
            emulator.write("".join(line + "\n" for line in kept) + "".join(self._partial.pop(stream, ())))
            emulator.read()  # those lines are out already
        emulator.write(text)
        return [line for line, finished in emulator.read() if finished]

    def finish(self) -> list[str]:
        """The unfinished last lines (blank ones left out), as SwanLab's proxy emits them when it stops."""
        out = []
        for stream in ("stdout", "stderr"):
            last = "".join(self._partial.pop(stream, ())).rstrip(" ")
            if last:
                out.append(last)
            emulator = self._emulators.pop(stream, None)
            if emulator is not None:
                emulator.finalize()
                out.extend(line for line, finished in emulator.read() if finished)
        return out
