"""Tokenizers for the token2text tests of the export process (importable there: tests/ is on its path)."""

from __future__ import annotations

import os
import threading


class CountingTokenizer:
    """ids -> letters (0 -> 'a'); counts the `batch_decode` calls made on this object, in this process
    (a pickled copy in another process counts its own)."""

    def __init__(self):
        self.calls = 0

    def batch_decode(self, seqs, skip_special_tokens=False):
        self.calls += 1
        return ["".join(chr(ord("a") + i) for i in s) for s in seqs]


class LockedTokenizer(CountingTokenizer):
    """The same, holding a lock: it cannot be pickled, so it cannot go to the export process."""

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()


def _rebuild_at_home(pid: int) -> "HomeboundTokenizer":
    if os.getpid() != pid:
        raise RuntimeError("this tokenizer only loads in the process that made it")
    return HomeboundTokenizer()


class HomeboundTokenizer(CountingTokenizer):
    """The same; it pickles, but loading it in any other process fails."""

    def __reduce__(self):
        return (_rebuild_at_home, (os.getpid(),))
