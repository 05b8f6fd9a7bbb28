"""Frames on the export process's pipes: a 4-byte little-endian length, then a pickle of one message."""

from __future__ import annotations

import pickle
import struct
from typing import Any, BinaryIO

_HEADER = struct.Struct("<I")


def write_frame(f: BinaryIO, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_HEADER.pack(len(data)))
    f.write(data)
    f.flush()


def read_frame(f: BinaryIO) -> Any:
    """The next message; None at the end of the pipe (or a frame torn by it)."""
    header = f.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(header)
    data = f.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)
