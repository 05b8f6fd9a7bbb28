"""A compact, versioned binary codec for what a delivery queue holds: one batch of raw spans
and typed records (`RunStart`, `StepMetrics`, `Generations`, `Trajectory`).

It is exact: ints of any size, bools, floats bit for bit (NaN, +-Inf, -0.0), strings with lone
surrogates, bytes, lists vs tuples, dicts in key order, `SpanNode` trees of any depth (encoded
iteratively, never recursively), and `ReadableSpan` with its context, parent, kind, times,
attributes, events, links, status, resource and instrumentation scope.

Layout of one encoded batch (the payload of one spool frame)::

    u8 version | u8 flags | uvarint n_items | body            (body zlib-compressed when flags & 1)

    body = idents | records | resources | scopes | spans
    idents    = uvarint n, n x (str project, str experiment, str run_id)
    records   = uvarint n, n x (u8 kind, fields...)     kind: 1 RunStart 2 StepMetrics 3 Generations 4 Trajectory
    resources = uvarint n, n x (value attributes, value schema_url)
    scopes    = uvarint n, n x (str name, value version, value schema_url, value attributes)
    spans     = uvarint n, n x span

A value is a one-byte tag and its data (`_T_*` below): ints as zigzag varints, floats as 8
little-endian bytes, strings as uvarint length + UTF-8 (surrogatepass).  `n_items` sits before
the (maybe compressed) body so a reader can count items without decoding.  A reader rejects a
version it does not know (`CodecError`), so a spool written by a newer otel-rl is never
misread.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..records import Generations, RunIdentity, RunStart, SpanNode, StepMetrics, Trajectory

VERSION = 1
FLAG_ZLIB = 1
COMPRESS_MIN_BYTES = 2048  # bodies at least this big are zlib-compressed (level 1)


class CodecError(ValueError):
    """Bytes that are not a batch this codec can read, or an object it cannot write."""


# value tags
_T_NONE, _T_FALSE, _T_TRUE, _T_INT, _T_FLOAT, _T_STR, _T_BYTES, _T_LIST, _T_TUPLE, _T_DICT = range(10)

# record kinds
_K_RUN_START, _K_STEP_METRICS, _K_GENERATIONS, _K_TRAJECTORY = 1, 2, 3, 4

# StepMetrics value types, one byte per key
_M_FLOAT, _M_INT, _M_FALSE, _M_TRUE, _M_OTHER = b"f"[0], b"i"[0], b"b"[0], b"B"[0], b"o"[0]

_D = struct.Struct("<d")
_pack_d = _D.pack
_unpack_d = _D.unpack_from


# ----------------------------------------------------------------------------- writing


def _uvarint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zigzag(out: bytearray, v: int) -> None:
    _uvarint(out, v << 1 if v >= 0 else ((-v) << 1) - 1)


def _str(out: bytearray, s: str) -> None:
    b = s.encode("utf-8", "surrogatepass")
    n = len(b)
    if n < 0x80:
        out.append(n)
    else:
        _uvarint(out, n)
    out += b


def _value(out: bytearray, v: Any) -> None:
    t = type(v)
    if t is str:
        out.append(_T_STR)
        _str(out, v)
    elif t is float:
        out.append(_T_FLOAT)
        out += _pack_d(v)
    elif t is bool:
        out.append(_T_TRUE if v else _T_FALSE)
    elif t is int:
        out.append(_T_INT)
        _zigzag(out, v)
    elif v is None:
        out.append(_T_NONE)
    elif t is tuple or t is list:
        out.append(_T_TUPLE if t is tuple else _T_LIST)
        _uvarint(out, len(v))
        for x in v:
            _value(out, x)
    elif t is dict:
        out.append(_T_DICT)
        _uvarint(out, len(v))
        for k, x in v.items():
            _value(out, k)
            _value(out, x)
    elif t is bytes or t is bytearray:
        out.append(_T_BYTES)
        _uvarint(out, len(v))
        out += v
    # subclasses and other containers (IntEnum, MappingProxyType, BoundedAttributes...) as their base form
    elif isinstance(v, bool):
        out.append(_T_TRUE if v else _T_FALSE)
    elif isinstance(v, int):
        out.append(_T_INT)
        _zigzag(out, int(v))
    elif isinstance(v, float):
        out.append(_T_FLOAT)
        out += _pack_d(float(v))
    elif isinstance(v, str):
        out.append(_T_STR)
        _str(out, str(v))
    elif isinstance(v, Mapping):
        _value(out, dict(v))
    elif isinstance(v, (bytes, bytearray, memoryview)):
        _value(out, bytes(v))
    elif isinstance(v, Sequence):
        _value(out, tuple(v))
    else:
        raise CodecError(f"cannot encode a value of type {t.__name__}")


def _node_tree(out: bytearray, root: SpanNode) -> None:
    stack = [root]
    while stack:
        n = stack.pop()
        _str(out, n.name)
        _str(out, n.kind)
        _uvarint(out, n.span_id)
        _value(out, n.parent_id)
        _zigzag(out, n.start_ns)
        _zigzag(out, n.end_ns)
        _value(out, n.attributes)
        _value(out, n.inputs)
        _value(out, n.output)
        _str(out, n.status)
        _value(out, n.status_message)
        _value(out, n.events)
        _uvarint(out, len(n.children))
        stack.extend(reversed(n.children))


def _step_metrics(out: bytearray, r: StepMetrics) -> None:
    _zigzag(out, r.step)
    _zigzag(out, r.time_ns)
    values = r.values
    _uvarint(out, len(values))
    types = bytearray()
    floats: list[float] = []
    others: list[Any] = []
    for k, v in values.items():
        _str(out, k)
        t = type(v)
        if t is float:
            types.append(_M_FLOAT)
            floats.append(v)
        elif t is int:
            types.append(_M_INT)
            others.append(v)
        elif t is bool:
            types.append(_M_TRUE if v else _M_FALSE)
        else:
            types.append(_M_OTHER)
            others.append(v)
    out += types
    if floats:
        out += struct.pack(f"<{len(floats)}d", *floats)
    for v in others:
        if type(v) is int:
            _zigzag(out, v)
        else:
            _value(out, v)


def _span_context(out: bytearray, ctx: Any) -> None:
    _uvarint(out, ctx.trace_id)
    _uvarint(out, ctx.span_id)
    out.append(int(ctx.trace_flags) & 0xFF)
    out.append(1 if ctx.is_remote else 0)
    ts = ctx.trace_state
    _value(out, tuple(ts.items()) if ts else None)


def _spans(out: bytearray, spans: Sequence[Any]) -> None:
    resources: dict[int, int] = {}
    scopes: dict[int, int] = {}
    res_list: list[Any] = []
    scope_list: list[Any] = []
    for s in spans:
        r = s.resource
        if r is not None and id(r) not in resources:
            resources[id(r)] = len(res_list)
            res_list.append(r)
        sc = s.instrumentation_scope
        if sc is not None and id(sc) not in scopes:
            scopes[id(sc)] = len(scope_list)
            scope_list.append(sc)
    _uvarint(out, len(res_list))
    for r in res_list:
        _value(out, dict(r.attributes))
        _value(out, r.schema_url or None)
    _uvarint(out, len(scope_list))
    for sc in scope_list:
        _str(out, sc.name)
        _value(out, sc.version)
        _value(out, sc.schema_url or None)
        _value(out, None if sc.attributes is None else dict(sc.attributes))
    _uvarint(out, len(spans))
    for s in spans:
        _str(out, s.name)
        _span_context(out, s.context)
        if s.parent is None:
            out.append(0)
        else:
            out.append(1)
            _span_context(out, s.parent)
        out.append(s.kind.value)
        _value(out, s.start_time)
        _value(out, s.end_time)
        _value(out, None if s.attributes is None else dict(s.attributes))
        _uvarint(out, len(s.events))
        for e in s.events:
            _str(out, e.name)
            _zigzag(out, e.timestamp)
            _value(out, None if e.attributes is None else dict(e.attributes))
        _uvarint(out, len(s.links))
        for link in s.links:
            _span_context(out, link.context)
            _value(out, None if link.attributes is None else dict(link.attributes))
        st = s.status
        out.append(st.status_code.value)
        _value(out, st.description)
        _uvarint(out, 0 if s.resource is None else resources[id(s.resource)] + 1)
        sc = s.instrumentation_scope
        _uvarint(out, 0 if sc is None else scopes[id(sc)] + 1)


def encode_batch(spans: Sequence[Any], records: Sequence[Any], compress: bool = True) -> bytes:
    """One batch (raw spans + records) -> bytes.  Raises `CodecError` for what it cannot encode."""
    try:
        return _encode_batch(spans, records, compress)
    except CodecError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError, struct.error) as exc:
        raise CodecError(f"cannot encode the batch: {type(exc).__name__}: {exc}") from exc


def _encode_batch(spans: Sequence[Any], records: Sequence[Any], compress: bool) -> bytes:
    body = bytearray()
    idents: dict[RunIdentity, int] = {}
    for r in records:
        ident = getattr(r, "run", None)
        if not isinstance(ident, RunIdentity):
            raise CodecError(f"cannot encode a record of type {type(r).__name__}")
        if ident not in idents:
            idents[ident] = len(idents)
    _uvarint(body, len(idents))
    for ident in idents:
        _str(body, ident.project)
        _str(body, ident.experiment)
        _str(body, ident.run_id)
    _uvarint(body, len(records))
    for r in records:
        t = type(r)
        if t is StepMetrics:
            body.append(_K_STEP_METRICS)
            _uvarint(body, idents[r.run])
            _step_metrics(body, r)
        elif t is Trajectory:
            body.append(_K_TRAJECTORY)
            _uvarint(body, idents[r.run])
            _uvarint(body, r.trace_id)
            _value(body, r.step)
            _value(body, r.sample_index)
            _value(body, r.rollout_n)
            body.append(1 if r.validate else 0)
            _str(body, r.name)
            body.append(1 if r.complete else 0)
            _node_tree(body, r.root)
        elif t is Generations:
            body.append(_K_GENERATIONS)
            _uvarint(body, idents[r.run])
            _zigzag(body, r.step)
            _zigzag(body, r.time_ns)
            _uvarint(body, len(r.rows))
            for inp, outp, score in r.rows:
                _str(body, inp)
                _str(body, outp)
                body += _pack_d(score)
        elif t is RunStart:
            body.append(_K_RUN_START)
            _uvarint(body, idents[r.run])
            _value(body, r.config)
            _zigzag(body, r.rank)
            _zigzag(body, r.time_ns)
        else:
            raise CodecError(f"cannot encode a record of type {t.__name__}")
    _spans(body, spans)
    head = bytearray((VERSION, 0))
    _uvarint(head, len(spans) + len(records))
    if compress and len(body) >= COMPRESS_MIN_BYTES:
        head[1] |= FLAG_ZLIB
        return bytes(head) + zlib.compress(bytes(body), 1)
    head += body
    return bytes(head)


# ----------------------------------------------------------------------------- reading


class _Reader:
    __slots__ = ("b", "p")

    def __init__(self, b: bytes, p: int = 0):
        self.b = b
        self.p = p

    def u8(self) -> int:
        v = self.b[self.p]
        self.p += 1
        return v

    def uvarint(self) -> int:
        b = self.b
        p = self.p
        v = b[p]
        p += 1
        if v < 0x80:
            self.p = p
            return v
        v &= 0x7F
        shift = 7
        while True:
            c = b[p]
            p += 1
            v |= (c & 0x7F) << shift
            if c < 0x80:
                self.p = p
                return v
            shift += 7

    def zigzag(self) -> int:
        z = self.uvarint()
        return (z >> 1) if not z & 1 else -((z + 1) >> 1)

    def str(self) -> str:
        n = self.uvarint()
        p = self.p
        end = p + n
        if end > len(self.b):
            raise CodecError("string runs past the end of the batch")
        self.p = end
        return self.b[p:end].decode("utf-8", "surrogatepass")

    def f64(self) -> float:
        p = self.p
        self.p = p + 8
        return _unpack_d(self.b, p)[0]

    def value(self) -> Any:
        t = self.b[self.p]
        self.p += 1
        if t == _T_STR:
            return self.str()
        if t == _T_FLOAT:
            return self.f64()
        if t == _T_INT:
            return self.zigzag()
        if t == _T_NONE:
            return None
        if t == _T_TRUE:
            return True
        if t == _T_FALSE:
            return False
        if t == _T_TUPLE:
            return tuple([self.value() for _ in range(self.uvarint())])
        if t == _T_LIST:
            return [self.value() for _ in range(self.uvarint())]
        if t == _T_DICT:
            out = {}
            for _ in range(self.uvarint()):
                k = self.value()
                out[k] = self.value()
            return out
        if t == _T_BYTES:
            n = self.uvarint()
            p = self.p
            self.p = p + n
            return bytes(self.b[p : p + n])
        raise CodecError(f"unknown value tag {t}")


def _read_tree(r: _Reader) -> SpanNode:
    root: SpanNode | None = None
    stack: list[list[Any]] = []  # [node, children still to read]
    while True:
        node = SpanNode(
            name=r.str(),
            kind=r.str(),
            span_id=r.uvarint(),
            parent_id=r.value(),
            start_ns=r.zigzag(),
            end_ns=r.zigzag(),
            attributes=r.value(),
            inputs=r.value(),
            output=r.value(),
            status=r.str(),
            status_message=r.value(),
            events=r.value(),
        )
        nchildren = r.uvarint()
        if stack:
            top = stack[-1]
            top[0].children.append(node)
            top[1] -= 1
        else:
            root = node
        if nchildren:
            stack.append([node, nchildren])
        else:
            while stack and stack[-1][1] == 0:
                stack.pop()
        if not stack:
            assert root is not None
            return root


def _read_step_metrics(r: _Reader, ident: RunIdentity) -> StepMetrics:
    step = r.zigzag()
    time_ns = r.zigzag()
    n = r.uvarint()
    keys = [r.str() for _ in range(n)]
    p = r.p
    types = r.b[p : p + n]
    r.p = p + n
    nf = types.count(_M_FLOAT)
    floats = struct.unpack_from(f"<{nf}d", r.b, r.p) if nf else ()
    r.p += 8 * nf
    values: dict[str, Any] = {}
    fi = 0
    for k, t in zip(keys, types):
        if t == _M_FLOAT:
            values[k] = floats[fi]
            fi += 1
        elif t == _M_INT:
            values[k] = r.zigzag()
        elif t == _M_TRUE:
            values[k] = True
        elif t == _M_FALSE:
            values[k] = False
        elif t == _M_OTHER:
            values[k] = r.value()
        else:
            raise CodecError(f"unknown metric value type {t}")
    return StepMetrics(ident, step, values, time_ns)


def _read_span_context(r: _Reader) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags, TraceState

    trace_id = r.uvarint()
    span_id = r.uvarint()
    flags = r.u8()
    remote = bool(r.u8())
    ts = r.value()
    return SpanContext(trace_id, span_id, remote, TraceFlags(flags), TraceState(list(ts)) if ts else None)


def _read_spans(r: _Reader) -> list[Any]:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    resources = []
    for _ in range(r.uvarint()):
        attrs = r.value()
        schema = r.value()
        resources.append(Resource(attrs or {}, schema))
    scopes = []
    for _ in range(r.uvarint()):
        name = r.str()
        version = r.value()
        schema = r.value()
        attrs = r.value()
        scopes.append(InstrumentationScope(name, version, schema, attrs))
    out = []
    for _ in range(r.uvarint()):
        name = r.str()
        ctx = _read_span_context(r)
        parent = _read_span_context(r) if r.u8() else None
        kind = SpanKind(r.u8())
        start = r.value()
        end = r.value()
        attrs = r.value()
        events = []
        for _ in range(r.uvarint()):
            ename = r.str()
            ets = r.zigzag()
            events.append(Event(ename, r.value(), ets))
        links = []
        for _ in range(r.uvarint()):
            lctx = _read_span_context(r)
            links.append(Link(lctx, r.value()))
        status = Status(StatusCode(r.u8()), r.value())
        ri = r.uvarint()
        si = r.uvarint()
        out.append(
            ReadableSpan(
                name,
                context=ctx,
                parent=parent,
                resource=resources[ri - 1] if ri else None,
                attributes=attrs,
                events=tuple(events),
                links=tuple(links),
                kind=kind,
                status=status,
                start_time=start,
                end_time=end,
                instrumentation_scope=scopes[si - 1] if si else None,
            )
        )
    return out


def batch_items(payload: bytes) -> int:
    """The number of items (spans + records) of an encoded batch, without decoding it."""
    if len(payload) < 3:
        raise CodecError("batch too short")
    if payload[0] != VERSION:
        raise CodecError(f"unknown batch version {payload[0]} (this otel-rl reads version {VERSION})")
    return _Reader(payload, 2).uvarint()


def decode_batch(payload: bytes) -> tuple[list[Any], list[Any]]:
    """Bytes from `encode_batch` -> (spans, records).  Raises `CodecError` for bytes it cannot read."""
    try:
        n_items = batch_items(payload)
        r = _Reader(payload, 2)
        r.uvarint()
        if payload[1] & FLAG_ZLIB:
            r = _Reader(zlib.decompress(payload[r.p :]), 0)
        idents = [RunIdentity(r.str(), r.str(), r.str()) for _ in range(r.uvarint())]
        records: list[Any] = []
        for _ in range(r.uvarint()):
            kind = r.u8()
            ident = idents[r.uvarint()]
            if kind == _K_STEP_METRICS:
                records.append(_read_step_metrics(r, ident))
            elif kind == _K_TRAJECTORY:
                trace_id = r.uvarint()
                step = r.value()
                sample_index = r.value()
                rollout_n = r.value()
                validate = bool(r.u8())
                name = r.str()
                complete = bool(r.u8())
                records.append(
                    Trajectory(ident, trace_id, step, sample_index, rollout_n, validate, name, _read_tree(r), complete)
                )
            elif kind == _K_GENERATIONS:
                step = r.zigzag()
                time_ns = r.zigzag()
                rows = [(r.str(), r.str(), r.f64()) for _ in range(r.uvarint())]
                records.append(Generations(ident, step, rows, time_ns))
            elif kind == _K_RUN_START:
                config = r.value()
                records.append(RunStart(ident, config, r.zigzag(), r.zigzag()))
            else:
                raise CodecError(f"unknown record kind {kind}")
        spans = _read_spans(r)
    except CodecError:
        raise
    except (IndexError, ValueError, TypeError, struct.error, zlib.error, RecursionError) as exc:
        raise CodecError(f"malformed batch: {type(exc).__name__}: {exc}") from exc
    if r.p != len(r.b):
        raise CodecError(f"malformed batch: {len(r.b) - r.p} bytes left over")
    if len(spans) + len(records) != n_items:
        raise CodecError("malformed batch: item count does not match")
    return spans, records
