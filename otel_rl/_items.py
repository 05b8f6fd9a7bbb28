"""What callers hand the pipeline (`Pipeline.submit`) besides finished spans, and the record spans the
worker makes of them.

`log()` and `log_generations()` queue a `LogItem` / `GenerationsItem` (a deque append on the training
thread); the pipeline worker turns each into its `rl.log` / `rl.generations` span (`log_span`,
`generations_span`): a light span (`otel_rl._lightspan`), made ended.  The other types are the worker's
control items: a flush request, an exporter added mid-run, the start of the records spilled to the
overflow file.
"""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import AttributeValue

from . import semconv as sc
from ._lightspan import LightSpan, ended_span


class LogItem:
    # only: names of the exporters this item goes to (None: all of them)
    __slots__ = ("step", "values", "time_ns", "parent", "only")

    def __init__(
        self, step: int, values: dict, time_ns: int, parent: SpanContext | None, only: frozenset[str] | None = None
    ):
        self.step = step
        self.values = values
        self.time_ns = time_ns
        self.parent = parent
        self.only = only


class GenerationsItem:
    __slots__ = ("step", "rows", "time_ns", "only")

    def __init__(self, step: int, rows: list, time_ns: int, only: frozenset[str] | None = None):
        self.step = step
        self.rows = rows
        self.time_ns = time_ns
        self.only = only


class TrajectoryStat:
    """Duration/outcome of a trajectory that was not traced (kept for the metrics)."""

    __slots__ = ("duration_s", "validate", "error")

    def __init__(self, duration_s: float, validate: bool, error: bool):
        self.duration_s = duration_s
        self.validate = validate
        self.error = error


class AddQueue:
    """Attach a delivery queue at this point of the item stream (see Pipeline.add_exporter)."""

    __slots__ = ("queue",)

    def __init__(self, queue: Any) -> None:
        self.queue = queue


class FlushMarker:
    # seq: records put into the pipeline's overflow before this flush request (delivered before it is done)
    __slots__ = ("event", "seq")

    def __init__(self, seq: int = 0) -> None:
        self.event = threading.Event()
        self.seq = seq


class OverflowStart:
    """Queued after the last item that came before the overflow's first record: from here on the worker
    takes the overflow's records (older ones are all taken)."""

    __slots__ = ()


def log_span(item: LogItem, context: SpanContext, resource: Resource, scope: InstrumentationScope) -> LightSpan:
    """The `rl.log` span of a `log()` call."""
    # every key in call order with its value as a double; ints and bools also
    # exactly, in their own typed arrays (see docs/semconv.md)
    keys = tuple(item.values)
    ik, iv, bk, bv = [], [], [], []
    for k, v in item.values.items():
        t = type(v)
        if t is int:
            ik.append(k)
            iv.append(v)
        elif t is bool:
            bk.append(k)
            bv.append(v)
    attrs: dict[str, Any] = {
        sc.RL_STEP: item.step,
        sc.RL_SPAN_KIND: sc.KIND_METRICS,
        sc.RL_METRICS_KEYS: keys,
        sc.RL_METRICS_VALUES: tuple(_as_double(v) for v in item.values.values()),
    }
    if ik:
        attrs[sc.RL_METRICS_INT_KEYS] = tuple(ik)
        attrs[sc.RL_METRICS_INT_VALUES] = tuple(iv)
    if bk:
        attrs[sc.RL_METRICS_BOOL_KEYS] = tuple(bk)
        attrs[sc.RL_METRICS_BOOL_VALUES] = tuple(bv)
    return ended_span(sc.SPAN_LOG, context, item.parent, attrs, item.time_ns, item.time_ns, resource, scope)


def generations_span(
    item: GenerationsItem, context: SpanContext, resource: Resource, scope: InstrumentationScope
) -> LightSpan:
    """The `rl.generations` span of a `log_generations()` call."""
    attrs: dict[str, AttributeValue] = {
        sc.RL_STEP: item.step,
        sc.RL_SPAN_KIND: sc.KIND_METRICS,
        sc.RL_GENERATIONS_INPUTS: tuple(r[0] for r in item.rows),
        sc.RL_GENERATIONS_OUTPUTS: tuple(r[1] for r in item.rows),
        sc.RL_GENERATIONS_SCORES: tuple(r[2] for r in item.rows),
    }
    return ended_span(sc.SPAN_GENERATIONS, context, None, attrs, item.time_ns, item.time_ns, resource, scope)


def _as_double(v: Any) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond double range: exact value is in the int array
        return float("inf") if v > 0 else float("-inf")
