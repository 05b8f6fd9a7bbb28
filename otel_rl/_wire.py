"""Spans as plain tuples, for the export process.

With tracker exporters in the export process (`otel_rl.export_process`), the training process does
not build trajectory records: the pipeline packs each ended span into a tuple of plain values
(cheap to make and to pickle) and the export process unpacks them into `WireSpan`s, which
offer what `otel_rl.records.RecordBuilder` reads of a span, and builds the records there.

A packed span::

    (trace_id, span_id, parent_span_id or 0, name, start_ns, end_ns, attributes (a dict),
     events (None or a tuple of (name, time_ns, attributes)), status code name, status description
     [, token2text job: (tokenizer key, prompt ids or None, response ids or None)])

An op's inputs and output may be in the attributes as copies (bytes, `otel_rl.serialize.snapshot`):
the receiving side makes them into JSON text (`materialize`) and decodes the token2text jobs
(`otel_rl._token2text.decode_packed`) before it unpacks.

Links are not carried: trajectory records do not use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._lightspan import _UNSET as UNSET_STATUS
from ._lightspan import CONTEXT_IS_TUPLE, LightSpan
from .serialize import DEFERRED_KEYS, to_json


def pack(span: Any, decode: tuple | None = None) -> tuple:
    """A `LightSpan` (ended) or an SDK `ReadableSpan` as a tuple (attributes copied); `decode`: its
    token2text job, if it has one for the receiving side."""
    if type(span) is LightSpan:
        ctx, parent, name, start, end = span._context, span._parent, span._name, span._start, span._end
        attrs, events, st = span._attributes, span._events, span._status
    else:
        ctx, parent, name, start, end = span.context, span.parent, span.name, span.start_time or 0, span.end_time or 0
        attrs, events, st = span.attributes or {}, span.events, span.status
        attrs = _foreign_bytes_as_text(attrs)
    if CONTEXT_IS_TUPLE:  # (trace_id, span_id, ...): read without the API's properties
        ids = (ctx[0], ctx[1], parent[1] if parent is not None else 0)
    else:  # pragma: no cover - an API whose SpanContext is laid out otherwise
        ids = (ctx.trace_id, ctx.span_id, parent.span_id if parent is not None else 0)
    code, desc = ("UNSET", None) if st is UNSET_STATUS else (st.status_code.name, st.description)
    packed = (
        *ids,
        name,
        start,
        end,
        dict(attrs),
        tuple((e.name, e.timestamp, dict(e.attributes or {})) for e in events) if events else None,
        code,
        desc,
    )
    return packed if decode is None else (*packed, decode)


def _foreign_bytes_as_text(attrs: Any) -> Any:
    """An op's inputs or output as bytes are a copy to unpickle (`serialize.materialize`) only in
    otel-rl's own light spans; in any other span (one received over OTLP by the bridge, say) they are
    data, and go on as the JSON text of those bytes, never to be unpickled."""
    foreign = {k: to_json(bytes(v))[0] for k in DEFERRED_KEYS if isinstance(v := attrs.get(k), (bytes, bytearray))}
    return {**attrs, **foreign} if foreign else attrs


class _Ctx:
    __slots__ = ("trace_id", "span_id")

    def __init__(self, trace_id: int, span_id: int):
        self.trace_id = trace_id
        self.span_id = span_id


class _Status:
    __slots__ = ("status_code", "description")

    def __init__(self, code: str, description: str | None):
        self.status_code = code  # records._status reads `.name` if present, else str(): the name itself
        self.description = description


class _Event:
    __slots__ = ("name", "timestamp", "attributes")

    def __init__(self, name: str, timestamp: int, attributes: dict):
        self.name = name
        self.timestamp = timestamp
        self.attributes = attributes


class _Resource:
    __slots__ = ("attributes",)

    def __init__(self, attributes: Mapping[str, Any]):
        self.attributes = attributes


class WireSpan:
    """An unpacked span: the parts of a `ReadableSpan` that the record builder reads."""

    __slots__ = (
        "name",
        "context",
        "parent",
        "attributes",
        "events",
        "status",
        "start_time",
        "end_time",
        "resource",
        "seq",
    )

    def __init__(self, t: tuple, resource: _Resource, seq: int = 0):
        trace_id, span_id, parent_id, self.name, self.start_time, self.end_time, self.attributes, events, code, desc = (
            t if len(t) == 10 else t[:10]
        )
        self.context = _Ctx(trace_id, span_id)
        self.parent = _Ctx(trace_id, parent_id) if parent_id else None
        self.events = tuple(_Event(*e) for e in events) if events else ()
        self.status = _Status(code, desc)
        self.resource = resource
        self.seq = seq  # the batch it came in (the export process settles batches by it)


def unpack(packed: Iterable[tuple], resource_attributes: Mapping[str, Any], seq: int = 0) -> list[WireSpan]:
    res = _Resource(resource_attributes)
    return [WireSpan(t, res, seq) for t in packed]
