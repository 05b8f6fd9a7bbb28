"""What a queued batch is counted as against `queue_max_bytes`, and memory given back after a backlog.

CPython keeps the memory of freed objects for reuse: small objects in its own arenas, larger blocks in
the C library's heap.  After a backlog (a tracker that was down, everything it missed delivered at
once) that memory would stay with the process for its whole life.  `release_memory` hands the free
pages of the C heap back to the system (glibc's ``malloc_trim``; elsewhere nothing is done).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
import threading
from collections.abc import Callable

#: a batch whose size is not known is counted as this many bytes an item (a record or a span)
ITEM_BYTES = 1024
#: once this much of a backlog is delivered, what it freed goes back to the system (`release_memory`)
RELEASE_BYTES = 8 << 20
#: a batch shipped to the export process takes about this many times its pickled size in memory there
SHIPPED_FACTOR = 3

#: `release_memory` collects cycles first: set by the export process, whose heap is its own work (in a
#: training process a full collection would cost the training thread the time to scan all of its heap)
collect_cycles = False

_lock = threading.Lock()
_trim: Callable[[int], int] | None = None
_looked = False


def _malloc_trim() -> Callable[[int], int] | None:
    global _trim, _looked
    with _lock:
        if not _looked:
            _looked = True
            if sys.platform.startswith("linux"):
                try:
                    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                    fn = libc.malloc_trim  # glibc only (not musl)
                    fn.argtypes = [ctypes.c_size_t]
                    fn.restype = ctypes.c_int
                    _trim = fn
                except (OSError, AttributeError):
                    _trim = None
        return _trim


def release_memory() -> bool:
    """Give the free pages of the C heap back to the system; whether it could (glibc)."""
    if collect_cycles:
        gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)  # (ctypes lets the interpreter lock go for the call)
    return True
