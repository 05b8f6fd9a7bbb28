"""`console`: one line per `log()` call in verl's format, ``step:N - key:value - ...``.

Byte-for-byte verl's console logger (``verl.utils.logger.aggregate_logger``,
``concat_dict_to_str``, verl >= 0.5; checked against 0.9.1): every numeric
value as ``pprint.pformat(v)``, i.e. full ``repr`` precision (``0.25``,
``3``, ``True``, ``nan``, ``inf``).  verl <= 0.3 printed ``{v:.3f}``.
Values are the coerced scalars (a numpy or torch scalar prints as the plain
Python number).

Control characters in a key (a newline, a carriage return, an escape sequence,
U+2028/U+2029) are printed escaped as Python writes them in a string (``\\n``,
``\\x1b``, ``\\u2028``), so one `log()` call is always one line and a key cannot
forge another step's line or drive the terminal.
"""

from __future__ import annotations

import numbers
import pprint
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..records import StepMetrics
from .base import Exporter

_PLAIN = (float, int, bool)  # pprint.pformat of these is their repr


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape_char(m: re.Match) -> str:
    return repr(m.group(0))[1:-1]


def escape_key(key: str) -> str:
    """`key` with its control characters escaped (``\\n``, ``\\x1b``, ``\\u2028``)."""
    return _CONTROL.sub(_escape_char, key) if _CONTROL.search(key) else key


def format_line(data: dict[str, Any], step: int) -> str:
    parts = [f"step:{step}"]
    for k, v in data.items():
        if _CONTROL.search(k):
            k = _CONTROL.sub(_escape_char, k)
        if type(v) in _PLAIN:
            parts.append(f"{k}:{v!r}")
        elif isinstance(v, numbers.Number):
            parts.append(f"{k}:{pprint.pformat(v)}")
    return " - ".join(parts)


class ConsoleExporter(Exporter):
    #: a line per step, written about once per `export_interval_s` (and at every flush): a thread
    #: woken for each step would cost the training thread a switch of the interpreter lock each time
    gathers = True

    def __init__(self, config: Any = None, stream: TextIO | None = None):
        self._stream = stream

    def export_records(self, records: Sequence[Any]) -> None:
        lines = [format_line(r.values, r.step) for r in records if isinstance(r, StepMetrics)]
        if lines:
            out = self._stream or sys.stdout
            text = "\n".join(lines) + "\n"
            try:
                out.write(text)
            except UnicodeEncodeError:  # a key the terminal cannot show: escape it, never lose the line
                enc = getattr(out, "encoding", None) or "utf-8"
                out.write(text.encode(enc, "backslashreplace").decode(enc, "replace"))
            out.flush()
