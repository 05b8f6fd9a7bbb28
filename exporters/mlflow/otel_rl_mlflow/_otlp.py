"""A trajectory's `RowSpan`s as the body of an OTLP/HTTP trace export request (protobuf wire format).

The bytes are those MLflow's own client sends for the same spans (``RestStore.log_spans``: each MLflow
`Span`'s ``to_otel_proto()`` in one ``ExportTraceServiceRequest`` with an empty resource), written
straight from the rows' JSON texts: no OpenTelemetry `ReadableSpan`, MLflow `Span` or protobuf message
is built.  tests/trackers/test_mlflow_remote.py compares the bytes with MLflow's for trajectories with
errors, events, Unicode, nested and empty values.

How MLflow's client turns a span's attributes into OTLP values, and so what this does too: each
attribute is a JSON text; its parsed value becomes an ``AnyValue`` (str, bool, int, float, list ->
``array_value``, dict -> ``kvlist_value``, null -> no value); strings that are not valid UTF-8 (lone
surrogates) get ``?`` in their place.  The server parses the values back and stores their JSON text.
One difference: an integer outside int64, which MLflow's client cannot encode (it raises), is sent as
a double.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._traces import RowSpan

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_loads = json.loads

_VARINT_1 = [bytes([i]) for i in range(128)]
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

#: encoded attributes (KeyValue fields of a span) of short JSON texts, which repeat from span to span
_ATTR_CACHE: dict[tuple[str, str], bytes] = {}
_ATTR_CACHE_MAX = 8192
_SHORT_TEXT = 64

# field tags (field number << 3 | wire type)
_T_STRING = b"\x0a"  # AnyValue.string_value = 1; also KeyValue.key, ArrayValue.values, KeyValueList.values
_T_BOOL = b"\x10"  # AnyValue.bool_value = 2
_T_INT = b"\x18"  # AnyValue.int_value = 3
_T_DOUBLE = b"\x21"  # AnyValue.double_value = 4
_T_ARRAY = b"\x2a"  # AnyValue.array_value = 5
_T_KVLIST = b"\x32"  # AnyValue.kvlist_value = 6
_T_BYTES = b"\x3a"  # AnyValue.bytes_value = 7
_T_KV_VALUE = b"\x12"  # KeyValue.value = 2
_T_SPAN_TRACE_ID = b"\x0a\x10"  # Span.trace_id = 1 (16 bytes)
_T_SPAN_ID = b"\x12\x08"  # Span.span_id = 2 (8 bytes)
_T_SPAN_PARENT = b"\x22\x08"  # Span.parent_span_id = 4 (8 bytes)
_T_SPAN_NAME = b"\x2a"  # Span.name = 5
_T_SPAN_START = b"\x39"  # Span.start_time_unix_nano = 7 (fixed64)
_T_SPAN_END = b"\x41"  # Span.end_time_unix_nano = 8 (fixed64)
_T_SPAN_ATTR = b"\x4a"  # Span.attributes = 9
_T_SPAN_EVENT = b"\x5a"  # Span.events = 11
_T_SPAN_STATUS = b"\x7a"  # Span.status = 15
_T_EVENT_TIME = b"\x09"  # Event.time_unix_nano = 1 (fixed64)
_T_EVENT_NAME = b"\x12"  # Event.name = 2
_T_EVENT_ATTR = b"\x1a"  # Event.attributes = 3
_T_STATUS_MESSAGE = b"\x12"  # Status.message = 2
_T_STATUS_CODE = b"\x18"  # Status.code = 3
_STATUS_CODES = {"UNSET": 0, "OK": 1, "ERROR": 2}
# ExportTraceServiceRequest.resource_spans = 1 { ResourceSpans.resource = 1 (empty), .scope_spans = 2 { spans = 2 } }
_T_RESOURCE_SPANS = b"\x0a"
_EMPTY_RESOURCE = b"\x0a\x00"
_T_SCOPE_SPANS = b"\x12"
_T_SCOPE_SPAN = b"\x12"


def _varint(n: int) -> bytes:
    if n < 128:
        return _VARINT_1[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field."""
    n = len(payload)
    return tag + (_VARINT_1[n] if n < 128 else _varint(n)) + payload


def _text(s: str) -> bytes:
    # MLflow replaces what UTF-8 cannot encode (lone surrogates) before it sets a protobuf string
    return s.encode("utf-8", "replace")


def any_value(v: Any) -> bytes:
    """The fields of an ``AnyValue`` holding `v` (a parsed JSON value); b"" for None (no value)."""
    t = type(v)
    if t is str:
        return _field(_T_STRING, _text(v))
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if t is int:
        if _INT64_MIN <= v <= _INT64_MAX:
            return _T_INT + _varint(v & 0xFFFFFFFFFFFFFFFF)
        return _T_DOUBLE + _pack_double(float(v))
    if t is float:
        return _T_DOUBLE + _pack_double(v)
    if v is None:
        return b""
    if t is list or t is tuple:
        return _field(_T_ARRAY, b"".join([_field(_T_STRING, any_value(x)) for x in v]))
    if t is dict:
        return _field(_T_KVLIST, b"".join([_field(_T_STRING, _key_value(str(k), x)) for k, x in v.items()]))
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        return _field(_T_STRING, _text(v))
    if isinstance(v, int):
        return any_value(int(v))
    if isinstance(v, float):
        return any_value(float(v))
    if isinstance(v, bytes):
        return _field(_T_BYTES, v)
    if isinstance(v, (list, tuple)):
        return any_value(list(v))
    if isinstance(v, dict):
        return any_value(dict(v))
    return _field(_T_STRING, _text(str(v)))


def _key_value(key: str, v: Any) -> bytes:
    """The fields of a ``KeyValue``; a None value leaves its ``value`` field out, as MLflow does."""
    head = _field(_T_STRING, _text(key))
    if v is None:
        return head
    return head + _field(_T_KV_VALUE, any_value(v))


def _attribute(key: str, text: str) -> bytes:
    """One span attribute (its value a JSON text) as a Span.attributes field."""
    short = len(text) <= _SHORT_TEXT
    if short:
        hit = _ATTR_CACHE.get((key, text))
        if hit is not None:
            return hit
    try:
        value = _loads(text) if text else None
    except ValueError:  # MLflow keeps text that does not parse as it is
        value = text
    out = _field(_T_SPAN_ATTR, _key_value(key, value))
    if short:
        if len(_ATTR_CACHE) >= _ATTR_CACHE_MAX:
            _ATTR_CACHE.clear()
        _ATTR_CACHE[(key, text)] = out
    return out


def _event(name: str, attributes: Mapping[str, AttributeValue], time_ns: int | None) -> bytes:
    if time_ns is None:  # as OpenTelemetry's Event stamps one made without a time
        time_ns = time.time_ns()
    out = [_T_EVENT_TIME + _pack_fixed64(time_ns)] if time_ns else []
    out.append(_field(_T_EVENT_NAME, _text(name)))
    for k, v in attributes.items():
        out.append(_field(_T_EVENT_ATTR, _key_value(k, v)))
    return _field(_T_SPAN_EVENT, b"".join(out))


def span(s: RowSpan) -> bytes:
    """One OTLP ``Span`` message (without its field tag)."""
    out = [
        _T_SPAN_TRACE_ID + s.trace_id.to_bytes(16, "big"),
        _T_SPAN_ID + s.span_id.to_bytes(8, "big"),
    ]
    if s.parent_span_id is not None:
        out.append(_T_SPAN_PARENT + s.parent_span_id.to_bytes(8, "big"))
    out.append(_field(_T_SPAN_NAME, _text(s.name)))
    if s.start_ns:
        out.append(_T_SPAN_START + _pack_fixed64(s.start_ns))
    if s.end_ns:
        out.append(_T_SPAN_END + _pack_fixed64(s.end_ns))
    attribute = _attribute
    for k, text in s.attributes.items():
        out.append(attribute(k, text))
    for name, attrs, time_ns in s.events:
        out.append(_event(name, attrs, time_ns))
    status = b""
    if s.status_message:
        status = _field(_T_STATUS_MESSAGE, _text(s.status_message))
    code = _STATUS_CODES[s.status_code]
    if code:
        status += _T_STATUS_CODE + _VARINT_1[code]
    out.append(_field(_T_SPAN_STATUS, status))
    return b"".join(out)


def export_request(spans: Sequence[RowSpan]) -> bytes:
    """The serialized ``ExportTraceServiceRequest`` of `spans` (one resource, empty; one scope)."""
    scope = b"".join([_field(_T_SCOPE_SPAN, span(s)) for s in spans])
    return _field(_T_RESOURCE_SPANS, _EMPTY_RESOURCE + _field(_T_SCOPE_SPANS, scope))
