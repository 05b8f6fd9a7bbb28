"""Read a wandb offline run back: config, history rows, summary, tables, exit.

An offline run lives in ``<WANDB_DIR>/wandb/offline-run-<time>-<id>/``; its data is the
transaction log ``run-<id>.wandb``: a LevelDB-style log of serialized
``wandb.proto.wandb_internal_pb2.Record`` messages.  Layout (the same as wandb's former
Python ``wandb.sdk.internal.datastore.DataStore``, which wandb >= 0.19 no longer ships
since its Go core writes the file):

- a 7-byte file header: ident ``b":W&B"``, magic ``0xBEE1`` (uint16 LE), version 0;
- 32 KiB blocks of chunks; a chunk is ``crc32 (uint32 LE), length (uint16 LE), type (uint8)``
  then ``length`` bytes; the CRC is zlib's crc32 of the data seeded with the crc32 of the
  type byte; types FULL=1, FIRST=2, MIDDLE=3, LAST=4 (a record split over blocks); a block
  tail shorter than a chunk header is zero padding.

The exit record is written a moment after ``run.finish()`` returns (the wandb service
writes the file), so `read_run` waits for it.  Tables logged offline are files under
``files/media/table/...table.json``; the history row holds a reference with their path.

    data = read_run(run_dir)                    # or the run-*.wandb file itself
    data.config, data.history, data.summary, data.tables, data.exit_seen

Usable without pytest and without a W&B account: it needs only ``wandb.proto``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
HEADER_LEN = 7
BLOCK_LEN = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = [zlib.crc32(bytes([t])) & 0xFFFFFFFF for t in range(LAST + 1)]
TABLE_TYPES = ("table-file", "incremental-table-file", "partitioned-table", "joined-table")


class RunFileError(ValueError):
    """The file is not a wandb run file, or it is corrupt before its end."""


@dataclasses.dataclass
class RunData:
    path: str  # the run-*.wandb file
    run_dir: str
    run_id: str = ""
    project: str = ""
    entity: str = ""
    display_name: str = ""
    resumed: bool = False
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # without wandb's own "_wandb"
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # rows as logged, with "_step"
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    tables: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)  # key -> logged versions
    metrics: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # define_metric records
    exit_seen: bool = False
    exit_code: int | None = None
    complete: bool = True  # False when the file ends in a partly written record
    records: int = 0

    def rows_by(self, step_key: str) -> dict[Any, dict[str, Any]]:
        """{value of `step_key`: the rows with that value merged (later rows win)}, wandb's keys left out."""
        out: dict[Any, dict[str, Any]] = {}
        for row in self.history:
            if step_key not in row:
                continue
            merged = out.setdefault(row[step_key], {})
            merged.update({k: v for k, v in row.items() if k not in ("_step", "_runtime", "_timestamp")})
        return out

    def series(self, key: str, step_key: str = "_step") -> list[tuple[Any, Any]]:
        """(step, value) of every row that has `key`, in logged order."""
        return [(r.get(step_key), r[key]) for r in self.history if key in r]

    def table(self, key: str) -> dict[str, Any] | None:
        """The last logged version of a table: {"columns", "data", "path", "_step"}."""
        versions = self.tables.get(key)
        return versions[-1] if versions else None


# ----------------------------------------------------------------------------- the log format


def iter_records(data: bytes) -> Iterator[bytes | None]:
    """Serialized records of a run file's bytes; a trailing None when the file ends mid-record."""
    if len(data) < HEADER_LEN:
        yield None
        return
    if data[:HEADER_LEN] != HEADER:
        raise RunFileError(f"not a wandb run file (header {data[:HEADER_LEN]!r})")
    pos = HEADER_LEN
    end = len(data)
    parts: list[bytes] = []
    while pos < end:
        left = BLOCK_LEN - pos % BLOCK_LEN
        if left < HEADER_LEN:  # block trailer: zero padding
            pos += left
            continue
        if pos + HEADER_LEN > end:
            yield None
            return
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0 and crc == 0:  # pre-allocated / padded rest of a block
            pos += left
            continue
        if pos + HEADER_LEN + length > end:
            yield None
            return
        chunk = data[pos + HEADER_LEN : pos + HEADER_LEN + length]
        if kind > LAST or (zlib.crc32(chunk, _TYPE_CRC[kind]) & 0xFFFFFFFF) != crc:
            if pos + HEADER_LEN + length >= end - BLOCK_LEN:  # near the end: being written
                yield None
                return
            raise RunFileError(f"bad chunk at offset {pos} (type {kind}, checksum mismatch)")
        pos += HEADER_LEN + length
        if kind == FULL:
            if parts:
                raise RunFileError(f"unterminated record before offset {pos}")
            yield chunk
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        else:  # LAST
            parts.append(chunk)
            yield b"".join(parts)
            parts = []
    if parts:
        yield None


# ----------------------------------------------------------------------------- decoding


def _item_value(item: Any) -> Any:
    try:  # HistoryItem may carry a typed value; Summary/ConfigItem have only value_json
        which = item.WhichOneof("value")
    except ValueError:
        which = None
    if which == "none":
        return None
    if which == "json":
        return json.loads(item.json)
    if which is not None:
        return getattr(item, which)
    return json.loads(item.value_json) if item.value_json else None


def _path(item: Any) -> list[str]:
    return list(item.nested_key) if len(item.nested_key) else [item.key]


def _set(target: dict[str, Any], path: list[str], value: Any) -> None:
    node = target
    for p in path[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    node[path[-1]] = value


def _remove(target: dict[str, Any], path: list[str]) -> None:
    node: Any = target
    for p in path[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(path[-1], None)


def _apply(target: dict[str, Any], rec: Any) -> None:
    for u in rec.update:
        _set(target, _path(u), _item_value(u))
    for r in rec.remove:
        _remove(target, _path(r))


def _parse(path: str) -> RunData:
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        raw = f.read()
    out = RunData(path=path, run_dir=os.path.dirname(os.path.abspath(path)))
    for blob in iter_records(raw):
        if blob is None:
            out.complete = False
            break
        rec = pb.Record()  # type: ignore[attr-defined]  # (re-exported per protobuf major version: mypy sees none)
        rec.ParseFromString(blob)
        out.records += 1
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.run_id, out.project, out.entity = r.run_id, r.project, r.entity
            out.display_name, out.resumed = r.display_name, r.resumed
            _apply(out.config, r.config)
            _apply(out.summary, r.summary)
        elif kind == "config":
            _apply(out.config, rec.config)
        elif kind == "history":
            row: dict[str, Any] = {}
            for it in rec.history.item:
                _set(row, _path(it), _item_value(it))
            if "_step" not in row and rec.history.HasField("step"):
                row["_step"] = rec.history.step.num
            out.history.append(row)
        elif kind == "summary":
            _apply(out.summary, rec.summary)
        elif kind == "metric":
            m = rec.metric
            out.metrics.append({"name": m.name, "glob_name": m.glob_name, "step_metric": m.step_metric})
        elif kind == "exit":
            out.exit_seen = True
            out.exit_code = rec.exit.exit_code
    out.config.pop("_wandb", None)
    return out


def _load_tables(data: RunData) -> None:
    files = os.path.join(data.run_dir, "files")
    for row in data.history:
        for key, value in row.items():
            if isinstance(value, dict) and value.get("_type") in TABLE_TYPES and value.get("path"):
                entry: dict[str, Any] = {
                    "path": value["path"],
                    "_step": row.get("_step"),
                    "columns": None,
                    "data": None,
                    "ref": value,
                }
                fpath = os.path.join(files, value["path"])
                if os.path.exists(fpath):
                    with open(fpath, encoding="utf-8") as f:
                        content = json.load(f)
                    entry["columns"] = content.get("columns")
                    entry["data"] = content.get("data")
                data.tables.setdefault(key, []).append(entry)


# ----------------------------------------------------------------------------- entry points


def run_file(run_dir_or_file: str) -> str:
    """The run-*.wandb file of a run directory (or the file itself)."""
    p = os.fspath(run_dir_or_file)
    if os.path.isfile(p):
        return p
    found = sorted(glob.glob(os.path.join(p, "run-*.wandb")))
    if not found:
        raise FileNotFoundError(f"no run-*.wandb file in {p}")
    return found[0]


def find_run_dirs(wandb_dir: str, run_id: str | None = None) -> list[str]:
    """Run directories (offline and online) under a ``WANDB_DIR`` that hold a run file, oldest first.

    `wandb_dir` may be the ``WANDB_DIR`` itself or its ``wandb/`` folder.  With `run_id`, only
    the directories of that wandb run id: a resumed run has one per process (or per
    ``wandb.init``), named ``offline-run-<time>-<id>``, with ``-1``, ``-2``, ... appended when
    the name is taken within the same second.
    """
    base = os.fspath(wandb_dir)
    if os.path.isdir(os.path.join(base, "wandb")):
        base = os.path.join(base, "wandb")
    pattern = re.compile(
        r"(?:offline-)?run-(\d{8}_\d{6})-"
        + (re.escape(run_id) + r"(?:-(\d+))?" if run_id is not None else r".*()")
        + r"$"
    )
    found = []
    for d in glob.glob(os.path.join(base, "*run-*")):
        m = pattern.fullmatch(os.path.basename(d))
        if m is None or not os.path.isdir(d) or os.path.islink(d) or not glob.glob(os.path.join(d, "run-*.wandb")):
            continue
        found.append(((m.group(1), int(m.group(2) or 0), os.path.basename(d)), d))
    return [d for _, d in sorted(found)]


def read_run(run_dir_or_file: str, wait_for_exit_s: float = 30.0) -> RunData:
    """Parse a run file, waiting up to `wait_for_exit_s` for its exit record.

    Returns a `RunData`; ``exit_seen`` tells whether the run was finished (when the wait
    ran out, what was written so far is returned).
    """
    path = run_file(run_dir_or_file)
    deadline = time.monotonic() + max(0.0, wait_for_exit_s)
    while True:
        data = _parse(path)
        if data.exit_seen or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    _load_tables(data)
    return data


__all__ = ["RunData", "RunFileError", "find_run_dirs", "iter_records", "read_run", "run_file"]
