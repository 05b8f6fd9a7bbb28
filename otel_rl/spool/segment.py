"""One segment file of a spool: the index of its frames (`Segment`), built by reading the file back and
validating every frame (`scan_segment`); and the ack file's two slots (`read_ack`, `ack_slot`)."""

from __future__ import annotations

import os
import struct
import zlib
from array import array
from collections.abc import Callable

from .codec import CodecError, batch_items
from .files import (
    ACK,
    ACK_MAGIC,
    ACK_SLOT_BYTES,
    FRAME_HEADER_BYTES,
    FRAME_MAGIC,
    SEG_HEADER,
    SEGMENT_HEADER_BYTES,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    frame_at,
)

#: ``corrupt(path, offset, nbytes, what)``: a corrupt region found while scanning (counted and logged)
Corrupt = Callable[[str, int, int, str], None]


class Segment:
    __slots__ = ("seq", "path", "size", "offs", "lens", "items", "next")

    def __init__(self, seq: int, path: str, size: int):
        self.seq = seq
        self.path = path
        self.size = size
        self.offs = array("Q")  # frame start offsets
        self.lens = array("Q")  # frame lengths (header included)
        self.items = array("Q")  # items per frame
        self.next = 0  # index of the next undelivered frame

    def pending_items(self) -> int:
        return sum(self.items[self.next :])


def read_ack(fd: int) -> tuple[int, int, int] | None:
    """(counter, segment, offset) of the newest valid slot of the ack file `fd`; None when neither is valid."""
    data = os.pread(fd, 2 * ACK_SLOT_BYTES, 0)
    best = None
    for slot in (0, 1):
        chunk = data[slot * ACK_SLOT_BYTES : slot * ACK_SLOT_BYTES + ACK.size]
        if len(chunk) < ACK.size:
            continue
        magic, counter, seq, off, crc = ACK.unpack(chunk)
        if magic != ACK_MAGIC or zlib.crc32(chunk[:-4]) != crc:
            continue
        if best is None or counter > best[0]:
            best = (counter, seq, off)
    return best


def ack_slot(counter: int, seq: int, off: int) -> bytes:
    """The ack slot saying that delivery got to (`seq`, `off`), the `counter`-th ack written."""
    body = struct.pack("<4sQQQ", ACK_MAGIC, counter, seq, off)
    return body + struct.pack("<I", zlib.crc32(body)) + b"\0" * (ACK_SLOT_BYTES - ACK.size)


def scan_segment(seq: int, path: str, corrupt: Corrupt) -> Segment | None:
    """The index of the segment file `path` (number `seq`), every frame validated; corrupt regions are
    skipped (a torn tail is cut off the file); None, the file removed, when it has no valid header."""
    with open(path, "rb") as f:
        data = f.read()
    size = len(data)
    if size < SEGMENT_HEADER_BYTES or SEG_HEADER.unpack_from(data, 0) != (SEGMENT_MAGIC, SEGMENT_VERSION):
        corrupt(path, 0, size, "no valid segment header")
        os.unlink(path)
        return None
    seg = Segment(seq, path, size)
    pos = SEGMENT_HEADER_BYTES
    view = memoryview(data)
    while pos < size:
        n = frame_at(view, pos, size)
        if n >= 0:
            start = pos + FRAME_HEADER_BYTES
            try:
                items = batch_items(bytes(view[start : start + min(n, 16)]))
            except CodecError as exc:
                corrupt(path, pos, FRAME_HEADER_BYTES + n, f"unreadable batch ({exc})")
                pos = start + n
                continue
            seg.offs.append(pos)
            seg.lens.append(FRAME_HEADER_BYTES + n)
            seg.items.append(items)
            pos = start + n
            continue
        # a corrupt region: skip to the next frame that validates, or to the end (torn tail)
        nxt = data.find(FRAME_MAGIC, pos + 1)
        while nxt != -1 and frame_at(view, nxt, size) < 0:
            nxt = data.find(FRAME_MAGIC, nxt + 1)
        end = size if nxt == -1 else nxt
        corrupt(path, pos, end - pos, "truncated tail" if nxt == -1 else "bad frame (checksum or header)")
        if nxt == -1:
            view.release()
            with open(path, "r+b") as f:  # cut the torn tail; nothing is ever appended to it again
                f.truncate(pos)
            seg.size = pos
            return seg
        pos = nxt
    view.release()
    return seg
