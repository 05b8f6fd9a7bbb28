"""`console`: one line per `log()` call in verl's format, ``step:N - key:value - ...``.

Byte-for-byte verl's console logger (``verl.utils.logger.aggregate_logger``,
``concat_dict_to_str``, verl >= 0.5; checked against 0.9.1): every numeric
value as ``pprint.pformat(v)``, i.e. full ``repr`` precision (``0.25``,
``3``, ``True``, ``nan``, ``inf``).  verl <= 0.3 printed ``{v:.3f}``.
Values are the coerced scalars (a numpy or torch scalar prints as the plain
Python number).
"""

from __future__ import annotations

import numbers
import pprint
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..records import StepMetrics
from .base import Exporter


_PLAIN = (float, int, bool)  # pprint.pformat of these is their repr


def format_line(data: dict[str, Any], step: int) -> str:
    parts = [f"step:{step}"]
    for k, v in data.items():
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
