"""Spans as plain tuples, for the export process.

With tracker exporters in the export process (`otel_rl.export_process`), the training process does
not build trajectory records: the pipeline packs each ended span into a tuple of plain values
(cheap to make and to pickle), and the export process unpacks them into the same light spans
(`otel_rl._lightspan.LightSpan`, the SDK's `ReadableSpan`) and builds the records from those.

A packed span::

    (trace_id, span_id, parent_span_id or 0, name, start_ns, end_ns, attributes (a dict),
     events (None or a tuple of (name, time_ns, attributes)), status code (`StatusCode` value),
     status description [, token2text job: (tokenizer key, prompt ids or None, response ids or None)
     or (tokenizer key, `FROM_OUTPUT`)])

An op's inputs and output may be in the attributes as copies (bytes, `otel_rl.serialize.snapshot`):
the unpacked span keeps them, with its token2text job, for `otel_rl._lightspan.materialise`.

Links, the span kind and the instrumentation scope are not carried: trajectory records do not use them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import Status, StatusCode

from ._lightspan import _UNSET as UNSET_STATUS
from ._lightspan import CONTEXT_IS_TUPLE, LightSpan, _new_context, ended_span
from ._values import warn_once
from .serialize import DEFERRED_KEYS, to_json

_UNSET_CODE = StatusCode.UNSET.value


def pack(span: ReadableSpan, decode: tuple | None = None) -> tuple:
    """An ended span as a tuple (attributes copied); `decode`: its token2text job, if it has one for the
    receiving side."""
    ctx, parent = span.context, span.parent
    if CONTEXT_IS_TUPLE:  # (trace_id, span_id, ...): read without the API's properties
        ids = (ctx[0], ctx[1], parent[1] if parent is not None else 0)
    else:  # pragma: no cover - an API whose SpanContext is laid out otherwise
        ids = (ctx.trace_id, ctx.span_id, parent.span_id if parent is not None else 0)
    attrs = span.attributes or {}
    if not (type(span) is LightSpan and span._deferred):
        attrs = _foreign_bytes_as_text(attrs)
    events = span.events
    st = span.status
    code, desc = (_UNSET_CODE, None) if st is UNSET_STATUS else (st.status_code.value, st.description)
    packed = (
        *ids,
        span.name,
        span.start_time or 0,
        span.end_time or 0,
        dict(attrs),
        tuple((e.name, e.timestamp, dict(e.attributes or {})) for e in events) if events else None,
        code,
        desc,
    )
    return packed if decode is None else (*packed, decode)


def _foreign_bytes_as_text(attrs: Any) -> Any:
    """An op's inputs or output as bytes are a copy to unpickle (`serialize.materialize`) only in a light
    span that the op wrapper left them in; in any other span (one received over OTLP by the bridge, say)
    they are data, and go on as the JSON text of those bytes, never to be unpickled."""
    foreign = {k: to_json(bytes(v))[0] for k in DEFERRED_KEYS if isinstance(v := attrs.get(k), (bytes, bytearray))}
    return {**attrs, **foreign} if foreign else attrs


def unpack(packed: Iterable[tuple], resource: Resource, tokenizers: Mapping[int, Any] | None = None) -> list[LightSpan]:
    """Packed spans as ended light spans of `resource`, with their copies and token2text jobs
    (`tokenizers`: key -> tokenizer) left for `otel_rl._lightspan.materialise`."""
    out = []
    for t in packed:
        trace_id, span_id, parent_id, name, start, end, attrs, events, code, desc = t if len(t) == 10 else t[:10]
        span = ended_span(
            name,
            _new_context(trace_id, span_id),
            _new_context(trace_id, parent_id) if parent_id else None,
            attrs,
            start,
            end,
            resource,
        )
        span._deferred = True  # copies from the op wrapper are only ever in these (`pack`)
        if events:
            span._events = [Event(n, a, ts) for n, ts, a in events]
        if code != _UNSET_CODE:
            span._status = Status(StatusCode(code), desc)
        if len(t) > 10 and t[10] is not None:
            key, *ids = t[10]
            tokenizer = tokenizers.get(key) if tokenizers is not None else None
            if tokenizer is None:
                warn_once(
                    f"token2text-missing:{key}",
                    "otel-rl: token2text: a tokenizer could not be loaded in the export process; "
                    "its outputs keep their ids only",
                )
            else:
                span._decode = (tokenizer, *ids)
        out.append(span)
    return out
