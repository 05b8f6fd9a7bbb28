"""The training process's console, for trackers that run in the export process.

wandb and SwanLab record what the process that opened their run writes to stdout and stderr (wandb's
"Logs" tab and ``output.log``, SwanLab's console log).  When their exporters run in the export process
(`otel_rl.export_process`), that process is not the one that prints the training's output: `ConsoleTee`
copies what the training process writes to ``sys.stdout`` and ``sys.stderr`` (the writes go on to the
terminal unchanged), and the export process hands the text to those runs as their own console capture
would have (`otel_rl.exporters.tracker.TrackerExporter.write_console`).

Like the trackers' own capture, it sees writes through the Python stream objects (``print``, logging
to a stream, ``sys.stdout.write``), not what C code or child processes write to the file descriptors.
Text waiting to be shipped is bounded (`max_chars`); beyond it, text is counted as lost rather than kept.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

#: text waiting for the next shipment, at most (characters); more is counted in `ConsoleTee.lost_chars`
DEFAULT_MAX_CHARS = 4 << 20


class ConsoleTee:
    """Copies writes to ``sys.stdout`` / ``sys.stderr`` into a buffer that `take` empties."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS):
        self.max_chars = max_chars
        self.lost_chars = 0
        self._runs: list[tuple[str, list[str]]] = []  # (stream name, its writes in a row)
        self._size = 0
        self._lock = threading.Lock()
        self._active = False
        # (stream, our write, the write it replaced, whether that one was set on the stream object itself)
        self._installed: list[tuple[Any, Any, Any, bool]] = []

    def install(self) -> None:
        """Start copying (both streams); a stream whose ``write`` cannot be replaced is left alone."""
        if self._active:
            return
        self._active = True
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name, None)
            if stream is not None:
                self._wrap(name, stream)

    def _wrap(self, name: str, stream: Any) -> None:
        try:
            original = stream.write
            own = "write" in getattr(stream, "__dict__", {})
        except Exception:
            return
        tee = self

        def write(data: Any, _original: Any = original, _name: str = name) -> Any:
            n = _original(data)
            if tee._active:
                tee._add(_name, data)
            return n

        try:
            stream.write = write
        except (AttributeError, TypeError):  # a stream type that takes no attributes
            return
        self._installed.append((stream, write, original, own))

    def _add(self, name: str, data: Any) -> None:
        try:
            if type(data) is not str:
                if isinstance(data, str):
                    data = str(data)
                elif isinstance(data, (bytes, bytearray, memoryview)):
                    data = bytes(data).decode("utf-8", "replace")
                else:
                    return  # the stream's own write has already refused it
            if not data:
                return
            with self._lock:
                if self._size + len(data) > self.max_chars:
                    self.lost_chars += len(data)
                    return
                self._size += len(data)
                runs = self._runs
                if runs and runs[-1][0] == name:  # one piece per run of writes to the same stream
                    runs[-1][1].append(data)
                else:
                    runs.append((name, [data]))
        except Exception:  # pragma: no cover - never let a print fail because of this
            pass

    def take(self) -> list[tuple[str, str]]:
        """What was written since the last call, in order: [(``"stdout"`` or ``"stderr"``, text), ...]."""
        if not self._runs:
            return []
        with self._lock:
            runs, self._runs, self._size = self._runs, [], 0
        return [(name, "".join(parts)) for name, parts in runs]

    def uninstall(self) -> None:
        """Stop copying.  A stream whose ``write`` is still ours gets its previous one back; where other
        code has replaced it since (wrapping ours), ours stays in that chain and only passes writes on."""
        self._active = False
        for stream, ours, original, own in self._installed:
            try:
                if stream.__dict__.get("write") is ours:
                    if own:
                        stream.write = original
                    else:
                        del stream.write
            except Exception:  # pragma: no cover
                pass
        self._installed = []
