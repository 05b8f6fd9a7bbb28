"""`init()`, the one current pipeline of the process (`current`), and what happens to it at exit and in a
forked child."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _exit, _runtime
from ._assemble import build_exporters
from ._handle import Handle
from ._processors import global_sdk_providers, maybe_set_global
from .config import resolve
from .export_process.protocol import IN_EXPORT_PROCESS as _IN_EXPORT_PROCESS
from .exporters import registry
from .exporters.base import Exporter
from .instrument import _open_traced

_log = logging.getLogger("otel_rl")
_atexit_registered = False
_init_lock = threading.Lock()

#: captures (`otel_rl.testing.CaptureExporter`) that every pipeline started joins: the test kit's fixture
joining: list[Any] = []


def init(
    config: Mapping[str, object] | Sequence[str] | None = None,
    *,
    overrides: Sequence[str] | None = None,
    tokenizer: object = None,
    exporters: str | Exporter | Iterable[str | Exporter] | None = None,
    **kwargs: object,
) -> Handle:
    """Start otel-rl.  Precedence: keyword arguments > `config` (+ `overrides`) > environment > defaults.

    `config` is a verl-shaped dict / DictConfig or a list of dotlist overrides.
    `exporters` (alias `logger`) takes names and/or `Exporter` instances.
    Returns the `Handle`; it becomes the current one used by `otel_rl.log()`
    and the decorators.  A previous handle is shut down first.
    """
    global _atexit_registered
    settings: dict[str, Any] = kwargs
    given: list[Exporter] = []
    if "logger" in settings and exporters is None:
        exporters = settings.pop("logger")
    if exporters is not None:
        names: list[str] = []
        for e in [exporters] if isinstance(exporters, (str, Exporter)) else list(exporters):
            if isinstance(e, Exporter):
                given.append(e)
            else:
                names.append(e)
        if names or not given:
            settings["exporters"] = names
        elif given:
            settings["exporters"] = []
    cfg = resolve(config, overrides, **settings)
    given += [cap.joining() for cap in joining if cap not in given]
    # the user's own OpenTelemetry pipeline: a global SDK provider set before init(), not one that a
    # tracker library sets while its exporter starts (_processors); never in the export process
    global_providers = (
        global_sdk_providers(registry.REQUIRES.values()) if os.environ.get(_IN_EXPORT_PROCESS) != "1" else (None, None)
    )
    built = build_exporters(cfg, given)  # raises for unknown names before anything starts
    with _init_lock:
        previous = _runtime.active.handle
        if previous is not None:
            if not getattr(previous, "replaced_quietly", False):
                _log.warning("otel-rl: init() called again; shutting down the previous pipeline")
            previous.shutdown()
        handle = Handle(cfg, built, tokenizer, global_providers)
        for cap in joining:
            cap.handle = handle
        global forked_from
        forked_from = None
        _runtime.install(handle.runtime)
        if not _atexit_registered:
            atexit.register(_shutdown_current)
            _atexit_registered = True
        if not cfg.disabled and os.environ.get(_IN_EXPORT_PROCESS) != "1":
            _exit.install(_shutdown_current, cfg.handle_sigterm)
    if not cfg.disabled:
        maybe_set_global(cfg)
    return handle


#: in a forked child of a process whose pipeline was running: the parent's pid (for `otel_rl.log`'s warning)
forked_from: int | None = None


def _after_fork_in_child() -> None:
    # the pipeline's threads do not exist in a forked child: telemetry there is off until it calls init()
    global forked_from
    if _runtime.active.handle is not None:
        forked_from = os.getppid()
        _runtime.uninstall()
        _open_traced.clear()  # the parent's rollouts
        _log.debug("otel-rl: forked child: telemetry off until otel_rl.init() is called in the child")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _shutdown_current() -> None:
    h = _runtime.active.handle
    if h is not None:
        h.shutdown()  # within its shutdown_timeout_s


def current() -> Handle | None:
    return _runtime.active.handle
