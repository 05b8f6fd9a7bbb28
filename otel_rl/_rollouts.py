"""Rollout deferral: while trajectories are open, the pipeline worker leaves its batches queued.

Rollouts are where the training thread runs the most Python per second (agent loops, tools,
detokenizing): the worker's batches (packing spans, building records, handing them to the exporters)
would take the interpreter lock from it there.  Deferred, they run after the rollouts, while the
training thread is mostly in torch, which leaves the lock.  `trajectory` (otel_rl.instrument) calls
`started` and `ended`; the worker asks `left` how long it may still wait (docs/configuration.md,
`rollout_defer_s`).
"""

from __future__ import annotations

import math
import time
from collections import deque

#: a trajectory that opens within this long of the last one's end goes on with that stretch of rollouts
_REOPEN_S = 0.05


class RolloutDeferral:
    def __init__(self, defer_s: float) -> None:
        self.defer_s = defer_s
        self._open: deque = deque()  # one entry per open trajectory (a deque's append and pop are atomic)
        self._busy_since = 0.0
        self._last_close = -math.inf  # when the last open trajectory closed
        self.deferrals = 0  # how often the worker looked in and left its batches queued for open rollouts

    @property
    def open(self) -> int:
        return len(self._open)

    def started(self) -> None:
        """A trajectory opened (the training thread is rolling out).  One that opens within `_REOPEN_S`
        of the last one's end (trajectories run one after another) goes on with that stretch of rollouts
        rather than starting a new one.  No lock: two threads opening the first two at once may both see
        two open, and leave the stretch's start time at the last stretch's, which only ends this
        stretch's deferral early."""
        o = self._open
        o.append(None)
        if len(o) == 1:
            now = time.monotonic()
            if now - self._last_close > _REOPEN_S:
                self._busy_since = now

    def ended(self) -> None:
        """A trajectory closed (the worker, if it is leaving batches queued, sees the last one's end at
        its next look)."""
        o = self._open
        try:
            o.pop()
        except IndexError:
            return
        if not o:
            self._last_close = time.monotonic()

    def left(self) -> float:
        """Seconds the worker may still leave its batches queued for the open rollouts (0 or less: none
        open, or past `defer_s` of this stretch)."""
        if self.defer_s <= 0 or not self._open:
            return 0.0
        return self._busy_since + self.defer_s - time.monotonic()
