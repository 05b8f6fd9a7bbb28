"""Batches for the export process beyond `queue_max_bytes`, kept on disk until the pipe takes them.

When the export process reads its pipe more slowly than the training process sends (it runs at idle
priority: a busy machine leaves it little CPU), the batches waiting to be sent would pile up in the
training process's memory.  Beyond the budget they wait in an unlinked file instead, in order, each
read back right before it is written to the pipe.  The file is emptied whenever no batch in it is
waited for (not sent yet, or kept to be sent again should the export process die).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ..spool import OFF_VALUES, default_root


class Backlog:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._fd = -1
        self._end = 0
        self._live = 0  # holders of refs into the file: the send queue and the re-delivery copies

    def put(self, payload: bytes) -> tuple[int, int]:
        """Write `payload`; its ref, held twice (until sent, and until settled or forgotten).  OSError if
        the file cannot be written (the caller keeps the batch in memory)."""
        if self._fd < 0:
            os.makedirs(self.directory, exist_ok=True)
            f = tempfile.TemporaryFile(dir=self.directory, prefix="otel-rl-send-")
            self._fd = os.dup(f.fileno())
            f.close()
        ref = (self._end, len(payload))
        if os.pwrite(self._fd, payload, self._end) != len(payload):
            raise OSError("short write")
        self._end += len(payload)
        self._live += 2
        return ref

    def get(self, ref: tuple[int, int]) -> bytes:
        return os.pread(self._fd, ref[1], ref[0])

    def done(self, ref: tuple[int, int]) -> None:
        """One holder of `ref` let it go; the file is emptied once nothing in it is held."""
        self._live -= 1
        if self._live <= 0 and self._fd >= 0:
            self._live = 0
            self._end = 0
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def backlog_for(config: Any) -> Backlog | None:
    """The backlog file's place: the spool directory (None with the spool off: memory only)."""
    raw = getattr(config, "spool_dir", None)
    if isinstance(raw, str) and raw.strip().lower() in OFF_VALUES:
        return None
    return Backlog(os.path.abspath(os.path.expanduser(raw)) if raw else default_root())
