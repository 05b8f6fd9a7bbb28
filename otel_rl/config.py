"""Configuration: keyword arguments > verl-shaped config > environment > defaults.

A verl-shaped config is a dict, an OmegaConf DictConfig, or a list of
verl/Hydra dotlist overrides (``trainer.logger='["console","mlflow"]'``).  The
keys read from it are listed in `VERL_KEYS`; an ``otel_rl:`` section may set any
field of `Config` by its own name.  Environment variables are the OpenTelemetry
standard ones (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_SDK_DISABLED``, ``OTEL_EXPORTER_OTLP_*``, ``OTEL_EXPORTER_PROMETHEUS_*``)
and ``OTEL_RL_*`` for ours (see docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.util.types import AttributeValue

from . import semconv
from .dotlist import ConfigError, apply_dotlist, get_path, parse_value, to_plain

# verl config path -> Config field
VERL_KEYS: dict[str, str] = {
    "trainer.project_name": "project",
    "trainer.experiment_name": "experiment",
    "trainer.logger": "exporters",
    "trainer.log_val_generations": "log_val_generations",
    "actor_rollout_ref.rollout.trace.backend": "trace_backend",
    "actor_rollout_ref.rollout.trace.token2text": "token2text",
    "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker": "max_samples",
    "actor_rollout_ref.rollout.trace.max_samples": "max_samples",
}


@dataclasses.dataclass
class Config:
    """Resolved settings of one otel-rl pipeline.  Field docs in docs/configuration.md."""

    project: str = "otel_rl"
    experiment: str = "default"
    run_id: str = ""
    rank: int = 0
    service_name: str = "otel-rl"
    exporters: tuple[str, ...] = ("console",)
    trace_backend: str | None = None
    token2text: bool = False
    max_samples: int | None = None
    log_val_generations: int = 0
    tracing: bool | None = None  # None: on when an exporter consumes spans or trajectories
    jsonl_path: str | None = None
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9464
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    otlp_headers: str | None = None
    max_value_chars: int = 256 * 1024
    batch_delay_s: float = 0.5  # the pipeline takes what was submitted this often (or at 512 items)
    export_interval_s: float = 1.0  # gathering exporters (trackers, console, JSONL): one delivery per interval
    queue_size: int = 100_000
    queue_max_bytes: int = 32 << 20  # a spooled queue's memory (and the export process link's): beyond it, to disk
    record_overflow: str = "spill"  # log() records beyond queue_size: spill (to a file) | wait (the caller waits)
    rollout_defer_s: float = 5.0  # while trajectories are open, the pipeline leaves its batches for up to this long
    # durable delivery (docs/delivery.md): the on-disk spool behind each exporter's queue
    spool_dir: str | None = None  # None: ~/.cache/otel-rl/spool/<run id>; "off": no spool
    spool_max_bytes: int = 1 << 30  # per exporter queue
    spool_drop_policy: str = "drop_oldest"  # when the cap is hit: drop_oldest | drop_newest
    spool_fsync: str = "batch"  # always | batch | never
    spool_exporters: str = "auto"  # auto (tracker exporters) | all | none | comma list of names
    export_process: str = "auto"  # auto/true: tracker exporters run in a child process | false: in-process
    export_process_nice: int = 19  # the child's niceness increment once its runs are open: training keeps the CPU
    export_process_idle: bool = True  # Linux: once its runs are open, the child runs under SCHED_IDLE
    forward_console: bool = True  # the training process's console to the tracker runs in the export process
    export_process_cpus: str | None = None  # Linux: CPUs the child may run on ("last", or a list like "6,7" / "4-7")
    shutdown_timeout_s: float = 10.0  # shutdown() / exit / SIGTERM: deliver within this, then spool what is left
    handle_sigterm: bool = True  # SIGTERM: deliver (within shutdown_timeout_s), then end by the signal
    set_global_provider: bool = False
    feed_global_provider: bool = True  # a global SDK provider set up by the user gets otel-rl's spans and metrics
    disabled: bool = False
    resource_attributes: dict[str, AttributeValue] = dataclasses.field(default_factory=dict)
    verl_config: dict[str, object] = dataclasses.field(default_factory=dict)  # the full config, for run start

    def exporter_names(self) -> list[str]:
        names = list(self.exporters)
        if self.trace_backend and self.trace_backend not in names:
            names.append(self.trace_backend)
        return names


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}

# environment variable -> field (ours); OTEL standard ones are handled in _from_env
ENV_KEYS: dict[str, str] = {
    "OTEL_RL_PROJECT": "project",
    "OTEL_RL_EXPERIMENT": "experiment",
    semconv.ENV_RUN_ID: "run_id",
    semconv.ENV_RANK: "rank",
    "OTEL_RL_EXPORTERS": "exporters",
    "OTEL_RL_TRACE_BACKEND": "trace_backend",
    "OTEL_RL_TOKEN2TEXT": "token2text",
    "OTEL_RL_MAX_SAMPLES": "max_samples",
    "OTEL_RL_LOG_VAL_GENERATIONS": "log_val_generations",
    "OTEL_RL_TRACING": "tracing",
    "OTEL_RL_JSONL_PATH": "jsonl_path",
    "OTEL_RL_MAX_VALUE_CHARS": "max_value_chars",
    "OTEL_RL_BATCH_DELAY_S": "batch_delay_s",
    "OTEL_RL_EXPORT_INTERVAL_S": "export_interval_s",
    "OTEL_RL_QUEUE_SIZE": "queue_size",
    "OTEL_RL_QUEUE_MAX_BYTES": "queue_max_bytes",
    "OTEL_RL_RECORD_OVERFLOW": "record_overflow",
    "OTEL_RL_ROLLOUT_DEFER_S": "rollout_defer_s",
    "OTEL_RL_SPOOL_DIR": "spool_dir",
    "OTEL_RL_SPOOL_MAX_BYTES": "spool_max_bytes",
    "OTEL_RL_SPOOL_DROP_POLICY": "spool_drop_policy",
    "OTEL_RL_SPOOL_FSYNC": "spool_fsync",
    "OTEL_RL_SPOOL_EXPORTERS": "spool_exporters",
    "OTEL_RL_EXPORT_PROCESS": "export_process",
    "OTEL_RL_EXPORT_PROCESS_NICE": "export_process_nice",
    "OTEL_RL_EXPORT_PROCESS_IDLE": "export_process_idle",
    "OTEL_RL_FORWARD_CONSOLE": "forward_console",
    "OTEL_RL_EXPORT_PROCESS_CPUS": "export_process_cpus",
    "OTEL_RL_FEED_GLOBAL_PROVIDER": "feed_global_provider",
    "OTEL_RL_SHUTDOWN_TIMEOUT_S": "shutdown_timeout_s",
    "OTEL_RL_HANDLE_SIGTERM": "handle_sigterm",
    "OTEL_EXPORTER_PROMETHEUS_HOST": "prometheus_host",
    "OTEL_EXPORTER_PROMETHEUS_PORT": "prometheus_port",
}


_MAX_CPU = 65535  # beyond any CPU number Linux gives (a typo like 0-99999999 is an error, not a huge set)


def cache_dir(*parts: str) -> str:
    """Where otel-rl keeps files between runs: ``$XDG_CACHE_HOME/otel-rl/<parts>``
    (``~/.cache/otel-rl/<parts>`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "otel-rl", *parts)


def parse_cpu_list(text: str, label: str = "export_process_cpus") -> set[int]:
    """CPU numbers from a cpuset-style list: ``3``, ``0,2``, ``4-7``, ``0-1,6``."""
    cpus: set[int] = set()
    try:
        for part in str(text).split(","):
            lo, sep, hi = part.strip().partition("-")
            a = int(lo)
            b = int(hi) if sep else a
            if a < 0 or b < a or b > _MAX_CPU:
                raise ValueError
            cpus.update(range(a, b + 1))
    except ValueError:
        raise ConfigError(f"{label}: expected 'last' or CPU numbers like '3', '0,2' or '4-7', got {text!r}") from None
    return cpus


# ----------------------------------------------------------------------------- coercion


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: expected a boolean, got {v!r}")


def _as_int(name: str, v: Any, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, str) and allow_none and v.strip().lower() in ("", "none", "null"):
        return None
    try:
        if isinstance(v, bool):
            raise ValueError
        out = int(v)
        if isinstance(v, float) and out != v:
            raise ValueError
        return out
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {v!r}") from None


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def _as_size(name: str, v: Any) -> int:
    """Bytes: an integer or a string with a unit (``512MiB``, ``2GB``, ``1g``)."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", v)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _SIZE_UNITS:
            raise ConfigError(f"{name}: expected a size in bytes (e.g. 1073741824, 512MiB, 2GB), got {v!r}")
        out = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        out = _as_int(name, v)  # type: ignore[assignment]
    if out is None or out <= 0:
        raise ConfigError(f"{name}: must be > 0, got {v!r}")
    return out


def _as_names(name: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            return _as_names(name, parse_value(s))
        return tuple(p.strip() for p in s.split(",") if p.strip())
    if isinstance(v, (list, tuple)):
        out = []
        for x in v:
            if not isinstance(x, str):
                raise ConfigError(f"{name}: exporter names must be strings, got {x!r}")
            out.append(x.strip())
        return tuple(out)
    raise ConfigError(f"{name}: expected a name or a list of names, got {v!r}")


def _coerce(field: str, v: Any, source: str) -> Any:
    label = f"{field} (from {source})"
    if field in (
        "token2text",
        "set_global_provider",
        "feed_global_provider",
        "disabled",
        "export_process_idle",
        "forward_console",
        "handle_sigterm",
    ):
        return _as_bool(label, v)
    if field == "tracing":
        return None if v is None else _as_bool(label, v)
    if field in ("spool_max_bytes", "queue_max_bytes"):
        return _as_size(label, v)
    if field in ("spool_drop_policy", "spool_fsync"):
        choices = ("drop_oldest", "drop_newest") if field == "spool_drop_policy" else ("always", "batch", "never")
        s = str(v).strip().lower()
        if field == "spool_drop_policy" and s in ("oldest", "newest"):
            s = "drop_" + s
        if s not in choices:
            raise ConfigError(f"{label}: expected one of {', '.join(choices)}, got {v!r}")
        return s
    if field == "record_overflow":
        s = str(v).strip().lower()
        if s not in ("spill", "wait"):
            raise ConfigError(f"{label}: expected spill or wait, got {v!r}")
        return s
    if field == "export_process":
        s = str(v).strip().lower()
        if s == "auto":
            return s
        return "true" if _as_bool(label + " (auto, true or false)", v) else "false"
    if field == "spool_exporters" and isinstance(v, (list, tuple)):
        return ",".join(_as_names(label, v))
    if field in (
        "rank",
        "log_val_generations",
        "prometheus_port",
        "max_value_chars",
        "queue_size",
        "export_process_nice",
    ):
        out = _as_int(label, v)
        if field == "log_val_generations" and out is not None and out < 0:
            raise ConfigError(f"{label}: must be >= 0")
        return out
    if field == "max_samples":
        out = _as_int(label, v, allow_none=True)
        if out is not None and out < 0:
            raise ConfigError(f"{label}: must be >= 0 or None")
        return out
    if field == "batch_delay_s":
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{label}: expected seconds, got {v!r}") from None
    if field == "export_process_cpus":
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null", "off", "all")):
            return None
        text = ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v).strip().lower()
        if text != "last":
            parse_cpu_list(text, label)
        return text
    if field in ("export_interval_s", "rollout_defer_s", "shutdown_timeout_s"):
        try:
            out_s = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{label}: expected seconds, got {v!r}") from None
        if not 0.0 <= out_s <= 3600.0:
            raise ConfigError(f"{label}: expected seconds between 0 and 3600, got {v!r}")
        return out_s
    if field == "exporters":
        return _as_names(label, v)
    if field == "trace_backend":
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "null")):
            return None
        if not isinstance(v, str):
            raise ConfigError(f"{label}: expected an exporter name, got {v!r}")
        return v.strip()
    if field in ("resource_attributes", "verl_config"):
        if not isinstance(v, Mapping):
            raise ConfigError(f"{label}: expected a mapping, got {v!r}")
        return dict(v)
    if v is None:
        return None
    if isinstance(v, (dict, list)):
        raise ConfigError(f"{label}: expected a scalar, got {v!r}")
    return str(v)


# ----------------------------------------------------------------------------- layers


def _from_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, field in VERL_KEYS.items():
        found, value = get_path(cfg, path)
        if not found:
            continue
        if field == "max_samples" and out.get(field) is not None:
            continue  # the verl key max_samples_per_step_per_worker wins over the short alias
        out[field] = _coerce(field, value, f"config {path}")
    ours = cfg.get("otel_rl")
    if isinstance(ours, Mapping):
        for k, v in ours.items():
            if k not in _FIELDS or k == "verl_config":
                raise ConfigError(f"unknown setting otel_rl.{k}; known: {', '.join(sorted(_FIELDS))}")
            out[k] = _coerce(k, v, f"config otel_rl.{k}")
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for var, field in ENV_KEYS.items():
        if var in env and env[var] != "":
            out[field] = _coerce(field, env[var], f"env {var}")
    if "rank" not in out:
        for var in ("RANK", "LOCAL_RANK"):  # torch.distributed / torchrun
            if env.get(var, "") != "":
                out["rank"] = _coerce("rank", env[var], f"env {var}")
                break
    if env.get("OTEL_SERVICE_NAME"):
        out["service_name"] = env["OTEL_SERVICE_NAME"]
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        out["disabled"] = True
    return out


def resolve(
    config: Any = None,
    overrides: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Config:
    """Build a Config: kwargs > config (+ dotlist overrides) > env > defaults."""
    env = os.environ if env is None else env
    if isinstance(config, (list, tuple)):
        overrides = list(config) + list(overrides or [])
        config = None
    plain = to_plain(config) if config is not None else {}
    if not isinstance(plain, dict):
        raise ConfigError(f"config must be a mapping or a list of overrides, got {type(config).__name__}")
    if overrides:
        plain = apply_dotlist(plain, overrides, strict="owned")

    values: dict[str, Any] = {}
    values.update(_from_env(env))
    values.update(_from_config(plain))
    if "logger" in kwargs:  # verl's name for the exporter list
        kwargs.setdefault("exporters", kwargs.pop("logger"))
    if "max_samples_per_step_per_worker" in kwargs:
        kwargs.setdefault("max_samples", kwargs.pop("max_samples_per_step_per_worker"))
    for k, v in kwargs.items():
        if k not in _FIELDS:
            raise ConfigError(f"unknown setting {k!r}; known: {', '.join(sorted(_FIELDS))}")
        if v is None and k not in ("tracing",):
            continue  # None means "not given" for keyword arguments
        values[k] = _coerce(k, v, "argument")
    cfg = Config(**values)
    cfg.verl_config = plain
    if not cfg.run_id:
        cfg.run_id = uuid.uuid4().hex[:16]
    return cfg
