"""`console`: one line per `log()` call in verl's format, ``step:N - key:value - ...``.

Values are printed with three decimals (``{v:.3f}``), as verl's console logger
does; non-finite values print as ``nan`` / ``inf`` / ``-inf``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ..records import StepMetrics
from .base import Exporter


def format_line(data: dict[str, Any], step: int) -> str:
    parts = [f"step:{step}"]
    for k, v in data.items():
        parts.append(f"{k}:{v:.3f}")
    return " - ".join(parts)


class ConsoleExporter(Exporter):
    def __init__(self, config: Any = None, stream: TextIO | None = None):
        self._stream = stream

    def export_records(self, records: Sequence[Any]) -> None:
        lines = [format_line(r.values, r.step) for r in records if isinstance(r, StepMetrics)]
        if lines:
            out = self._stream or sys.stdout
            out.write("\n".join(lines) + "\n")
            out.flush()
