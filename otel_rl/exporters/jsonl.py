"""`file` / `jsonl`: one JSON object per `log()` call, ``{"step":N,"data":{...}}``.

The bytes match verl's file logger (compact separators, keys in the order
logged, UTF-8).  Where verl writes ``null`` for NaN and +-Inf (losing which
one it was), otel-rl writes the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"``: the file stays valid JSON for strict readers and nothing is
lost (`otel_rl.serialize.parse_json_float` turns them back).

Path: config ``jsonl_path`` (``OTEL_RL_JSONL_PATH``) > ``VERL_FILE_LOGGER_PATH``
> ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root default ``.``).
The file is appended to, so a restarted run continues it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..records import StepMetrics
from ..serialize import json_float
from .base import Exporter


def encode_line(step: int, data: dict[str, Any]) -> bytes:
    clean = {k: json_float(v) for k, v in data.items()}
    return json.dumps({"step": step, "data": clean}, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8") + b"\n"


def resolve_path(config: Any) -> str:
    path = getattr(config, "jsonl_path", None) or os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return os.path.expanduser(path)
    root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
    project = getattr(config, "project", "otel_rl")
    experiment = getattr(config, "experiment", "default")
    return os.path.join(root, project, f"{experiment}.jsonl")


class JsonlExporter(Exporter):
    def __init__(self, config: Any = None):
        self.path = resolve_path(config)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._fp = open(self.path, "ab")
        print(f"Creating file logger at {self.path}", flush=True)

    def export_records(self, records: Sequence[Any]) -> None:
        chunks = [encode_line(r.step, r.values) for r in records if isinstance(r, StepMetrics)]
        if chunks:
            self._fp.write(b"".join(chunks))
            self._fp.flush()

    def flush(self, timeout_s: float = 10.0) -> None:
        if not self._fp.closed:
            self._fp.flush()

    def shutdown(self) -> None:
        if not self._fp.closed:
            self._fp.close()
