"""Coercion of logged values to the scalars a step record holds.

`coerce_metrics` runs on the caller's thread, so it is a single pass with a
type-keyed fast path.  Tensors are gathered and moved to the host in one
transfer per call (one device sync, not one per value).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading

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


def _scalar_from_numpy(value: object):
    """numpy scalar or 0-d array -> python scalar, or None for anything else."""
    shape = getattr(value, "shape", None)
    if shape is None or shape != ():
        return None
    try:
        item = value.item()  # type: ignore[attr-defined]
    except Exception:
        return None
    return item if isinstance(item, (bool, int, float)) else None


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
    for key, value in data.items():  # type: ignore[union-attr]
        if type(key) is not str:
            key = str(key)
        tp = type(value)
        if tp is _FLOAT or tp is _INT or tp is _BOOL:
            out[key] = value
            continue
        try:  # a value whose conversion raises (float(Fraction(10**400)), a broken .shape) is skipped
            if isinstance(value, bool):
                out[key] = bool(value)
            elif isinstance(value, numbers.Integral):
                try:
                    out[key] = int(value)
                except Exception:
                    skipped.append(key)
            elif isinstance(value, numbers.Real) and not hasattr(value, "shape"):
                out[key] = float(value)
            elif _is_tensor(value):
                try:
                    if value.dim() == 0 and value.numel() == 1:  # type: ignore[attr-defined]
                        if tensors is None:
                            tensors = []
                        tensors.append((key, value))
                        out[key] = 0.0  # placeholder keeps the caller's key order
                    else:
                        skipped.append(key)
                except Exception:
                    skipped.append(key)
            else:
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

    # group by (device, dtype class) so each group needs a single transfer
    groups: dict[tuple[str, bool], list[tuple[str, torch.Tensor]]] = {}
    for key, t in tensors:
        t = t.detach()  # type: ignore[attr-defined]
        is_float = t.is_floating_point() or t.is_complex()
        groups.setdefault((str(t.device), is_float or t.dtype == torch.bool), []).append((key, t))
    for (_device, is_float), items in groups.items():
        try:
            if is_float:
                stacked = torch.stack([t.to(torch.float64) if not t.is_complex() else t.real.to(torch.float64) for _, t in items])
            else:
                stacked = torch.stack([t.to(torch.int64) for _, t in items])
            host = stacked.cpu().tolist()  # the one device->host transfer for this group
        except Exception:
            for key, _ in items:
                out.pop(key, None)
                skipped.append(key)
            continue
        for (key, t), v in zip(items, host):
            if t.dtype == torch.bool:
                out[key] = bool(v)
            else:
                out[key] = v


def is_finite(value: float | int | bool) -> bool:
    return not (type(value) is float and not math.isfinite(value))
