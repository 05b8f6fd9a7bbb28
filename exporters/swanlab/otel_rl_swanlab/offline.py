"""Read back what SwanLab wrote for a run in ``offline`` (or ``local``) mode.

SwanLab 0.10 writes one directory per run, ``<log_dir>/run-<time>-<id>/``:

- ``run-<id>.swanlab`` - the record log: a LevelDB-log-format file (header
  ``:SWL``, 32 KiB blocks, CRC32 per chunk) of serialized protobuf
  ``swanlab.proto.swanlab.record.v1.Record`` messages: ``start``, ``column``
  (a key's first appearance), ``scalar`` (key, step, value), ``media`` (key,
  step, file names), ``log`` (captured terminal lines), ``save`` (config,
  metadata) and ``finish`` (state).  Read here with SwanLab's own
  ``DataStoreReader``, the reader behind ``swanlab sync``;
- ``files/config.yaml`` - the config, ``{key: {value, desc, sort}}``;
- ``media/<kind>/<step>-<sha>.<ext>`` - media payloads, e.g. an
  ``echarts.Table`` as JSON ``{"colDefs": [...], "rowData": [...]}``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class OfflineRun:
    run_dir: Path
    run_id: str
    project: str
    name: str
    started_at: float  # seconds since the epoch, from the start record
    state: str | None  # finish state ("RUN_STATE_FINISHED", "RUN_STATE_CRASHED", ...) or None if unfinished
    scalars: dict[int, dict[str, float]]  # step -> key -> value, as SwanLab kept them
    media: dict[str, dict[int, list[Path]]]  # key -> step -> payload files
    config: dict[str, Any]
    record_counts: dict[str, int]
    logs: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (level, line): the console log

    def table(self, key: str, step: int) -> dict[str, Any]:
        """An echarts.Table logged at `step` as ``{"headers": [...], "rows": [[...], ...]}``."""
        (path,) = self.media[key][step]
        data = json.loads(path.read_text(encoding="utf-8"))
        headers = [c["field"] for c in data["colDefs"]]
        return {"headers": headers, "rows": [[row.get(h) for h in headers] for row in data["rowData"]]}

    def text(self, key: str, step: int) -> list[str]:
        return [p.read_text(encoding="utf-8") for p in self.media[key][step]]


_MEDIA_DIRS = {
    "COLUMN_TYPE_ECHARTS": "echarts",
    "COLUMN_TYPE_TEXT": "text",
}


def run_dirs(log_dir: str | Path) -> list[Path]:
    """Run directories under a SwanLab log dir, by name (``run-<second>-<id>``: runs started within
    the same second are not in start order; sort `read_run` results by ``started_at`` for that)."""
    return sorted(p for p in Path(log_dir).glob("run-*") if p.is_dir())


def read_runs(log_dir: str | Path) -> list[OfflineRun]:
    """Every run under a SwanLab log dir, in start order."""
    return sorted((read_run(d) for d in run_dirs(log_dir)), key=lambda r: r.started_at)


def read_run(run_dir: str | Path) -> OfflineRun:
    from swanlab.proto.swanlab.metric.column.v1.column_pb2 import ColumnType
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.proto.swanlab.run.v1.run_pb2 import RunState
    from swanlab.proto.swanlab.terminal.v1.log_pb2 import LogLevel
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    run_dir = Path(run_dir)
    (run_file,) = sorted(run_dir.glob("run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(run_file)
    scalars: dict[int, dict[str, float]] = {}
    media: dict[str, dict[int, list[Path]]] = {}
    counts: dict[str, int] = {}
    logs: list[tuple[str, str]] = []
    start: Any = None
    state = None
    try:
        for raw in reader:
            rec = Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "start":
                start = rec.start
            elif kind == "finish":
                state = RunState.Name(rec.finish.state)
            elif kind == "scalar":
                s = rec.scalar
                scalars.setdefault(int(s.step), {})[s.key] = float(s.value.number)
            elif kind == "media":
                m = rec.media
                sub = _MEDIA_DIRS.get(ColumnType.Name(m.type), ColumnType.Name(m.type).lower())
                files = [run_dir / "media" / sub / item.filename for item in m.value.items]
                media.setdefault(m.key, {})[int(m.step)] = files
            elif kind == "log":
                logs.append((LogLevel.Name(rec.log.level), rec.log.line))
    finally:
        reader.close()
    return OfflineRun(
        run_dir=run_dir,
        run_id=start.id if start else "",
        project=start.project if start else "",
        name=start.name if start else "",
        started_at=start.started_at.ToNanoseconds() / 1e9 if start else 0.0,
        state=state,
        scalars=scalars,
        media=media,
        config=read_config(run_dir),
        record_counts=counts,
        logs=logs,
    )


def read_config(run_dir: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(run_dir) / "files" / "config.yaml"
    if not path.exists():
        return {}
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    items = sorted(
        ((k, v.get("value"), v.get("sort", 0)) for k, v in raw.items() if isinstance(v, dict)), key=lambda kv: kv[2]
    )
    return {k: v for k, v, _ in items}


def same_value(a: float, b: float) -> bool:
    """Equality that treats NaN as equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b
