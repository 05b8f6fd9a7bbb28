"""Durable delivery: the on-disk spool behind each exporter's delivery queue.

- `codec`:  a compact, versioned binary encoding of batches (records and raw spans);
- `store`:  `Spool`, one exporter's directory of append-only, checksummed segment files + ack;
- `replay`: deliver what spool directories still hold (``otel-rl replay``).

`otel_rl._delivery.DeliveryQueue` uses them (through `otel_rl._spill.Spiller`); docs/delivery.md describes the design.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from ..config import cache_dir
from .files import fsync_dir, read_meta
from .store import DROP_POLICIES, FSYNC_POLICIES, Spool, SpoolBusy, SpoolOptions

__all__ = [
    "DROP_POLICIES",
    "FSYNC_POLICIES",
    "OFF_VALUES",
    "Spool",
    "SpoolBusy",
    "SpoolOptions",
    "default_root",
    "exporter_meta",
    "fsync_dir",
    "options_for",
    "read_meta",
    "spool_selected",
]

#: `spool_dir` values that turn the spool off (memory-only queues, as before the spool existed)
OFF_VALUES = frozenset({"off", "none", "false", "no", "0", "disabled"})

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_root() -> str:
    """``$XDG_CACHE_HOME/otel-rl/spool`` (``~/.cache/otel-rl/spool`` when XDG_CACHE_HOME is unset)."""
    return cache_dir("spool")


def safe_name(name: str) -> str:
    s = _UNSAFE.sub("_", name or "").strip(".")
    return s or "exporter"


def spool_selected(config: Any, exporter: Any) -> bool:
    """Does this exporter get a spool?  `spool_exporters`: ``auto`` (default), ``all``, ``none``, or names.

    ``auto``: the exporter's own ``spool`` attribute when it sets one, else True for tracker
    exporters (MLflow, WandB, SwanLab, Weave, any `TrackerExporter`) and False for the others
    (console, file, otlp, prometheus, memory and custom exporters).
    """
    sel = str(getattr(config, "spool_exporters", None) or "auto").strip()
    low = sel.lower()
    if low == "all":
        return True
    if low in ("none", "off", ""):
        return False
    if low != "auto":
        names = {p.strip() for p in sel.split(",") if p.strip()}
        return bool(names & {getattr(exporter, "name", ""), type(exporter).__name__})
    from ..exporters.tracker import TrackerExporter

    for e in (exporter, _inner(exporter)):
        if e is None:
            continue
        own = getattr(e, "spool", None)
        if own is not None:
            return bool(own)
        if isinstance(e, TrackerExporter):
            return True
    return False


def _inner(exporter: Any) -> Any:
    """The exporter a wrapper delivers to (the bridge's `Delivered` keeps it as ``inner``)."""
    inner = getattr(exporter, "__dict__", {}).get("inner")
    from ..exporters.base import Exporter

    return inner if isinstance(inner, Exporter) else None


def exporter_meta(config: Any, exporter: Any) -> dict[str, Any]:
    """What `otel-rl replay` needs to rebuild the exporter: its name, class and the scrubbed config."""
    from ..redact import scrub_secrets

    cfg: dict[str, Any] = {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        cfg = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "verl_config"}
        cfg = scrub_secrets(cfg)
    cls = type(_inner(exporter) or exporter)
    return {
        "exporter": getattr(exporter, "name", "") or cls.__name__,
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "config": cfg,
    }


def options_for(config: Any, exporter: Any, **overrides: Any) -> SpoolOptions | None:
    """The spool of `exporter` under `config` (None: no spool for it).

    Directory: ``<spool_dir>/<exporter>`` when `spool_dir` is set (a restart with the same
    setting picks up what is left, whatever the run id), else
    ``<default_root()>/<run id>/<exporter>``; ranks other than 0 add ``-rank<N>``.
    Raises ValueError for an unknown fsync or drop policy.
    """
    if config is None:
        return None
    raw = getattr(config, "spool_dir", None)
    if isinstance(raw, str) and raw.strip().lower() in OFF_VALUES:
        return None
    if not spool_selected(config, exporter):
        return None
    if raw:
        base = os.path.abspath(os.path.expanduser(raw))
        remove_parent = False
    else:
        base = os.path.join(default_root(), safe_name(str(getattr(config, "run_id", "") or "run")))
        remove_parent = True
    leaf = safe_name(getattr(exporter, "name", "") or type(exporter).__name__)
    rank = int(getattr(config, "rank", 0) or 0)
    if rank:
        leaf += f"-rank{rank}"
    kw: dict[str, Any] = {
        "path": os.path.join(base, leaf),
        "max_bytes": int(getattr(config, "spool_max_bytes", 1 << 30)),
        "drop_policy": str(getattr(config, "spool_drop_policy", "drop_oldest")),
        "fsync": str(getattr(config, "spool_fsync", "batch")),
        "remove_parent_if_empty": remove_parent,
        "meta": exporter_meta(config, exporter),
    }
    kw.update(overrides)
    return SpoolOptions(**kw)
