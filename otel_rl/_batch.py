"""The delivery queue's data: one batch (`Entry`) and one exporter's counts (`ExporterStats`)."""

from __future__ import annotations

import time
from typing import Any


class ExporterStats:
    __slots__ = (
        "exported",
        "failed_attempts",
        "dropped",
        "retried",
        "queued",
        "in_memory",
        "spooled",
        "spool_pending",
        "spool_bytes",
        "replayed",
        "corrupt_frames",
        "rejected",
        "shed",
    )

    def __init__(self) -> None:
        self.exported = 0  # items delivered (records + spans)
        self.failed_attempts = 0
        self.dropped = 0  # items given up on: memory overflow without a spool, spool cap, items rejected as bad data
        self.retried = 0
        self.queued = 0  # items not delivered yet: in memory + in the spool
        self.in_memory = 0  # of which only in memory (lost if the process dies)
        self.spooled = 0  # items written to the spool (cumulative)
        self.spool_pending = 0  # items in the spool, not delivered yet
        self.spool_bytes = 0  # bytes of the spool's segment files
        self.replayed = 0  # items delivered from the spool (cumulative; part of `exported`)
        self.corrupt_frames = 0  # spool regions skipped as corrupt (checksum, torn tail, unreadable)
        # records (or a step's points) the tracker refused as bad data, each alone; and items of a batch the
        # exporter kept rejecting that were still rejected alone (otel_rl._isolate; part of `dropped`)
        self.rejected = 0
        self.shed = 0  # spans dropped from a memory queue over its bound (part of `dropped`; records never are)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class Entry:
    """One batch: in memory, and on disk too once it has a spool frame."""

    __slots__ = (
        "spans",
        "records",
        "n",
        "frame",
        "spans_done",
        "unspoolable",
        "t",
        "isolating",
        "seq",
        "prepared",
        "nbytes",
        "frames",
    )

    def __init__(self, spans: list, records: list, n: int, frame: Any = None, seq: int = 0, nbytes: int = 0):
        self.spans = spans
        self.records = records
        self.n = n
        self.nbytes = nbytes  # what it takes in memory, estimated (the queue's byte budget counts it)
        self.seq = seq  # the export process's batch number it came in (0: none); see oldest_unsafe_seq
        self.frame = frame  # otel_rl.spool.store.Frame once written to the spool
        #: the spool frames read back together into this delivery, oldest first (`frame` is the last)
        self.frames: tuple = ()
        self.spans_done = False  # a retry after a records failure does not resend the spans
        self.unspoolable = False  # could not be written (codec error / cap): delivered from memory only
        self.t = time.monotonic()  # when it was queued (export_interval_s counts from the oldest)
        self.isolating: Any = None  # rejected as bad data: delivered in parts (otel_rl._isolate.Isolation)
        self.prepared = False  # handed to the exporter's `prepare` while its delivery gathered

    @staticmethod
    def gather(parts: list[Entry]) -> Entry:
        """One delivery made of several memory batches, in order (their spans, then their records)."""
        spans = [s for p in parts for s in p.spans]
        records = [r for p in parts for r in p.records]
        e = Entry(spans, records, sum(p.n for p in parts), seq=parts[0].seq, nbytes=sum(p.nbytes for p in parts))
        e.t = parts[0].t
        return e


def gather_runs(todo: list[Entry], inflight: Entry | None, max_items: int, max_bytes: int) -> list[Entry]:
    """The batches `todo` (oldest first) of a gathering queue as it would gather them, for its spool: a
    frame is delivered as one call when it is read back, so the delivery after an outage makes as few
    calls as a delivery from memory.  The batch in flight stays alone."""
    out: list[Entry] = []
    group: list[Entry] = []
    n = b = 0
    cap_b = max_bytes or float("inf")
    for e in todo:
        alone = e is inflight
        if group and (alone or n + e.n > max_items or b + e.nbytes > cap_b):
            out.append(group[0] if len(group) == 1 else Entry.gather(group))
            group, n, b = [], 0, 0
        if alone:
            out.append(e)
            continue
        group.append(e)
        n += e.n
        b += e.nbytes
    if group:
        out.append(group[0] if len(group) == 1 else Entry.gather(group))
    return out
