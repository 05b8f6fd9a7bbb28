"""The spool's on-disk format (segment header, frame, ack slot) and the file helpers it is written
with.  `fsync_dir` and `write_all` are public: tracker plug-ins that write their own files make them
durable the same way (a new or renamed file survives a crash only once its directory is fsynced).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any

SEGMENT_MAGIC = b"OTELRLSP"
SEGMENT_VERSION = 1
SEG_HEADER = struct.Struct("<8sH6x")
SEGMENT_HEADER_BYTES = SEG_HEADER.size  # 16
FRAME_MAGIC = b"\xf5RLF"
FRAME_HEADER = struct.Struct("<4sII")
FRAME_HEADER_BYTES = FRAME_HEADER.size  # 12
MAX_FRAME_BYTES = 1 << 30
ACK = struct.Struct("<4sQQQI")  # magic, counter, segment, offset, crc32 of the rest
ACK_MAGIC = b"ORLA"
ACK_SLOT_BYTES = ACK.size + 4  # 32 with padding
META_FORMAT = 1


def frame_bytes(payload: bytes) -> bytes:
    n = len(payload)
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<I", n)))
    return FRAME_HEADER.pack(FRAME_MAGIC, n, crc) + payload


def frame_at(data: bytes | memoryview, pos: int, size: int) -> int:
    """Length of the valid frame at `pos`, or -1."""
    if pos + FRAME_HEADER_BYTES > size:
        return -1
    magic, n, crc = FRAME_HEADER.unpack_from(data, pos)
    if magic != FRAME_MAGIC or n > MAX_FRAME_BYTES or pos + FRAME_HEADER_BYTES + n > size:
        return -1
    start = pos + FRAME_HEADER_BYTES
    if zlib.crc32(data[start : start + n], zlib.crc32(struct.pack("<I", n))) != crc:
        return -1
    return n


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to the file descriptor `fd` (os.write may write less)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str) -> None:
    """fsync the directory `path` (its entries: new, renamed and removed files); errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        return json.load(f)
