"""Safe JSON serialisation of op inputs and outputs.

`to_json` never raises: dataclasses, pydantic models, numpy arrays and scalars,
torch tensors, bytes, sets, enums, paths, cycles and objects without a JSON form
are all turned into something readable, and the result is capped at
`max_chars` characters.  A value that hits the cap ends with a visible marker
``...[truncated N chars]`` and the caller is told it was truncated.
Non-finite floats are written as the strings "NaN", "Infinity", "-Infinity" so
the text stays valid JSON for strict readers.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import pickle
import sys
import threading
from typing import Any, cast

from . import semconv as sc

DEFAULT_MAX_CHARS = 256 * 1024
_MAX_ITEMS = 1000  # per container, in the slow path
_MAX_DEPTH = 32
TRUNCATION_MARK = "...[truncated {} chars]"

_PRIMITIVE = (str, int, float, bool, type(None))


def _fallback(obj: Any) -> Any:
    """`default=` hook for json.dumps: one level of conversion, never raises."""
    try:
        return _convert(obj)
    except RecursionError:  # a cycle through converted objects (see `_ENCODER`): to_json's slow path
        raise
    except Exception as exc:  # a broken __repr__ or property must not escape
        return f"<unserialisable {type(obj).__name__}: {type(exc).__name__}>"


def _convert(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    dump = getattr(obj, "model_dump", None)  # pydantic v2
    if callable(dump) and not isinstance(obj, type):
        return dump(mode="json")
    mod = type(obj).__module__
    if mod.startswith("torch") and hasattr(obj, "detach"):
        t = obj.detach()
        if t.numel() <= _MAX_ITEMS:
            return t.cpu().tolist()
        return {
            "tensor": {"shape": list(t.shape), "dtype": str(t.dtype), "device": str(t.device)},
            "head": t.flatten()[:_MAX_ITEMS].cpu().tolist(),
        }
    if mod == "numpy" or mod.startswith("numpy."):
        if hasattr(obj, "shape") and obj.shape != ():
            if obj.size <= _MAX_ITEMS:
                return obj.tolist()
            return {
                "ndarray": {"shape": list(obj.shape), "dtype": str(obj.dtype)},
                "head": obj.reshape(-1)[:_MAX_ITEMS].tolist(),
            }
        if hasattr(obj, "item"):
            return obj.item()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return repr(b[:4096])
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):  # a dict with non-string keys reaches here via the slow path
        return {str(k): v for k, v in obj.items()}
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return repr(obj)


def _sanitize(obj: Any, seen: set[int], depth: int) -> Any:
    """Slow path: walk the value, breaking cycles and replacing non-finite floats."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, _PRIMITIVE):
        return obj
    if depth > _MAX_DEPTH:
        return "<max depth>"
    oid = id(obj)
    if oid in seen:
        return "<cycle>"
    if isinstance(obj, dict):
        seen.add(oid)
        out = {}
        for i, (k, v) in enumerate(obj.items()):
            if i >= _MAX_ITEMS:
                out["..."] = f"{len(obj) - _MAX_ITEMS} more items"
                break
            out[k if isinstance(k, str) else str(k)] = _sanitize(v, seen, depth + 1)
        seen.discard(oid)
        return out
    if isinstance(obj, (list, tuple)):
        seen.add(oid)
        out_l = [_sanitize(v, seen, depth + 1) for v in obj[:_MAX_ITEMS]]
        if len(obj) > _MAX_ITEMS:
            out_l.append(f"... {len(obj) - _MAX_ITEMS} more items")
        seen.discard(oid)
        return out_l
    seen.add(oid)
    try:
        converted = _fallback(obj)
        if converted is obj:
            converted = repr(obj)
        return _sanitize(converted, seen, depth + 1)
    finally:
        seen.discard(oid)


# the C encoder that json.dumps builds on every call, built once here (None: interpreters without the C accelerator)
_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_encode_basestring = json.encoder.encode_basestring

# Without a circular-reference map (`markers=None`): the encoder then keeps no state between or
# during calls, so one instance serves every thread; and a value that contains itself, which the
# map would have reported as ValueError, ends in RecursionError at the interpreter's recursion limit
# instead.  Both go to `to_json`'s slow path, which breaks cycles.  Skipping the map (an id() and a
# dict insert and delete per container) makes a small op input about a third cheaper.
_MARKERLESS_LIMIT = 4000  # the recursion limit up to which a cycle may run into it (Python's default: 1000)
_getrecursionlimit = sys.getrecursionlimit
#: after a value with a cycle, this many calls use the encoder with the map (a cycle found by running into
#: the recursion limit costs ~0.5 ms; with the map, a few microseconds)
_CAREFUL_CALLS = 10_000
_careful = 0
_ENCODER = (
    None
    if _c_make_encoder is None
    else _c_make_encoder(None, _fallback, _encode_basestring, None, ": ", ", ", False, False, False)
)


def _dumps(obj: Any) -> str:
    """What ``json.dumps(obj, default=_fallback, ensure_ascii=False, allow_nan=False)`` returns for
    a value without cycles, faster (see `_ENCODER`); a value with a cycle raises RecursionError."""
    if _ENCODER is None:  # pragma: no cover
        return json.dumps(obj, default=_fallback, ensure_ascii=False, allow_nan=False)
    if isinstance(obj, str):
        return _encode_basestring(obj)
    global _careful
    if _careful:
        _careful -= 1  # (a lost decrement between threads does not matter)
    elif _getrecursionlimit() <= _MARKERLESS_LIMIT:
        return "".join(_ENCODER(obj, 0))
    # a raised recursion limit would let a cycle run deep into the C stack, and a program whose values had
    # a cycle lately would pay for running into the limit again and again: detect cycles instead
    return "".join(_c_make_encoder({}, _fallback, _encode_basestring, None, ": ", ", ", False, False, False)(obj, 0))


def to_json(obj: Any, max_chars: int = DEFAULT_MAX_CHARS) -> tuple[str, bool]:
    """Serialise `obj` to JSON text of at most about `max_chars` characters.

    Returns (text, truncated).  Never raises.
    """
    global _careful
    try:
        text = _dumps(obj)
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        if type(exc) is RecursionError:
            _careful = _CAREFUL_CALLS
        try:
            text = json.dumps(_sanitize(obj, set(), 0), ensure_ascii=False, allow_nan=False)
        except Exception as exc:
            text = json.dumps(f"<unserialisable {type(obj).__name__}: {type(exc).__name__}>")
    except Exception as exc:
        text = json.dumps(f"<unserialisable {type(obj).__name__}: {type(exc).__name__}>")
    if len(text) > max_chars:
        cut = len(text) - max_chars
        return text[:max_chars] + TRUNCATION_MARK.format(cut), True
    return text, False


def json_float(value: float | int | bool) -> float | int | bool | str:
    """A scalar as strict JSON allows it: non-finite floats become strings."""
    if type(value) is float and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def parse_json_float(value: Any) -> Any:
    """Inverse of `json_float` for readers of our JSONL files."""
    if value == "NaN":
        return math.nan
    if value == "Infinity":
        return math.inf
    if value == "-Infinity":
        return -math.inf
    return value


# ----------------------------------------------------------------------------- deferred JSON
#
# A traced op's inputs and output are copied when the op runs (later changes to them must not show)
# but their JSON text is needed only where spans are read: in the export process, or by the
# pipeline thread.  A value made only of Python's own data types (exactly: str, int, float, bool,
# None, bytes, bytearray, list, tuple, dict, set, frozenset) is copied by pickle's C code, which
# calls no Python code for these types, at a fraction of the cost of encoding it, and turned into
# text by `json_text` where it is read.  Any other value (a tensor, a numpy array or scalar, a
# dataclass, an int or str subclass such as an enum) makes pickle call `reducer_override`, which
# stops the copy: that value is encoded on the spot, as before.


class _PlainDataPickler(pickle.Pickler):
    """Pickles exact builtin data types only (anything else raises), into a list of chunks; in fast
    mode (no memo: a value that holds itself raises too, and goes to to_json's cycle handling)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        # a copy is being made: code that runs meanwhile on this thread (a finalizer, a signal handler)
        # and traces an op gets its value encoded instead
        self.busy = False
        out = _Chunks()
        out.write = self.chunks.append
        super().__init__(out, pickle.HIGHEST_PROTOCOL)
        self.fast = True

    def reducer_override(self, obj: Any) -> Any:
        raise _NotPlainData


class _Chunks:
    write: Any


class _NotPlainData(Exception):
    pass


_local = threading.local()
_ploads = pickle.loads
#: the attributes of an op span that may hold a deferred copy (bytes) until they are read
DEFERRED_KEYS = (sc.RL_OP_INPUTS, sc.RL_OP_OUTPUT)


def _pickler() -> _PlainDataPickler:
    p = _local.p = _PlainDataPickler()
    return p


def snapshot(obj: Any, max_chars: int = DEFAULT_MAX_CHARS) -> tuple[str | bytes, bool]:
    """What `to_json(obj, max_chars)` returns, or a copy of `obj` (bytes) that `json_text` turns into
    that text later: (text or copy, truncated).  Never raises."""
    p = getattr(_local, "p", None) or _pickler()  # one per thread: reused, nothing shared
    if p.busy:
        return to_json(obj, max_chars)
    chunks = p.chunks
    p.busy = True
    try:
        p.dump(obj)
    except Exception:  # not only plain data, a cycle, or too deep: encoded now
        chunks.clear()
        return to_json(obj, max_chars)
    finally:
        p.busy = False
    blob = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    chunks.clear()
    if len(blob) > max_chars:  # large: its text is cut to max_chars now rather than a large copy kept
        return to_json(obj, max_chars)
    return blob, False


def json_text(value: str | bytes, max_chars: int = DEFAULT_MAX_CHARS) -> tuple[str, bool]:
    """The JSON text of a `snapshot` (what `to_json` gives for the value it copied): (text, truncated)."""
    if type(value) is not bytes:
        return cast(str, value), False
    try:
        obj = _ploads(value)
    except Exception as exc:  # pragma: no cover - a copy made by `snapshot` always loads
        return json.dumps(f"<unreadable copy: {type(exc).__name__}>"), False
    return to_json(obj, max_chars)


def materialize(attributes: dict, max_chars: int = DEFAULT_MAX_CHARS) -> dict:
    """An op span's attributes with its deferred inputs and output turned into JSON text, in place
    (a text cut at `max_chars` sets ``rl.truncated``); returns `attributes`."""
    for key in DEFERRED_KEYS:
        v = attributes.get(key)
        if type(v) is bytes:
            text, truncated = json_text(v, max_chars)
            attributes[key] = text
            if truncated:
                attributes[sc.RL_TRUNCATED] = True
    return attributes
