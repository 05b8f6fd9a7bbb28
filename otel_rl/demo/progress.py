"""A progress line with the live reward.

On a terminal: tqdm when it is installed, else a line of our own redrawn in place on stderr
(carriage return); whatever is printed on stdout meanwhile (the console exporter's metric
lines) is written above it.  When stderr is not a terminal, a plain line is printed every
tenth of the run.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO


def _fmt(metrics: dict[str, float], last_val: float | None) -> str:
    parts = []
    if "critic/score/mean" in metrics:
        parts.append(f"reward {metrics['critic/score/mean']:.3f}")
    if "tool_call_counts/mean" in metrics:
        parts.append(f"tool calls {metrics['tool_call_counts/mean']:.2f}")
    if last_val is not None:
        parts.append(f"val {last_val:.3f}")
    return "  ".join(parts)


class _StdoutAboveBar:
    """sys.stdout while the bar is shown: whole lines are written above the bar (clear, write, redraw)."""

    def __init__(self, real: TextIO, bar: Progress):
        self._real = real
        self._bar = bar
        self._buf = ""

    def write(self, text: str) -> int:
        with self._bar.lock:
            self._buf += text
            if "\n" in self._buf:
                lines, _, self._buf = self._buf.rpartition("\n")
                self._bar._clear()
                self._real.write(lines + "\n")
                self._real.flush()
                self._bar._draw()
        return len(text)

    def flush(self) -> None:
        self._real.flush()

    def close_bar(self) -> None:
        if self._buf:
            self._real.write(self._buf)
            self._buf = ""
        self._real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Progress:
    """``update(step, metrics)`` after every step; ``close()`` at the end."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None, use_tqdm: bool = True):
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.lock = threading.RLock()
        self.last_val: float | None = None
        self._text = ""
        self._shown = False  # the bar is on the screen (and the cursor at its end)
        self._t0 = time.perf_counter()
        self._tqdm: Any = None
        self._saved_stdout: Any = None
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._every = max(1, total // 10)
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        if not use_tqdm or not self._tty:  # in a log file, a line every tenth of the run reads better
            tqdm = None
        if tqdm is not None:
            self._tqdm = tqdm(total=total, desc="otel-rl demo", unit="step", file=self.stream, dynamic_ncols=True)
        if self._tty and getattr(sys.stdout, "isatty", lambda: False)():
            self._saved_stdout = sys.stdout
            sys.stdout = _StdoutAboveBar(sys.stdout, self)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if "val-core/arith/reward/mean@1" in metrics:
            self.last_val = metrics["val-core/arith/reward/mean@1"]
        if not self.enabled or step == 0:
            return
        info = _fmt(metrics, self.last_val)
        if self._tqdm is not None:
            with self.lock:
                self._tqdm.set_postfix_str(info, refresh=False)
                self._tqdm.update(step - self._tqdm.n)
            return
        elapsed = time.perf_counter() - self._t0
        rate = step / elapsed if elapsed > 0 else 0.0
        width = 24
        filled = int(width * step / max(1, self.total))
        self._text = (
            f"otel-rl demo [{'#' * filled}{'.' * (width - filled)}] {step}/{self.total}  {info}  {rate:.2f} steps/s"
        )
        with self.lock:
            if self._tty:
                self._clear()
                self._draw()
            elif step % self._every == 0 or step == self.total:
                self.stream.write(self._text + "\n")
                self.stream.flush()

    def _clear(self) -> None:
        if self._tqdm is not None:
            self._tqdm.clear()
        elif self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def _draw(self) -> None:
        if self._tqdm is not None:
            self._tqdm.refresh()
        elif self._tty and self._text and not self._shown:
            self.stream.write(self._text)
            self.stream.flush()
            self._shown = True

    def close(self) -> None:
        with self.lock:
            if self._saved_stdout is not None:
                if isinstance(sys.stdout, _StdoutAboveBar):
                    sys.stdout.close_bar()
                sys.stdout = self._saved_stdout
                self._saved_stdout = None
            if self._tqdm is not None:
                self._tqdm.close()
                self._tqdm = None
            elif self._shown:
                self.stream.write("\n")
                self.stream.flush()
                self._shown = False
            self._text = ""
