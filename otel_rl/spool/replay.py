"""Deliver what spool directories still hold (``otel-rl replay``).

A spool directory names its exporter and the (secret-scrubbed) config it ran with in
``meta.json``.  Replay rebuilds that exporter (by its registered name, else by its class,
``module:qualname``, called with the config), and runs one `DeliveryQueue` over the spool: the
same code that delivers a recovered spool at the start of a trainer, with the same retries,
handling of batches the exporter rejects as bad data (delivered in parts; only the items still rejected
alone are dropped, each logged) and ack after every delivered batch.  So a replay that is interrupted
(or run twice) never delivers a batch twice, and a fully delivered spool directory is removed.

The tracker's own settings come from the environment of the replay, as for training
(``MLFLOW_TRACKING_URI``, ``WANDB_API_KEY``, ...): secrets are never written to the spool.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .files import read_meta
from .store import Spool, SpoolBusy, SpoolOptions

_STATE_KEYS = ("format", "pid", "updated_ns")
#: meta.json key: how the trainer that left the spool ended ({"state": "finished" | "crashed" | "aborted" |
#: "killed", "exit_code", "text"}); absent when it never got to say (SIGKILL, power loss, still running)
RUN_END_KEY = "run_end"


@dataclasses.dataclass
class ReplayResult:
    path: str
    exporter: str
    status: str  # delivered | partial | empty | busy | error | listed
    pending_items: int = 0  # in the spool before the replay
    pending_frames: int = 0
    delivered: int = 0
    dropped: int = 0
    rejected: int = 0  # records (items) the exporter refused as bad data, each alone (logged)
    corrupt: int = 0
    left: int = 0
    seconds: float = 0.0
    message: str = ""

    def line(self) -> str:
        head = f"{self.path} [{self.exporter}]"
        if self.status == "listed":
            return (
                f"{head}: {self.pending_items} items in {self.pending_frames} batches waiting"
                f"{f'; {self.corrupt} corrupt regions' if self.corrupt else ''}"
            )
        if self.status in ("busy", "error"):
            return f"{head}: {self.status}: {self.message}"
        if self.status == "empty":
            return f"{head}: nothing to deliver"
        rate = f" ({self.delivered / self.seconds:.0f} items/s)" if self.seconds > 0 and self.delivered else ""
        return (
            f"{head}: delivered {self.delivered} of {self.pending_items} items{rate}; {self.dropped} dropped; "
            f"{f'{self.rejected} rejected as bad data; ' if self.rejected else ''}"
            f"{self.corrupt} corrupt regions skipped; {self.left} left" + (f" ({self.message})" if self.message else "")
        )


def note_run_end(queue: Any, outcome: Any) -> None:
    """After `queue` stopped: when its spool still holds items, note in the spool's meta.json how the
    trainer ended (`outcome`, an `otel_rl._exit.Outcome`; None: it finished), so that a replay that
    delivers them ends the tracker runs that way.  Best effort: an error leaves the spool as it is."""
    sp = getattr(queue, "spool", None)
    if sp is None or not (sp.pending_items or getattr(queue.stats, "spool_pending", 0)):
        return
    meta_path = os.path.join(sp.path, "meta.json")
    try:
        meta = read_meta(sp.path)
        meta[RUN_END_KEY] = (
            {"state": "finished", "exit_code": 0, "text": ""}
            if outcome is None
            else {"state": outcome.state, "exit_code": outcome.exit_code, "text": outcome.text[-4000:]}
        )
        tmp = f"{meta_path}.{os.getpid()}.end.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, default=str)
        os.replace(tmp, meta_path)
    except (OSError, ValueError):
        pass


def _end_runs(exporter: Any, end: Any) -> str:
    """Before the replay's `exporter.shutdown()`: end its tracker runs as the trainer ended (`end`, the
    spool's note), or, when it never said, leave them as they are (an exporter that can; MLflow)."""
    from .._exit import Outcome, tell_outcome

    leave = getattr(exporter, "leave_runs_open", None)
    if not isinstance(end, dict):
        return "the trainer did not say how it ended: its runs are left as they are" if callable(leave) else ""
    if callable(leave):
        leave(False)
    state = str(end.get("state") or "finished")
    if state != "finished":
        try:
            code = int(end.get("exit_code") or 1)
        except (TypeError, ValueError):
            code = 1
        tell_outcome(exporter, Outcome(state, code, str(end.get("text") or "")))
    return ""


def find_spools(paths: Iterable[str]) -> list[str]:
    """Spool directories (those with a ``meta.json``) at or under `paths`, sorted."""
    found: set[str] = set()
    for p in paths:
        p = os.path.abspath(os.path.expanduser(p))
        if os.path.isfile(os.path.join(p, "meta.json")):
            found.add(p)
            continue
        for root, dirs, files in os.walk(p):
            if "meta.json" in files:
                found.add(root)
                dirs[:] = []
    return sorted(found)


def _config(stored: dict[str, Any]) -> Any:
    from ..config import _FIELDS, ConfigError, resolve
    from ..redact import REDACTED

    kw = {k: v for k, v in stored.items() if k in _FIELDS and k != "verl_config" and v is not None and v != REDACTED}
    kw["spool_dir"] = "off"  # the exporter itself never spools; the replay reads the spool
    try:
        return resolve(**kw)
    except ConfigError:
        keep = ("project", "experiment", "run_id", "rank", "trace_backend", "service_name")
        return resolve(**{k: v for k, v in kw.items() if k in keep}, spool_dir="off")


def build_exporter(meta: dict[str, Any]) -> Any:
    """The exporter a spool was written for: by registered name, else by class."""
    from ..exporters import registry

    name = str(meta.get("exporter") or "")
    config = _config(meta.get("config") or {})
    if name in registry.installed_names():
        return registry.create(name, config)
    target = str(meta.get("class") or "")
    mod, _, qual = target.partition(":")
    if not mod or not qual or "<locals>" in qual:
        raise RuntimeError(f"exporter {name!r} ({target or 'unknown class'}) is neither registered nor importable")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    try:
        exporter = obj(config)
    except TypeError:
        exporter = obj()
    if not getattr(exporter, "name", ""):
        exporter.name = name
    return exporter


def replay_one(
    path: str, timeout_s: float = 300.0, list_only: bool = False, exporters: Sequence[str] | None = None
) -> ReplayResult | None:
    """Deliver (or, `list_only`, describe) one spool directory.  None when filtered out by `exporters`."""
    from .._delivery import DeliveryQueue

    try:
        meta = read_meta(path)
    except (OSError, ValueError) as exc:
        return ReplayResult(path, "?", "error", message=f"cannot read meta.json: {exc}")
    name = str(meta.get("exporter") or "?")
    if exporters and name not in exporters:
        return None
    opts = SpoolOptions(
        path=path,
        exact=True,
        max_bytes=1 << 62,
        fsync="batch",
        meta={k: v for k, v in meta.items() if k not in _STATE_KEYS},
    )
    sp = Spool(opts)
    try:
        if not sp.open(create=False):
            return ReplayResult(path, name, "error", message="the directory is gone")
    except SpoolBusy:
        return ReplayResult(path, name, "busy", message="in use by a running process (a trainer or another replay)")
    except OSError as exc:
        return ReplayResult(path, name, "error", message=str(exc))
    res = ReplayResult(
        path,
        name,
        "listed",
        pending_items=sp.pending_items,
        pending_frames=sp.pending_frames,
        corrupt=sp.corrupt_frames,
    )
    if list_only:
        sp.close(remove_if_empty=False)
        return res
    if not sp.pending_frames:
        sp.close(remove_if_empty=True)
        res.status = "empty"
        return res
    try:
        exporter = build_exporter(meta)
    except Exception as exc:
        sp.close(remove_if_empty=False)
        res.status, res.message = "error", f"cannot create exporter {name!r}: {type(exc).__name__}: {exc}"
        res.left = res.pending_items
        return res
    leave = getattr(exporter, "leave_runs_open", None)
    if callable(leave):
        leave(True)  # until the end: a run is not reopened (set RUNNING) by the replay of its data
    t0 = time.monotonic()
    # the run's settings: a queue that gathers reads the frames back together, as in the trainer
    q = DeliveryQueue(
        exporter,
        1000,
        backoff_max_s=max(0.5, min(10.0, timeout_s / 4)),
        spool=sp,
        config=_config(meta.get("config") or {}),
    )
    done = q.wait_idle(timeout_s)
    q.request_stop()
    q.join(max(5.0, min(60.0, timeout_s)))
    res.seconds = time.monotonic() - t0
    try:
        exporter.flush(30.0)
    except Exception as exc:
        res.message = f"exporter flush failed: {exc}"
    st = q.stats
    # the runs end as the trainer ended, once everything is delivered; otherwise they stay as they are
    note = _end_runs(exporter, meta.get(RUN_END_KEY) if done and not st.spool_pending else None)
    try:
        exporter.shutdown()
    except Exception as exc:
        res.message = f"exporter shutdown failed: {exc}"
    if done and not st.spool_pending:
        res.message = res.message or note
    res.delivered = st.replayed
    res.dropped = st.dropped
    res.rejected = st.rejected
    res.corrupt = st.corrupt_frames
    res.left = st.spool_pending
    res.status = "delivered" if done and not res.left else "partial"
    if res.status == "partial" and not res.message:
        res.message = f"the exporter still fails after {timeout_s:.0f}s ({st.failed_attempts} failed attempts)"
    return res


def replay(
    paths: Iterable[str],
    exporters: Sequence[str] | None = None,
    timeout_s: float = 300.0,
    list_only: bool = False,
    out: Any = None,
) -> list[ReplayResult]:
    results = []
    for path in find_spools(paths):
        r = replay_one(path, timeout_s=timeout_s, list_only=list_only, exporters=exporters)
        if r is None:
            continue
        results.append(r)
        if out is not None:
            print(r.line(), file=out, flush=True)
    return results
