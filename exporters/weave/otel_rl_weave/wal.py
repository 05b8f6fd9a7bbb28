"""Read back Weave's write-ahead log (what the client queued for the trace server).

With ``WEAVE_ENABLE_WAL=true`` the Weave client (0.54) persists every request
to ``~/.weave/wal/<entity>/<project>[/<sha256(api key)>]/<time_ns>_<uuid>.jsonl``
before its background sender (off with ``WEAVE_DISABLE_WAL_SENDER=true``)
replays it to the server.  Each line is ``{"type": ..., "req": {...}}`` with
type ``call_start`` / ``call_end`` / ``obj_create`` / ``file_create`` /
``table_create`` and ``req`` exactly the request body the server receives
(``{"start": {id, trace_id, parent_id, op_name, display_name, started_at,
attributes, inputs, ...}}``, ``{"end": {id, ended_at, output, exception,
summary, ...}}``).  Lines are read with Weave's own ``JSONLWALConsumer`` when
available (the sender's reader), else parsed directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def wal_files(root: str | os.PathLike[str]) -> list[Path]:
    """Every WAL file under `root` (e.g. ``$HOME/.weave/wal``), oldest first."""
    return sorted(Path(root).rglob("*.jsonl"), key=lambda p: p.name)


def read_records(root: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    for path in wal_files(root):
        yield from _read_file(path)


def _read_file(path: Path) -> Iterator[dict[str, Any]]:
    try:
        from weave.durability.wal_consumer import JSONLWALConsumer
    except ImportError:  # pragma: no cover - older Weave without a WAL
        pass
    else:
        consumer = JSONLWALConsumer(str(path))
        try:
            for entry in consumer.read_pending():
                yield entry.record
        finally:
            consumer.close()
        return
    with open(path, encoding="utf-8") as f:  # pragma: no cover
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_calls(root: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """call id -> the merged call: the ``start`` fields plus ``ended_at``, ``output``, ``exception``, ``summary``."""
    calls: dict[str, dict[str, Any]] = {}
    for rec in read_records(root):
        kind, req = rec.get("type"), rec.get("req") or {}
        if kind == "call_start":
            start = req["start"]
            calls.setdefault(start["id"], {}).update(start)
        elif kind == "call_end":
            end = req["end"]
            call = calls.setdefault(end["id"], {})
            for k in ("ended_at", "output", "exception", "summary"):
                call[k] = end.get(k)
            call.setdefault("started_at", end.get("started_at"))
    return calls


def op_name(call: dict[str, Any]) -> str:
    """``weave:///entity/project/op/<name>:<digest>`` -> ``<name>``."""
    ref = call.get("op_name") or ""
    return ref.rsplit("/op/", 1)[-1].split(":", 1)[0]
