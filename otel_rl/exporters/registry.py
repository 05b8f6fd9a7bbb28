"""Exporter lookup by name through entry points (group ``otel_rl.exporters``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib import metadata
from typing import Any

from .base import Exporter

GROUP = "otel_rl.exporters"

# Built into the core distribution; also registered as entry points in
# pyproject.toml.  Kept here so a source checkout without installed metadata
# still finds them.
BUILTIN: dict[str, str] = {
    "console": "otel_rl.exporters.console:ConsoleExporter",
    "file": "otel_rl.exporters.jsonl:JsonlExporter",
    "jsonl": "otel_rl.exporters.jsonl:JsonlExporter",
    "otlp": "otel_rl.exporters.otlp:OtlpExporter",
    "prometheus": "otel_rl.exporters.prometheus:PrometheusExporter",
    "memory": "otel_rl.testing:CaptureExporter",
}

# The command that installs what an exporter needs: its extra of the otel-rl distribution (the tracker
# exporters ship as separate distributions that the extra pulls in).
KNOWN_MISSING: dict[str, str] = {
    "otlp": "pip install 'otel-rl[otlp]'",
    "prometheus": "pip install 'otel-rl[prometheus]'",
    "mlflow": "pip install 'otel-rl[mlflow]'",
    "wandb": "pip install 'otel-rl[wandb]'",
    "tracking": "pip install 'otel-rl[wandb]'",
    "swanlab": "pip install 'otel-rl[swanlab]'",
    "weave": "pip install 'otel-rl[weave]'",
    "tensorboard": "pip install 'otel-rl[tensorboard]'",
    "trackio": "pip install 'otel-rl[trackio]'",
    "clearml": "pip install 'otel-rl[clearml]'",
}

# The library each tracker exporter drives: checked before the exporter is created, so a
# missing one fails at init() with the command to run, not later on the delivery thread.
REQUIRES: dict[str, str] = {
    "mlflow": "mlflow",
    "wandb": "wandb",
    "swanlab": "swanlab",
    "weave": "weave",
    "tensorboard": "tensorboard",
    "trackio": "trackio",
    "clearml": "clearml",
}

# What the built-in exporters import when they are created (checked by `unusable`).
BUILTIN_NEEDS: dict[str, tuple[str, ...]] = {
    "otlp": ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.exporter.otlp.proto.grpc"),
    "prometheus": ("opentelemetry.exporter.prometheus", "prometheus_client"),
}

# verl names otel-rl does not implement (their services are private).
UNSUPPORTED = {"vemlp_wandb", "rl_insight"}


class UnknownExporterError(ValueError):
    pass


_ep_cache: tuple[tuple[str, ...], dict[str, Any]] | None = None


def _entry_points() -> dict[str, Any]:
    """Our entry points (reading every installed distribution's metadata takes ~10 ms: once per
    `sys.path`)."""
    global _ep_cache
    import sys

    key = tuple(sys.path)
    cached = _ep_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        eps = {ep.name: ep for ep in metadata.entry_points(group=GROUP)}
    except Exception:
        return {}
    _ep_cache = (key, eps)
    return eps


def installed_names() -> list[str]:
    return sorted(set(BUILTIN) | set(_entry_points()))


def _load_target(target: str) -> Callable[..., Exporter]:
    mod, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_factory(name: str) -> Callable[..., Exporter]:
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    if name in BUILTIN:
        return _load_target(BUILTIN[name])
    hint = ""
    if name in KNOWN_MISSING:
        hint = f" The {name!r} exporter is a separate distribution: run `{KNOWN_MISSING[name]}`."
    elif name in UNSUPPORTED:
        hint = f" verl's {name!r} logger has no otel-rl exporter; use OTLP to reach other backends."
    raise UnknownExporterError(f"unknown exporter {name!r}.{hint} Installed exporters: {', '.join(installed_names())}.")


def store_client(name: str, location: str) -> Any:
    """A client of tracker `name`'s store at `location` (a tracking URI), made by its plug-in: the exporter
    class's ``store_client`` (otel-rl's `report` and `prune` read a store with it; the core never imports
    a tracker library).  ValueError (`UnknownExporterError`) when the plug-in is missing, or has none."""
    make = getattr(resolve_factory(name), "store_client", None)
    if make is None:
        raise ValueError(f"the {name!r} exporter has no store client")
    return make(location)


def _importable(module: str) -> bool:
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_requires(name: str) -> None:
    module = REQUIRES.get(name)
    if module is not None and not _importable(module):
        raise UnknownExporterError(
            f"the {name!r} exporter needs the {module!r} package, which is not installed: "
            f"run `{KNOWN_MISSING.get(name, f'pip install {module}')}`."
        )


def unusable(name: str) -> str | None:
    """Why the exporter `name` cannot be created here, with the command that fixes it; None when it can.
    Checks the packages it needs and that its entry point loads, without creating it."""
    needs = BUILTIN_NEEDS.get(name, ()) + ((REQUIRES[name],) if name in REQUIRES else ())
    missing = [m for m in needs if not _importable(m)]
    fix = KNOWN_MISSING.get(name)
    if missing:
        return f"needs {', '.join(repr(m) for m in missing)}: {fix or 'pip install ' + missing[0].split('.')[0]}"
    try:
        resolve_factory(name)
    except ImportError as exc:
        return f"cannot import {exc.name or exc}: {fix or 'pip install ' + str(exc.name or name)}"
    except Exception as exc:
        return f"cannot be loaded: {type(exc).__name__}: {exc}"
    return None


def out_of_process_class(name: str) -> Any:
    """The exporter class of `name` when it can run in the export process (a `TrackerExporter`
    that does not opt out), else None.  Raises like `create` for unknown or uninstallable names,
    without creating the exporter (nor importing its tracker library)."""
    from .tracker import TrackerExporter

    _check_requires(name)
    factory = resolve_factory(name)
    if isinstance(factory, type) and issubclass(factory, TrackerExporter) and factory.out_of_process:
        return factory
    return None


def create(name: str, config: Any) -> Exporter:
    _check_requires(name)
    factory = resolve_factory(name)
    try:
        exporter = factory(config)
    except ImportError as exc:
        raise UnknownExporterError(
            f"the {name!r} exporter could not import {exc.name or 'a dependency'!r}: "
            f"run `{KNOWN_MISSING.get(name, 'pip install ' + (exc.name or name))}`."
        ) from exc
    exporter.name = name
    return exporter
