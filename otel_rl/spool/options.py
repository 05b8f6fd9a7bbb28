"""What a spool is opened with (`SpoolOptions`), what it hands the delivery thread (`Frame`), and the
error of a spool directory another process holds (`SpoolBusy`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FSYNC_POLICIES = ("always", "batch", "never")
DROP_POLICIES = ("drop_oldest", "drop_newest")


class SpoolBusy(RuntimeError):
    """The spool directory is locked by another live process."""


@dataclass
class SpoolOptions:
    """Where and how one exporter queue spools.  `otel_rl.spool.options_for` builds it from a Config."""

    path: str
    max_bytes: int = 1 << 30
    drop_policy: str = "drop_oldest"
    fsync: str = "batch"
    segment_bytes: int = 0  # 0: max(64 KiB, min(16 MiB, max_bytes // 8))
    write_through: bool = False  # every put() is written to the spool before it returns
    exact: bool = False  # use `path` even when locked (raise SpoolBusy); else fall back to a sibling
    remove_parent_if_empty: bool = False  # remove the parent directory too when the spool is cleaned up
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"spool fsync policy must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"spool drop policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}")
        if self.max_bytes <= 0:
            raise ValueError("spool max_bytes must be > 0")
        if not self.segment_bytes:
            self.segment_bytes = max(64 << 10, min(16 << 20, self.max_bytes // 8))


@dataclass
class Frame:
    """One frame handed to the delivery thread."""

    seq: int
    index: int
    offset: int
    end: int
    n_items: int
    payload: bytes
