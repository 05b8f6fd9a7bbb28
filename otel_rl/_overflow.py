"""Where `log()` and `log_generations()` records go while the pipeline's queue is full.

The pipeline's in-memory queue holds at most `queue_size` items.  Spans beyond that are shed
(counted per kind); records are never dropped: with ``record_overflow=spill`` (the default) they are
appended to a spill file on disk, in order, and the pipeline thread reads them back once it has
taken everything that was queued before the first of them; with ``record_overflow=wait`` (or when no
spill file can be written) the caller waits until there is room.  docs/delivery.md.

The spill file is private to the process: created in the spool directory and unlinked at once, so
the kernel removes it when the process ends, however it ends.  Frames are pickled lists of plain
tuples, written by whichever caller thread fills the in-memory chunk (`CHUNK` records), so a
record costs its caller one list append, and every `CHUNK`-th one pickles and writes them.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import tempfile
import threading
from collections import deque

_log = logging.getLogger("otel_rl")
CHUNK = 512  # records held in memory before they are written to the spill file together
_LEN = struct.Struct("<I")


class Overflow:
    """A FIFO of records: a spill file (older) followed by an in-memory chunk (newer)."""

    def __init__(self, directory: str | None):
        self._lock = threading.Lock()  # one writer or reader of the file and the chunk at a time
        self._dir = directory
        self._fd: int | None = None
        self._made_dir: str | None = None
        self._write_off = 0
        self._read_off = 0
        self._frames: deque[tuple[int, int]] = deque()  # (offset, records) of frames not read yet
        self._chunk: list[tuple] = []
        self.count = 0  # records in here (racy reads are fine: see Pipeline.submit)
        self.put_total = 0  # records ever put (flush markers wait until this many have been taken)
        self.taken_total = 0
        self.spilled = 0  # records written to the file (cumulative)
        self.disk_failed = False  # the file cannot be written: callers wait instead

    def put(self, rec: tuple) -> int:
        """Add one record (a plain tuple): 2 when it is the first one since this was empty, 1 when it
        is not, 0 when it could not be kept (the caller waits instead)."""
        with self._lock:
            if self.disk_failed:
                return 0
            self._chunk.append(rec)
            self.count += 1
            self.put_total += 1
            if len(self._chunk) >= CHUNK:
                self._write_chunk()
            return 2 if self.count == 1 else 1

    def _write_chunk(self) -> None:
        """Under the lock.  On a disk error the chunk stays in memory (it is read from there) and
        later records make their callers wait."""
        chunk = self._chunk
        try:
            if self._fd is None:
                directory = self._dir or tempfile.gettempdir()
                if not os.path.isdir(directory):
                    os.makedirs(directory)
                    self._made_dir = directory  # removed again at close when nothing else is in it
                fd, path = tempfile.mkstemp(prefix="otel-rl-records-", suffix=".spill", dir=directory)
                os.unlink(path)  # private to this process; gone with it
                self._fd = fd
            data = pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)
            buf = _LEN.pack(len(data)) + data
            off = self._write_off
            done = 0
            while done < len(buf):
                done += os.pwrite(self._fd, buf[done:], off + done)
        except OSError as exc:
            self.disk_failed = True
            _log.warning(
                "otel-rl: cannot write the record spill file in %s (%s); while the pipeline is behind, "
                "log() waits for room instead",
                self._dir,
                exc,
            )
            return
        self._frames.append((off, len(chunk)))
        self._write_off = off + len(buf)
        self.spilled += len(chunk)
        self._chunk = []

    def take(self) -> tuple[list[tuple], bool]:
        """The oldest records (a frame of the file, else the in-memory chunk; [] when empty), and whether
        nothing is left after them."""
        with self._lock:
            fd = self._fd
            if self._frames and fd is not None:  # (frames are only ever written to an open file)
                off, n = self._frames.popleft()
                (size,) = _LEN.unpack(os.pread(fd, _LEN.size, off))
                data = os.pread(fd, size, off + _LEN.size)
                out = pickle.loads(data)
                self._read_off = off + _LEN.size + size
            else:
                out, self._chunk = self._chunk, []
            self.count -= len(out)
            self.taken_total += len(out)
            if not self.count and self._fd is not None and self._write_off:
                self._reset_file()
            if not self.count:
                self.disk_failed = False  # all read back: the disk gets another chance next time
            return out, not self.count

    def _reset_file(self) -> None:
        try:
            if self._fd is not None:
                os.ftruncate(self._fd, 0)
        except OSError:
            pass
        self._read_off = self._write_off = 0

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None
            if self._made_dir is not None:
                try:
                    os.rmdir(self._made_dir)
                except OSError:  # not empty: a spool lives there too
                    pass
                self._made_dir = None
