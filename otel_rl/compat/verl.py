"""verl's tracking API (verl 0.9.1 signatures and behaviour), routed through otel-rl.

Use these names where verl's are used::

    from otel_rl.compat.verl import Tracking, ValidationGenerationsLogger
    from otel_rl.compat.verl import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

or let `otel_rl.integrations.verl.install()` put them into an installed verl.

- `Tracking(project_name, experiment_name, default_backend="console", config=None)`:
  ``log(data, step, backend=None)`` and ``finish(exit_code=0)`` (also run by ``__del__``).
  Backends are otel-rl exporters of one pipeline: ``console`` and ``file`` print and
  write verl's bytes; ``wandb``, ``mlflow``, ``swanlab``, ``tensorboard``, ``clearml`` and
  ``trackio`` are the tracker exporters;
  ``tracking`` is the deprecated alias of ``wandb``.  ``backend=`` restricts a call
  to some of them, as in verl.  Nothing is exported on the calling thread.
- `ValidationGenerationsLogger(project_name, experiment_name).log(loggers, samples, step)`:
  the rows go to the listed loggers as otel-rl generations.
- `RolloutTraceConfig` (singleton), `rollout_trace_attr` and `rollout_trace_op`: with a
  backend, a `rollout_trace_attr` block is an `otel_rl.trajectory` (one trace per
  rollout, linked to the step span) and a `rollout_trace_op` method an `otel_rl.op`;
  with no backend (``None``) both pass through, as in verl.

Deviations from verl, on purpose (docs/verl.md):

- the file logger appends to an existing file (verl truncates it), so a resumed run
  continues its file; NaN and +-Inf are written as "NaN"/"Infinity"/"-Infinity"
  (verl writes null); values that are not scalars are skipped with a warning;
- ``max_samples_per_step_per_worker`` is applied by otel-rl's deterministic sampler
  (`RolloutTraceConfig.deterministic_sampling`, default True): the attribute
  verl's agent loop reads is then None, so verl's own random choice does not
  switch tracing off for the other samples, and a failing rollout is still kept;
- `RolloutTraceConfig.get_client()` returns the otel-rl `Handle`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional, SupportsInt, TypeVar, cast

from .._handle import Handle
from .._init import current, init
from .._values import warn_once
from ..dotlist import get_path, to_plain
from ..exporters.registry import UnknownExporterError
from ..instrument import TrajectoryState, op, trajectory

_log = logging.getLogger("otel_rl")

__all__ = [
    "RolloutTraceConfig",
    "Tracking",
    "ValidationGenerationsLogger",
    "rollout_trace_attr",
    "rollout_trace_op",
]

#: a method `rollout_trace_op` decorates: given back with its signature
F = TypeVar("F", bound=Callable[..., object])

# verl's logger names that otel-rl serves, then otel-rl's own exporters (usable in trainer.logger too)
VERL_BACKENDS = ["wandb", "mlflow", "swanlab", "tensorboard", "console", "clearml", "trackio", "file"]
OTEL_RL_BACKENDS = ["otlp", "prometheus", "jsonl", "memory"]


def _names(backends: Any) -> list[str]:
    if backends is None:
        return []
    if isinstance(backends, str):
        return [backends]
    return [str(b) for b in backends]  # list, tuple, OmegaConf ListConfig


#: settings for a pipeline these classes start (otel_rl.integrations.verl: a Ray worker's rank and attributes)
new_pipeline_settings: Any = None


def _join_or_init(
    config: Any, project: str, experiment: str, exporters: list[str] | None, **settings: Any
) -> tuple[Handle, bool]:
    """The running pipeline with `exporters` added, or a new one.  Returns (handle, created).

    `exporters` None: a new pipeline takes them from the environment (a worker joining a run)."""
    h = current()
    if h is not None and not h.closed:
        for name in exporters or ():
            h.add_exporter(name)
        return h, False
    if new_pipeline_settings is not None:
        settings = {**new_pipeline_settings(), **settings}
    try:
        return init(config, project=project, experiment=experiment, exporters=exporters, **settings), True
    except UnknownExporterError:
        # a rollout-trace backend from the config that otel-rl cannot serve (verl's trackio, a typo)
        # must not stop the metrics: verl itself would just not trace
        plain = to_plain(config) if config is not None else {}
        found, backend = get_path(plain if isinstance(plain, dict) else {}, "actor_rollout_ref.rollout.trace.backend")
        if not found or not backend or backend in (exporters or ()) or "trace_backend" in settings:
            raise
        warn_once(
            f"trace-backend:{backend}",
            "otel-rl: rollout trace backend %r has no otel-rl exporter; rollouts are not traced",
            backend,
        )
        return init(
            config, project=project, experiment=experiment, exporters=exporters, trace_backend="", **settings
        ), True


# ----------------------------------------------------------------------------- Tracking


class _BackendLogger:
    """What ``Tracking.logger[name]`` holds: ``log(data, step)`` to that backend alone."""

    def __init__(self, handle: Handle, name: str):
        self._handle = handle  # not the Tracking: no cycle, so `del tracking` finishes at once as in verl
        self.name = name

    def log(self, data: Mapping[str, object], step: SupportsInt | str | bytes | None) -> None:
        self._handle.log(data, step, exporters=(self.name,))

    def flush(self) -> None:
        self._handle.flush()

    def finish(self) -> None:
        self._handle.flush()


class Tracking:
    """verl's unified tracking interface, on one otel-rl pipeline.

    When no otel-rl pipeline is running, it starts one (``otel_rl.init(config, ...)``,
    so verl's ``actor_rollout_ref.rollout.trace.*`` keys in `config` apply) and
    `finish()` shuts it down.  When one is running (``otel_rl.init`` was called, or
    a worker joined the run), its backends are added to it and `finish()` only
    flushes.  Either way `log()` reaches this object's backends only.
    """

    supported_backend = VERL_BACKENDS + OTEL_RL_BACKENDS

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | Sequence[str] | None = "console",
        config: Mapping[str, object] | None = None,
    ):
        backends = _names(default_backend)
        for backend in backends:
            if backend == "tracking":
                warnings.warn("`tracking` logger is deprecated. use `wandb` instead.", DeprecationWarning, stacklevel=2)
            elif backend not in self.supported_backend:
                raise AssertionError(f"{backend} is not supported")  # verl asserts; this survives `python -O`

        self.logger: dict[str, _BackendLogger] = {}
        self._finished = False
        names: list[str] = []
        for b in backends:
            name = "wandb" if b == "tracking" else b
            if name not in names:
                names.append(name)
        self.handle, self._owns_handle = _join_or_init(config, project_name, experiment_name, names)
        present = {e.name for e in self.handle.exporters}
        for name in names:
            if name in present:
                self.logger[name] = _BackendLogger(self.handle, name)
        if "console" in self.logger:
            self.console_logger = self.logger["console"]
        self._targets = tuple(self.logger)

    def log(
        self,
        data: Mapping[str, object],
        step: SupportsInt | str | bytes | None,
        backend: str | Sequence[str] | None = None,
    ) -> None:
        # verl: `if backend is None or default_backend in backend` (a string matches its substrings, as in verl)
        if backend is None:
            targets = self._targets
        else:
            targets = tuple(name for name in self._targets if name in backend)
        if targets:
            self.handle.log(data, step, exporters=targets)

    def finish(self, exit_code: int = 0) -> None:
        """Flush and finalize every configured backend exactly once."""
        if getattr(self, "_finished", True):
            return
        self._finished = True
        h = getattr(self, "handle", None)
        if h is None or h.closed:
            return
        if exit_code:
            _log.warning("otel-rl: training ended with exit code %s", exit_code)
        if self._owns_handle:
            h.shutdown()
        else:
            h.flush()

    def __del__(self) -> None:
        try:
            self.finish()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


# ----------------------------------------------------------------------------- validation generations


@dataclasses.dataclass
class ValidationGenerationsLogger:
    """verl's validation generations table: ``log(loggers, samples, step)``.

    `samples` are verl's ``(input, output, score)`` rows; they go to the running
    pipeline's exporters named in `loggers` (e.g. ``trainer.logger``) as one
    ``Generations`` record (MLflow: a table per step, WandB: verl's ``val/generations``
    table, SwanLab: an echarts table).
    """

    project_name: Optional[str] = None  # noqa: UP045 - verl's field types
    experiment_name: Optional[str] = None  # noqa: UP045

    def log(
        self, loggers: str | Sequence[str], samples: Iterable[Sequence[object]], step: SupportsInt | str | bytes | None
    ) -> None:
        h = current()
        if h is None or h.closed:
            warn_once(
                "val-gen-no-init",
                "otel-rl: ValidationGenerationsLogger.log() without a running otel-rl "
                "pipeline (create Tracking or call otel_rl.init first); nothing recorded",
            )
            return
        names = tuple(e.name for e in h.exporters if e.name in loggers)
        if not names:
            return
        rows = list(samples)
        h.log_generations(rows, step, limit=len(rows), exporters=names)


# ----------------------------------------------------------------------------- rollout traces


class RolloutTraceConfig:
    """verl's rollout-trace singleton; with a backend, rollouts are traced by otel-rl.

    ``init(project_name, experiment_name, backend, token2text=False,
    max_samples_per_step_per_worker=None)`` runs once per process (later calls are
    ignored, as in verl).  With a backend it makes sure an otel-rl pipeline runs in
    this process (joining the run through ``OTEL_RL_*`` variables in a worker) and
    that the exporter named `backend` receives the trajectories.
    """

    _instance: Optional[RolloutTraceConfig] = None  # noqa: UP045
    backend: Optional[str] = None  # noqa: UP045
    client: Optional[object] = None  # noqa: UP045
    token2text: bool = False
    _initialized: bool = False
    project_name: Optional[str] = None  # noqa: UP045
    experiment_name: Optional[str] = None  # noqa: UP045
    max_samples_per_step_per_worker: Optional[int] = None  # noqa: UP045
    #: the number asked for (``max_samples_per_step_per_worker`` is None when otel-rl samples)
    max_samples: Optional[int] = None  # noqa: UP045
    #: sample with otel-rl's deterministic sampler instead of verl's random choice
    deterministic_sampling: bool = True

    def __new__(cls, *args: Any, **kwargs: Any) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._initialized = False
        return cls._instance

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def init(
        cls,
        project_name: str,
        experiment_name: str,
        backend: str,
        token2text: bool = False,
        max_samples_per_step_per_worker: int | None = None,
    ) -> None:
        config = cls.get_instance()
        if config._initialized:
            return
        config.backend = backend
        config.token2text = token2text
        config.project_name = project_name
        config.experiment_name = experiment_name
        config.max_samples = max_samples_per_step_per_worker
        config.max_samples_per_step_per_worker = None if cls.deterministic_sampling else max_samples_per_step_per_worker
        config.client = None
        if backend is not None:
            config.client = _trace_pipeline(
                project_name,
                experiment_name,
                backend,
                token2text,
                max_samples_per_step_per_worker if cls.deterministic_sampling else None,
            )
        config._initialized = True
        for hook in list(_init_hooks):
            try:
                hook(config)
            except Exception:  # pragma: no cover - a hook never breaks verl's init
                _log.exception("otel-rl: RolloutTraceConfig init hook failed")

    @classmethod
    def get_backend(cls) -> str | None:
        return cls.get_instance().backend

    @classmethod
    def get_client(cls) -> object | None:
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> bool | None:
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        cls._instance = None


# called with the config after each RolloutTraceConfig.init (otel_rl.integrations.verl registers one)
_init_hooks: list[Any] = []


def _trace_pipeline(
    project: str, experiment: str, backend: str, token2text: bool, max_samples: int | None
) -> Handle | None:
    t2t = token2text or None
    h = current()
    try:
        if h is None or h.closed:
            h, _ = _join_or_init(
                None, project, experiment, None, trace_backend=backend, token2text=t2t, max_samples=max_samples
            )
        else:
            h.set_trace_settings(trace_backend=backend, token2text=t2t, max_samples=max_samples)
    except UnknownExporterError as exc:
        warn_once(
            f"trace-backend:{backend}", "otel-rl: rollout trace backend %r: %s; rollouts are not traced", backend, exc
        )
        if h is None or h.closed:
            h, _ = _join_or_init(None, project, experiment, None, token2text=t2t, max_samples=max_samples)
    return h


@contextlib.contextmanager
def rollout_trace_attr(
    sample_index: SupportsInt | None = None,
    step: SupportsInt | None = None,
    rollout_n: SupportsInt | None = None,
    name: str = "rollout_trace",
    validate: bool = False,
    trace: bool = True,
) -> Iterator[TrajectoryState | None]:
    """One rollout as its own trace (`otel_rl.trajectory`); a pass-through when no backend is set.

    `trace=False` turns off every op inside.  Yields the trajectory state
    (``t.set_reward(x)``), or None when there is no backend.
    """
    if RolloutTraceConfig.get_backend() is None:
        yield None
        return
    with trajectory(
        step=_int_or_none(step),
        sample_index=_int_or_none(sample_index),
        rollout_n=_int_or_none(rollout_n),
        validate=bool(validate),
        name=name,
        trace=trace,
    ) as t:
        yield t


def _int_or_none(v: Any) -> Any:
    if v is None or isinstance(v, int):
        return v
    try:
        return int(v)  # numpy integers from verl's batch index
    except (TypeError, ValueError):
        return v


def rollout_trace_op(func: F) -> F:
    """Trace a method (sync or async) as an `otel_rl.op` span named by its qualname.

    Inputs are the bound arguments without ``self``; the output is the return value
    (with ``prompt_text``/``response_text`` when token2text is on and the object
    has a ``tokenizer``).  A pass-through when no backend is set.
    """
    traced = op(func)
    call: Any = func  # (awaited when a coroutine function)
    call_traced: Any = traced

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if RolloutTraceConfig.get_backend() is None:
                return await call(self, *args, **kwargs)
            return await call_traced(self, *args, **kwargs)

        async_wrapper.__otel_rl_rollout_trace_op__ = True  # type: ignore[attr-defined]
        return cast(F, async_wrapper)

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if RolloutTraceConfig.get_backend() is None:
            return func(self, *args, **kwargs)
        return traced(self, *args, **kwargs)

    wrapper.__otel_rl_rollout_trace_op__ = True  # type: ignore[attr-defined]
    return cast(F, wrapper)
