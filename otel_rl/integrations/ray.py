"""Ray workers (actors and tasks) in the driver's run, their trajectories linked to its step span.

Driver::

    import otel_rl
    from otel_rl.integrations import ray as otel_ray

    h = otel_rl.init(cfg)
    Worker = ray.remote(RolloutWorker)
    workers = [Worker.options(name=f"rollout_worker_{i}", runtime_env=otel_ray.runtime_env()).remote()
               for i in range(n)]
    with otel_rl.step(step):
        ctx = otel_ray.inject()                                  # W3C trace context + the step number
        ray.get([w.generate.remote(batch, otel_rl_context=ctx) for w in workers])

Worker::

    class RolloutWorker:
        def __init__(self):
            otel_ray.init_worker()                               # same run id, its own rank

        @otel_ray.propagated                                     # takes the otel_rl_context keyword
        async def generate(self, batch):
            with otel_rl.trajectory(sample_index=i) as t:        # rl.step and the link come from the driver
                ...
            otel_rl.flush()                                      # a Ray worker may be killed without atexit

`runtime_env()` carries `Handle.worker_env()` (run id, project, experiment, exporters,
sampling) plus the driver's non-secret ``OTEL_EXPORTER_OTLP_*`` endpoint and protocol.
A worker's rank is, in order: `init_worker(rank=...)`, ``OTEL_RL_RANK`` (e.g.
``runtime_env(rank=3)``), ``RANK``, ``LOCAL_RANK``, the number that ends the Ray actor's
name (``rollout_worker_3`` -> 3), else 0.  Every worker's resource also carries
``ray.job.id``, ``ray.node.id``, ``ray.worker.id`` and, in an actor, ``ray.actor.id`` /
``ray.actor.name``, so processes with the same rank stay apart.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.trace import NonRecordingSpan

from .. import semconv as sc
from .._handle import Handle
from .._init import current, init
from .._runtime import STEP
from ..instrument import _StepState

#: what a function `propagated` wraps returns
R = TypeVar("R")

__all__ = [
    "CONTEXT_KWARG",
    "STEP_KEY",
    "actor_options",
    "init_worker",
    "inject",
    "propagated",
    "ray_rank",
    "runtime_env",
    "step_context",
    "worker_env",
    "worker_settings",
]

#: keyword argument that `propagated` takes the driver's carrier from
CONTEXT_KWARG = "otel_rl_context"
#: carrier key with the driver's step number (next to ``traceparent``)
STEP_KEY = "otel-rl-step"

# the driver's OTLP settings that workers need to reach the same collector (no headers: secrets)
_FORWARDED = tuple(
    f"OTEL_EXPORTER_OTLP_{kind}{what}"
    for kind in ("", "TRACES_", "METRICS_")
    for what in ("ENDPOINT", "PROTOCOL", "INSECURE")
) + ("OTEL_SERVICE_NAME", "OTEL_PROPAGATORS")
_RANK_ENV = (sc.ENV_RANK, "RANK", "LOCAL_RANK")


# ----------------------------------------------------------------------------- driver side


def worker_env(handle: Handle | None = None) -> dict[str, str]:
    """Environment variables that make a worker process join `handle`'s run (default: the current one)."""
    env = {k: os.environ[k] for k in _FORWARDED if os.environ.get(k)}
    h = handle or current()
    if h is not None:
        env.update(h.worker_env())
        c = h.config
        if c.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = c.otlp_endpoint
        if c.otlp_protocol:
            env["OTEL_EXPORTER_OTLP_PROTOCOL"] = c.otlp_protocol
        if c.jsonl_path:
            env["OTEL_RL_JSONL_PATH"] = os.path.abspath(c.jsonl_path)
    else:
        env.update({k: v for k, v in os.environ.items() if k.startswith("OTEL_RL_") and v})
    return env


def runtime_env(
    handle: Handle | None = None,
    base: Mapping[str, object] | None = None,
    *,
    rank: int | None = None,
    exporters: str | Iterable[str] | None = None,
) -> dict[str, object]:
    """A Ray ``runtime_env`` (`base` plus ``env_vars``) for workers of `handle`'s run.

    Variables already in `base` win over the run's; `rank` and `exporters` (names)
    set that worker's ``OTEL_RL_RANK`` / ``OTEL_RL_EXPORTERS``.
    """
    out: dict[str, Any] = dict(base or {})
    env = {**worker_env(handle), **dict(out.get("env_vars") or {})}
    if rank is not None:
        env[sc.ENV_RANK] = str(int(rank))
    if exporters is not None:
        env["OTEL_RL_EXPORTERS"] = exporters if isinstance(exporters, str) else ",".join(exporters)
    out["env_vars"] = env
    return out


def actor_options(rank: int | None = None, handle: Handle | None = None, **options: object) -> dict[str, object]:
    """Options for ``ActorClass.options(**actor_options(rank=i, name=...))``."""
    given: Any = options.get("runtime_env")  # (a runtime_env mapping, or None)
    options["runtime_env"] = runtime_env(handle, given, rank=rank)
    return options


def inject(carrier: dict[str, str] | None = None) -> dict[str, str]:
    """The current step's trace context (W3C ``traceparent``, ...) and number, to pass to a worker.

    Inside ``otel_rl.step(n)`` the carrier points at the step span (also from inside a
    timer), so the worker's trajectories link to it as they would in the driver.
    """
    carrier = {} if carrier is None else carrier
    st = STEP.get()
    ctx = None
    if st is not None and st.span_context is not None:
        ctx = trace_api.set_span_in_context(NonRecordingSpan(st.span_context))
    propagate.inject(carrier, context=ctx)
    if st is not None:
        carrier[STEP_KEY] = str(st.n)
    return carrier


# ----------------------------------------------------------------------------- worker side


def _ray_context() -> Any:
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context()
    except Exception:
        return None


def ray_rank() -> int | None:
    """The number at the end of the current Ray actor's name (``agent_loop_worker_3`` -> 3), if any."""
    rc = _ray_context()
    if rc is None:
        return None
    try:
        name = rc.get_actor_name()
    except Exception:
        return None
    m = re.search(r"(\d+)$", name or "")
    return int(m.group(1)) if m else None


def worker_settings(rank: int | None = None) -> dict[str, object]:
    """`otel_rl.init` settings for this Ray worker: its rank (see the module doc) and Ray resource attributes."""
    settings: dict[str, object] = {}
    if rank is None and not any(os.environ.get(v, "") != "" for v in _RANK_ENV):
        rank = ray_rank()
    if rank is not None:
        settings["rank"] = int(rank)
    attrs: dict[str, Any] = {}
    rc = _ray_context()
    if rc is not None:
        for key, getter in (
            ("ray.job.id", "get_job_id"),
            ("ray.node.id", "get_node_id"),
            ("ray.worker.id", "get_worker_id"),
            ("ray.actor.id", "get_actor_id"),
            ("ray.actor.name", "get_actor_name"),
        ):
            try:
                v = getattr(rc, getter)()
            except Exception:
                v = None
            if v:
                attrs[key] = str(v)
    attrs["process.pid"] = os.getpid()
    settings["resource_attributes"] = attrs
    return settings


def init_worker(rank: int | None = None, **settings: object) -> Handle:
    """Start otel-rl in a Ray worker from the environment the driver set (see `runtime_env`).

    Idempotent: a worker that already runs a pipeline of the same run gets it back
    (tasks reuse worker processes).  Keyword arguments go to `otel_rl.init` and win.
    """
    h = current()
    run_id = os.environ.get(sc.ENV_RUN_ID)
    if h is not None and not h.closed and (not run_id or h.run_id == run_id):
        return h
    s: dict[str, Any] = worker_settings(rank)
    given: Any = settings.pop("resource_attributes", None)  # (a mapping, or None)
    attrs = {**s.pop("resource_attributes", {}), **dict(given or {})}
    s.update(settings)
    return init(resource_attributes=attrs, **s)


class step_context:
    """Continue the driver's step (a carrier from `inject`) in this worker, sync or async.

    Inside, ``otel_rl.trajectory()`` takes the driver's step number and links to its
    step span; other spans become children of that span.  No carrier: does nothing.
    """

    __slots__ = ("_carrier", "_otel_token", "_step_token")

    def __init__(self, carrier: Mapping[str, str] | None):
        self._carrier = carrier

    def __enter__(self) -> _StepState | None:
        self._otel_token = self._step_token = None
        carrier = self._carrier
        if not carrier:
            return None
        ctx = propagate.extract(dict(carrier))
        span_ctx = trace_api.get_current_span(ctx).get_span_context()
        self._otel_token = otel_context.attach(ctx)
        raw = carrier.get(STEP_KEY)
        st = None
        if raw is not None:
            try:
                st = _StepState(int(raw))
            except (TypeError, ValueError):
                st = None
        if st is not None:
            st.span_context = span_ctx if span_ctx.is_valid else None
            self._step_token = STEP.set(st)
        return st

    def __exit__(self, *exc: object) -> Literal[False]:
        if self._step_token is not None:
            STEP.reset(self._step_token)
        if self._otel_token is not None:
            otel_context.detach(self._otel_token)
        return False

    async def __aenter__(self) -> _StepState | None:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> Literal[False]:
        return self.__exit__(*exc)


def propagated(fn: Callable[..., R]) -> Callable[..., R]:
    """Run `fn` (a Ray task or actor method, sync or async) inside the driver's step.

    The carrier comes in the keyword argument ``otel_rl_context`` (``fn.remote(...,
    otel_rl_context=otel_ray.inject())``), which `fn` does not see.  Apply it under
    ``@ray.remote`` for tasks.
    """
    call: Any = fn  # (awaited when a coroutine function)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            carrier = kwargs.pop(CONTEXT_KWARG, None)
            if not carrier:
                return await call(*args, **kwargs)
            # each async call runs in its own task, so its own context: nothing leaks to other calls
            with step_context(carrier):
                return await call(*args, **kwargs)

        return _with_context_parameter(async_wrapper, fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        carrier = kwargs.pop(CONTEXT_KWARG, None)
        if not carrier:
            return fn(*args, **kwargs)
        return contextvars.copy_context().run(_call_in_step, carrier, fn, args, kwargs)

    return _with_context_parameter(wrapper, fn)


def _with_context_parameter(wrapper: Any, fn: Callable[..., Any]) -> Any:
    """Ray checks call arguments against the signature: declare the ``otel_rl_context`` keyword.

    Ray reads the signature of ``inspect.unwrap(method)``, so the wrapper does not
    point back at `fn` through ``__wrapped__``: it is where unwrapping stops.
    """
    wrapper.__dict__.pop("__wrapped__", None)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return wrapper
    params = list(sig.parameters.values())
    if CONTEXT_KWARG not in sig.parameters:
        extra = inspect.Parameter(CONTEXT_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None)
        at = next((i for i, p in enumerate(params) if p.kind == p.VAR_KEYWORD), len(params))
        params.insert(at, extra)
    wrapper.__signature__ = sig.replace(parameters=params)
    return wrapper


def _call_in_step(carrier: Mapping[str, str], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    with step_context(carrier):
        return fn(*args, **kwargs)
