"""A batch the exporter keeps rejecting as bad data, delivered in parts until the bad items are alone.

A batch that fails with a data error (`is_data_error`) `POISON_MAX_ATTEMPTS` times in a row is not
dropped: the delivery thread (otel_rl._delivery_thread) hands it to the exporter in parts -- the part
that failed (its spans, or its records) in halves, the halves that fail in halves again -- and drops only
the single items the exporter still rejects, each counted (`rejected` and `dropped`) and logged with what
it is.  Every other part is delivered once.  The batch stays the one in flight until every part is
delivered or rejected: a spool frame is acknowledged only then, whatever the batch came from (memory,
gathered, the spool after an outage, `otel-rl replay`).  A delivery error that is not about the data
(the tracker goes down meanwhile) is retried with backoff as always, on the same part.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from .records import Generations, RunStart, StepMetrics, Trajectory
from .semconv import RL_STEP

_log = logging.getLogger("otel_rl")
#: rejected items logged one by one up to this many per queue, then one line per this many more
REJECTS_LOGGED = 20
REJECTS_LOG_EVERY = 1000


class Isolation:
    """The parts of one rejected batch still to deliver, oldest first: ("spans" | "records", items)."""

    __slots__ = ("todo", "rejected")

    def __init__(self, spans: list, records: list, spans_done: bool) -> None:
        todo: deque[tuple[str, list]] = deque()
        if spans and not spans_done:
            # the spans' call failed (it comes first): the records were not handed over yet
            todo.append(("spans", spans))
            if records:
                todo.append(("records", records))
        else:
            todo.append(("records", records))
        self.todo = todo  # the first part is the one that failed
        self.rejected = 0  # items dropped as bad data

    def refused(self) -> Any:
        """The first part was rejected as bad data: it is halved, or, a single item, dropped and returned."""
        kind, items = self.todo.popleft()
        if len(items) > 1:
            mid = len(items) // 2
            self.todo.appendleft((kind, items[mid:]))
            self.todo.appendleft((kind, items[:mid]))
            return None
        self.rejected += len(items)
        return items[0] if items else None


def describe(item: Any) -> str:
    """What a rejected item is, for the log: a record's kind, keys and step; a span's name and step."""
    run = getattr(getattr(item, "run", None), "run_id", None)
    of_run = f" of run {run!r}" if run is not None else ""
    if isinstance(item, StepMetrics):
        keys = list(item.values)
        shown = ", ".join(map(repr, keys[:8])) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
        return f"the metrics {shown or '(none)'} at step {item.step}{of_run}"
    if isinstance(item, Generations):
        return f"the generations table ({len(item.rows)} rows) at step {item.step}{of_run}"
    if isinstance(item, Trajectory):
        return f"trajectory {item.name!r} (trace {item.trace_id:032x}) at step {item.step}{of_run}"
    if isinstance(item, RunStart):
        return f"the run start (config){of_run}"
    name = getattr(item, "name", None)
    if isinstance(name, str):
        attrs = getattr(item, "attributes", None)
        step = attrs.get(RL_STEP) if isinstance(attrs, Mapping) else None
        return f"span {name!r}" + (f" at step {step}" if step is not None else "")
    return type(item).__name__


def log_rejected(exporter: str, item: Any, exc: BaseException, n: int) -> None:
    """The `n`-th item of queue `exporter` rejected as bad data: one line naming it (every one of the first
    `REJECTS_LOGGED`, then one per `REJECTS_LOG_EVERY`)."""
    if n > REJECTS_LOGGED and n % REJECTS_LOG_EVERY:
        return
    more = "" if n <= REJECTS_LOGGED else f" ({n} rejected so far; not every one is logged)"
    _log.warning(
        "otel-rl: exporter %r rejected %s as bad data (%s: %s); dropped it, the rest of its batch is delivered%s",
        exporter,
        describe(item),
        type(exc).__name__,
        str(exc)[:300],
        more,
    )
