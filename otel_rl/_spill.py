"""The disk side of a delivery queue (otel_rl._delivery): its spool, written and read back.

A `Spiller` writes batches to the queue's spool (`write`), reads back frames (`read`), keeps the
batches it wrote in memory while they fit so that a write-through queue delivers them without reading
them back (`take_cached`), delivers first what an earlier process left (`recover`), and says what it
keeps at the end (`close`).  The queue decides when: on a failing exporter, over its memory bound, on a
flush that times out, at shutdown.  Every method runs under the queue's io lock, never under its
condition (file I/O must not hold up callers of `put`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ._values import warn_once

_log = logging.getLogger("otel_rl")
#: after a spool cannot be opened or written, memory only for this long before the next try
_RETRY_S = 10.0


class Spiller:
    def __init__(self, spool: Any, name: str, cache_max_items: int) -> None:
        self.spool = spool  # otel_rl.spool.Spool
        self.name = name
        self.write_through = bool(spool.options.write_through)
        self._cache: dict[tuple[int, int], Any] = {}  # write-through: frames still in memory, as their batch
        self._cache_items = 0
        self._cache_max = cache_max_items
        self._retry_at = 0.0
        self._drop_logged_at = 0.0
        self._dropped_seen = 0
        self._left_logged = False

    @property
    def pending(self) -> bool:
        """Frames written and not delivered yet (with the spool open)."""
        sp = self.spool
        return bool(sp.opened and sp.pending_frames)

    @property
    def dirty(self) -> bool:
        """Writes not yet fsynced."""
        sp = self.spool
        return bool(sp.opened and sp.dirty)

    def ready(self) -> bool:
        """Open (create) the spool if needed; False while it cannot be (memory only meanwhile)."""
        sp = self.spool
        if sp.opened:
            return True
        if time.monotonic() < self._retry_at:
            return False
        from .spool import SpoolBusy

        try:
            sp.open(create=True)
        except (OSError, SpoolBusy) as exc:
            self._retry_at = time.monotonic() + _RETRY_S
            warn_once(
                f"spool-open:{self.name}",
                "otel-rl: exporter %r: cannot use the spool directory %s (%s); queueing in memory only",
                self.name,
                sp.options.path,
                exc,
            )
            return False
        return True

    def write(self, todo: list, inflight: Any) -> tuple[int, int, list]:
        """Write the batches `todo` (oldest first; `inflight`, if one of them, is being delivered) to the
        spool: (items written, items dropped as unwritable, the batches kept in memory because the
        spool cannot be written now).  A written batch gets its `frame`."""
        from .spool.codec import CodecError, encode_batch

        sp = self.spool
        written = dropped = capped = 0
        back: list = []
        for i, e in enumerate(todo):
            is_inflight = e is inflight
            try:
                payload = encode_batch(e.spans, e.records)
            except CodecError as exc:
                if is_inflight:
                    e.unspoolable = True  # it is being delivered from memory anyway
                else:
                    dropped += e.n
                    _log.error(
                        "otel-rl: exporter %r: a batch cannot be written to the spool (%s); dropped its %d items",
                        self.name,
                        exc,
                        e.n,
                    )
                continue
            try:
                frame, lost = sp.append(payload, e.n, inflight=is_inflight)
            except OSError as exc:
                back = [x for x in todo[i:] if x is not inflight]
                self._retry_at = time.monotonic() + _RETRY_S
                warn_once(
                    f"spool-write:{self.name}:{type(exc).__name__}",
                    "otel-rl: exporter %r: cannot write its spool %s (%s); keeping batches in memory",
                    self.name,
                    sp.path,
                    exc,
                )
                break
            capped += lost
            if frame is None:
                if is_inflight:
                    e.unspoolable = True
                continue
            if is_inflight:
                e.frame = frame
            elif self.write_through and self._cache_items + e.n <= self._cache_max:
                e.frame = frame
                self._cache[(frame.seq, frame.index)] = e
                self._cache_items += e.n
            written += e.n
        if capped:
            self._log_cap_drop()
        return written, dropped, back

    @property
    def has_cached(self) -> bool:
        """Batches written through are still in memory (delivered from there, frame by frame)."""
        return bool(self._cache)

    def take_cached(self, frame: Any) -> Any:
        """The batch of the spool's next `frame` if it is still in memory (write-through), else None."""
        if not self._cache:
            return None
        key = (frame.seq, frame.index)
        for k in list(self._cache):  # frames before this one were dropped or skipped
            if k >= key:
                break
            self._cache_items -= self._cache.pop(k).n
        e = self._cache.pop(key, None)
        if e is not None:
            self._cache_items -= e.n
            e.frame = frame
        return e

    def read(self, frame: Any) -> tuple[list, list] | None:
        """(spans, records) of `frame`; None when it cannot be decoded (logged: the caller skips it)."""
        from .spool.codec import CodecError, decode_batch

        try:
            return decode_batch(frame.payload)
        except CodecError as exc:
            _log.warning(
                "otel-rl: exporter %r: spool %s frame at %d:%d cannot be read (%s); skipped %d items",
                self.name,
                self.spool.path,
                frame.seq,
                frame.offset,
                exc,
                frame.n_items,
            )
            return None

    def sync(self) -> None:
        try:
            self.spool.sync()
        except OSError as exc:
            warn_once(
                f"spool-fsync:{self.name}",
                "otel-rl: exporter %r: fsync of spool %s failed: %s",
                self.name,
                self.spool.path,
                exc,
            )

    def recover(self) -> None:
        """A spool directory left by an earlier process: open it, so that its frames go first."""
        from .spool import SpoolBusy

        sp = self.spool
        try:
            if not sp.opened and not sp.exists():
                return
            if not sp.open(create=False):
                return
        except SpoolBusy:
            return  # another live process owns it; a spill here uses a sibling directory
        except OSError as exc:
            warn_once(
                f"spool-open:{self.name}",
                "otel-rl: exporter %r: cannot read the spool %s (%s)",
                self.name,
                sp.options.path,
                exc,
            )
            return
        if sp.recovered_items:
            _log.warning(
                "otel-rl: exporter %r: %d items (%d bytes) left in spool %s by an earlier process; "
                "delivering them first",
                self.name,
                sp.recovered_items,
                sp.bytes,
                sp.path,
            )

    def close(self) -> None:
        """End of the queue: close the spool (removed when empty), saying what it keeps."""
        sp = self.spool
        pending, nbytes, path = sp.pending_items, sp.bytes, sp.path
        if sp.opened:
            sp.close(remove_if_empty=True)
        if pending:
            self.log_left(pending, nbytes, path)

    def log_left(self, pending: int, nbytes: int, path: str) -> None:
        if self._left_logged:
            return
        self._left_logged = True
        _log.warning(
            "otel-rl: exporter %r: %d items (%d bytes) kept in spool %s; they are delivered at the next "
            "start with the same spool directory, or now with `otel-rl replay %s`",
            self.name,
            pending,
            nbytes,
            path,
            path,
        )

    def _log_cap_drop(self) -> None:
        sp = self.spool
        now = time.monotonic()
        total = sp.dropped_items
        if total == self._dropped_seen or now - self._drop_logged_at < 10.0:
            return
        _log.warning(
            "otel-rl: spool of exporter %r is full (spool_max_bytes=%d); dropped %d items so far "
            "(spool_drop_policy=%s), %d since the last report",
            self.name,
            sp.options.max_bytes,
            total,
            sp.options.drop_policy,
            total - self._dropped_seen,
        )
        self._dropped_seen = total
        self._drop_logged_at = now


def make_spool(spool: Any, config: Any, exporter: Any) -> Any:
    """The `Spool` of an exporter's queue: `spool` itself, or from its options, or derived from `config`
    (None: memory only)."""
    if spool is None and config is None:
        return None
    from .spool import Spool, SpoolOptions, options_for

    if isinstance(spool, Spool):
        return spool
    try:
        opts = spool if isinstance(spool, SpoolOptions) else options_for(config, exporter)
    except (ValueError, TypeError) as exc:
        _log.warning(
            "otel-rl: exporter %r: spool settings not usable (%s); queueing in memory only",
            getattr(exporter, "name", "?"),
            exc,
        )
        return None
    return Spool(opts) if opts is not None else None
