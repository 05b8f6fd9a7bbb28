"""Coercion of logged values to the scalars a step record holds, of a step to its integer
(`coerce_step`) and of generation samples to their rows (`generation_rows`).

`coerce_metrics` runs on the caller's thread, so it is a single pass with a
type-keyed fast path.  Tensors are gathered and moved to the host in one
transfer per call (one device sync, not one per value).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any, SupportsFloat, cast

_log = logging.getLogger("otel_rl")

_warned_keys: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log `message` once per distinct `key` for the life of the process."""
    if key in _warned_keys:
        return
    with _warn_lock:
        if key in _warned_keys:
            return
        _warned_keys.add(key)
    _log.warning(message, *args)


_FLOAT = float
_INT = int
_BOOL = bool


def _is_tensor(value: object) -> bool:
    mod = type(value).__module__
    return mod.startswith("torch") and hasattr(value, "dim") and hasattr(value, "detach")


def _scalar_from_numpy(value: object) -> bool | int | float | None:
    """numpy scalar or 0-d array -> python scalar, or None for anything else.

    A float32 value becomes the float of its shortest decimal text (``np.float32(0.1)`` -> ``0.1``, not
    ``0.10000000149011612``): the number verl's console (numpy 1) and file logger (orjson) write for it,
    and the same float32 when converted back."""
    shape = getattr(value, "shape", None)
    if shape is None or shape != ():
        return None
    try:
        dtype = getattr(value, "dtype", None)
        if dtype is not None and dtype.kind == "f" and dtype.itemsize == 4:
            return float(str(value[()]))  # type: ignore[index]
        item = value.item()  # type: ignore[attr-defined]
    except Exception:
        return None
    return item if isinstance(item, (bool, int, float)) else None


# Types whose branch below is decided by the type alone, learnt the first time a value of the type
# goes through the general path: torch tensor types -> _TENSOR; numpy scalar types -> the exact
# conversion that path applies (int for integer types, float for float64, else _scalar_from_numpy).
_TENSOR = object()
_KNOWN_TYPES: dict[type, object] = {}


def _numpy_scalar_type(tp: type) -> bool:
    """A numpy scalar type itself (not a subclass defined elsewhere, not ndarray)."""
    if getattr(tp, "__module__", None) != "numpy":
        return False
    np = sys.modules.get("numpy")
    return np is not None and isinstance(tp, type) and issubclass(tp, np.generic)


def coerce_metrics(data: object) -> tuple[dict[str, float | int | bool], list[str]]:
    """Return (scalars, skipped_keys) for one `log()` call.

    Accepted: int, float, bool, numpy scalars and 0-d arrays, torch 0-d tensors
    (any device). NaN and +-Inf are kept. Anything else (strings, None, lists,
    n-d arrays, dicts) is skipped and its key reported; keys that are not
    strings are converted with str().
    """
    out: dict[str, float | int | bool] = {}
    skipped: list[str] = []
    if not hasattr(data, "items"):
        raise TypeError(f"log() expects a mapping of metric name to value, got {type(data).__name__}")
    tensors: list[tuple[str, object]] | None = None
    for key, value in data.items():
        if type(key) is not str:
            key = str(key)
        tp = type(value)
        if tp is _FLOAT or tp is _INT or tp is _BOOL:
            out[key] = value
            continue
        known = _KNOWN_TYPES.get(tp)
        if known is _TENSOR:  # same as the tensor branch below, without re-deciding the type
            try:
                if value.dim() == 0 and value.numel() == 1:
                    if tensors is None:
                        tensors = []
                    tensors.append((key, value))
                    out[key] = 0.0  # placeholder keeps the caller's key order
                else:
                    skipped.append(key)
            except Exception:
                skipped.append(key)
            continue
        if known is not None:  # a numpy scalar type: its conversion, as below
            try:
                item = known(value)  # type: ignore[operator]
            except Exception:
                item = None
            if item is None:
                skipped.append(key)
            else:
                out[key] = item
            continue
        try:  # a value whose conversion raises (float(Fraction(10**400)), a broken .shape) is skipped
            if isinstance(value, bool):
                out[key] = bool(value)
            elif isinstance(value, numbers.Integral):
                if _numpy_scalar_type(tp):
                    _KNOWN_TYPES[tp] = int
                try:
                    out[key] = int(value)
                except Exception:
                    skipped.append(key)
            elif isinstance(value, numbers.Real) and not hasattr(value, "shape"):
                out[key] = float(value)
            elif _is_tensor(value):
                _KNOWN_TYPES[tp] = _TENSOR
                try:
                    if value.dim() == 0 and value.numel() == 1:
                        if tensors is None:
                            tensors = []
                        tensors.append((key, value))
                        out[key] = 0.0  # placeholder keeps the caller's key order
                    else:
                        skipped.append(key)
                except Exception:
                    skipped.append(key)
            else:
                if _numpy_scalar_type(tp):  # float64 is a float subclass: float() is its .item()
                    _KNOWN_TYPES[tp] = float if issubclass(tp, float) else _scalar_from_numpy
                item = _scalar_from_numpy(value)
                if item is None:
                    skipped.append(key)
                else:
                    out[key] = item
        except Exception:
            skipped.append(key)
    if tensors:
        _gather_tensors(tensors, out, skipped)
    return out, skipped


def _gather_tensors(tensors: list[tuple[str, object]], out: dict, skipped: list[str]) -> None:
    import torch

    # Group by (device, dtype class) so each group needs a single transfer.  Within a group,
    # tensors of one dtype are stacked first and converted once (not one kernel per tensor).
    by_dtype: dict[tuple[Any, Any], list[tuple[int, str, Any]]] = {}
    for i, (key, t) in enumerate(tensors):
        k = (t.device, t.dtype)  # type: ignore[attr-defined]
        sub = by_dtype.get(k)
        if sub is None:
            sub = by_dtype[k] = []
        sub.append((i, key, t))
    groups: dict[tuple[Any, bool], list[tuple[Any, list[tuple[int, str, Any]]]]] = {}
    for (device, dtype), sub in by_dtype.items():  # groups come in the order of their first tensor
        is_float = dtype.is_floating_point or dtype.is_complex or dtype == torch.bool
        groups.setdefault((device, is_float), []).append((dtype, sub))
    bool_dtype = torch.bool
    strided = torch.strided  # dense tensors (a sparse 0-d tensor cannot be stacked: skipped, as before)
    exact = _item_exact_dtypes(torch)
    for (device, is_float), subs in groups.items():
        try:
            if (
                device.type == "cpu"
                and all(dtype in exact for dtype, _ in subs)
                and all(t.layout is strided for _, sub in subs for _, _, t in sub)
            ):
                # already on the host: .item() gives the same value as the float64/int64 conversion
                # below for these dtypes, without the stack (nothing to transfer, no device sync)
                host = [t.item() for _, sub in subs for _, _, t in sub]
            else:
                parts = []
                with torch.no_grad():  # values only: no autograd graph
                    for dtype, sub in subs:
                        stacked = torch.stack([t for _, _, t in sub])
                        if is_float:
                            stacked = (stacked.real if dtype.is_complex else stacked).to(torch.float64)
                        else:
                            stacked = stacked.to(torch.int64)
                        parts.append(stacked)
                    host = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().tolist()  # the one transfer
        except Exception:
            for _, key, _ in _in_order(subs):
                out.pop(key, None)
                skipped.append(key)
            continue
        if len(subs) == 1:
            dtype, sub = subs[0]
            if dtype == bool_dtype:
                for (_, key, _), v in zip(sub, host):
                    out[key] = bool(v)
            else:
                for (_, key, _), v in zip(sub, host):
                    out[key] = v
            continue
        j = 0
        flat = []
        for dtype, sub in subs:
            is_bool = dtype == bool_dtype
            for i, key, _ in sub:
                flat.append((i, key, bool(host[j]) if is_bool else host[j]))
                j += 1
        flat.sort(key=_first)  # the caller's order
        for _, key, v in flat:
            out[key] = v


_ITEM_EXACT: frozenset = frozenset()


def _item_exact_dtypes(torch: Any) -> frozenset:
    """dtypes whose .item() equals .to(float64 or int64).tolist() exactly (bool: bool of it)."""
    global _ITEM_EXACT
    if not _ITEM_EXACT:
        _ITEM_EXACT = frozenset(
            (
                torch.float16,
                torch.bfloat16,
                torch.float32,
                torch.float64,
                torch.bool,
                torch.uint8,
                torch.int8,
                torch.int16,
                torch.int32,
                torch.int64,
            )
        )
    return _ITEM_EXACT


def _first(item: tuple) -> Any:
    return item[0]


def _in_order(subs: list[tuple[Any, list[tuple[int, str, Any]]]]) -> list[tuple[int, str, Any]]:
    if len(subs) == 1:
        return subs[0][1]
    return sorted((x for _, sub in subs for x in sub), key=_first)


def is_finite(value: float | int | bool) -> bool:
    return not (type(value) is float and not math.isfinite(value))


#: steps are signed 64-bit integers in every tracker (and in OTLP): -2**63 <= step < 2**63
STEP_LIMIT = 1 << 63


def coerce_step(step: Any, fallback: int) -> int | None:
    """The integer step of a `log()` call: `step` itself, or the integer a string of decimal digits spells;
    `fallback` (the current step) for None, or, with a warning, for anything else; None (warned) for a
    step outside the signed 64-bit range trackers store."""
    if step is None:
        n = fallback
    else:
        try:
            if isinstance(step, (str, bytes)):  # "7": the integer it spells (decimal digits, a sign)
                text = step.decode("ascii") if isinstance(step, bytes) else step
                if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
                    raise ValueError
            n = int(step)
            if isinstance(step, float) and n != step:
                raise ValueError
        except (TypeError, ValueError, OverflowError, UnicodeDecodeError):  # OverflowError: step=inf
            warn_once(
                f"bad-step:{type(step).__name__}",
                "otel-rl: step %r is not an integer; using step %d",
                step,
                fallback,
            )
            n = fallback
    if not -STEP_LIMIT <= n < STEP_LIMIT:  # what every tracker stores a step as: a signed 64-bit int
        warn_once(
            f"step-range:{n}",
            "otel-rl: step %d is outside the signed 64-bit range trackers store; nothing recorded at it",
            n,
        )
        return None
    return n


def generation_rows(samples: Iterable[Sequence[object]], limit: int | None) -> list[tuple[str, str, float]]:
    """The (input, output, score) rows of `log_generations()`, at most `limit`: texts and a float score (NaN
    when missing or not a number); a sample that is not a sequence is skipped with a warning."""
    rows = []
    for i, sample in enumerate(samples):
        if limit is not None and i >= limit:
            break
        try:
            inp, out, score = (list(sample) + [None, None, None])[:3]
        except TypeError:
            warn_once("gen-row", "otel-rl: a generation sample is not a sequence (input, output, score); skipped")
            continue
        try:
            score_f = float(cast(SupportsFloat, score)) if score is not None else float("nan")
        except (TypeError, ValueError):
            score_f = float("nan")
        rows.append(("" if inp is None else str(inp), "" if out is None else str(out), score_f))
    return rows
