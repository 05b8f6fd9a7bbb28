"""Make an installed verl use otel-rl: ``install()`` at the top of ``main_ppo`` (or any entry point).

::

    import otel_rl.integrations.verl
    otel_rl.integrations.verl.install()

What it does, idempotently (``uninstall()`` undoes all of it):

1. Puts `otel_rl.compat.verl`'s ``Tracking`` and ``ValidationGenerationsLogger`` into
   ``verl.utils.tracking`` and its ``RolloutTraceConfig``, ``rollout_trace_attr`` and
   ``rollout_trace_op`` into ``verl.utils.rollout_trace`` -- and into every module
   already loaded that imported those names (``from verl.utils.tracking import
   ValidationGenerationsLogger`` in ``ray_trainer``, ...).
2. Re-wraps methods already decorated with verl's own ``rollout_trace_op`` (verl's
   tools, agent loops and LLM client decorate at import time) with otel-rl's.
3. Carries over a verl ``RolloutTraceConfig`` that was already initialised.
4. Ray: wraps ``ray.init`` so the job's ``runtime_env`` gets ``OTEL_RL_RUN_ID`` (one run
   id for the driver and every worker), the driver's ``OTEL_RL_*`` / OTLP settings,
   and a ``worker_process_setup_hook`` that runs ``install()`` in each Ray worker
   process (verl's TaskRunner and agent-loop workers are Ray actors).  An
   existing setup hook given by name is chained.
5. When verl's agent loop initialises rollout tracing, its ``get_trajectory_info``
   also registers each batch's sample indices with otel-rl's deterministic sampler.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
import types
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

from .. import semconv as sc
from ..compat import verl as compat

_log = logging.getLogger("otel_rl")

TRACKING = "verl.utils.tracking"
ROLLOUT_TRACE = "verl.utils.rollout_trace"
NAMES = {
    TRACKING: ("Tracking", "ValidationGenerationsLogger"),
    ROLLOUT_TRACE: ("RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op"),
}
AGENT_LOOP_MODULES = (
    "verl.experimental.agent_loop.agent_loop",
    "verl.experimental.agent_loop",
    "verl.trainer.ppo.v1.agent_loop_tq",
)
ENV_INSTALLED = "OTEL_RL_VERL_INSTALL"
ENV_CHAINED_HOOK = "OTEL_RL_VERL_CHAINED_SETUP_HOOK"
SETUP_HOOK = f"{__name__}._ray_worker_setup"

_lock = threading.RLock()


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.replaced: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
        self.set_env: list[tuple[str, str | None]] = []  # (variable, previous value)
        self.ray_init: Any = None


_state = _State()


def installed() -> bool:
    return _state.installed


def install(*, ray_workers: bool = True) -> None:
    """Make the installed verl use otel-rl (see the module doc).  Safe to call again."""
    with _lock:
        if _state.installed:
            return
        tracking = importlib.import_module(TRACKING)
        rollout_trace = importlib.import_module(ROLLOUT_TRACE)
        originals = {id(getattr(tracking, n)): (getattr(tracking, n), getattr(compat, n)) for n in NAMES[TRACKING]}
        originals.update(
            {
                id(getattr(rollout_trace, n)): (getattr(rollout_trace, n), getattr(compat, n))
                for n in NAMES[ROLLOUT_TRACE]
            }
        )
        verl_config = rollout_trace.RolloutTraceConfig
        try:
            with warnings.catch_warnings():  # reading every module's attributes trips deprecation shims
                warnings.simplefilter("ignore")
                _replace_names(originals)
                _rewrap_decorated(originals)
            if ray_workers:
                _prepare_ray()
            compat._init_hooks.append(_register_candidates_hook)
            _state.installed = True
        except BaseException:
            _undo()
            raise
        _carry_over(verl_config)


def uninstall() -> None:
    """Put verl's own objects back everywhere `install()` replaced them."""
    with _lock:
        if not _state.installed:
            return
        _undo()
        _state.installed = False


def _undo() -> None:
    for owner, attr, original in reversed(_state.replaced):
        try:
            setattr(owner, attr, original)
        except (AttributeError, TypeError):  # pragma: no cover - a read-only owner
            pass
    _state.replaced.clear()
    for var, previous in reversed(_state.set_env):
        if previous is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = previous
    _state.set_env.clear()
    if _state.ray_init is not None:
        ray_mod, original = _state.ray_init
        ray_mod.init = original
        _state.ray_init = None
    if _register_candidates_hook in compat._init_hooks:
        compat._init_hooks.remove(_register_candidates_hook)


# ----------------------------------------------------------------------------- names and decorated methods


def _modules() -> list[types.ModuleType]:
    return [m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]


def _replace_names(originals: dict[int, tuple[Any, Any]]) -> None:
    """Every module attribute that *is* one of verl's objects gets ours (``from ... import`` copies too)."""
    for mod in _modules():
        if mod is compat:
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:  # pragma: no cover
            continue
        for attr, value in items:
            hit = originals.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, attr, hit[1])
                _state.replaced.append((mod, attr, value))


def _verl_wrapper_codes(original_op: Any) -> set[types.CodeType]:
    """The code objects of the wrappers verl's rollout_trace_op returns (its nested functions)."""
    code = getattr(original_op, "__code__", None)
    return {c for c in (code.co_consts if code is not None else ()) if isinstance(c, types.CodeType)}


def _rewrap_decorated(originals: dict[int, tuple[Any, Any]]) -> None:
    """Methods verl's rollout_trace_op already wrapped (at class definition) get otel-rl's wrapper."""
    verl_op = next((orig for orig, ours in originals.values() if ours is compat.rollout_trace_op), None)
    codes = _verl_wrapper_codes(verl_op)
    if not codes:
        return
    seen: set[int] = set()
    for mod in _modules():
        try:
            values = list(vars(mod).values())
        except TypeError:  # pragma: no cover
            continue
        for cls in values:
            # type() and vars() only: getattr/isinstance on lazy objects (six.moves, deprecation shims) imports things
            if not issubclass(type(cls), type) or id(cls) in seen:
                continue
            seen.add(id(cls))
            try:
                members = list(vars(cls).items())
            except TypeError:  # pragma: no cover
                continue
            for attr, fn in members:
                if type(fn) is types.FunctionType and fn.__code__ in codes and "__wrapped__" in fn.__dict__:
                    setattr(cls, attr, compat.rollout_trace_op(fn.__dict__["__wrapped__"]))
                    _state.replaced.append((cls, attr, fn))


def _carry_over(verl_config_cls: Any) -> None:
    """A verl RolloutTraceConfig initialised before install(): initialise ours the same way."""
    inst = getattr(verl_config_cls, "_instance", None)
    if (
        inst is None
        or not getattr(inst, "_initialized", False)
        or compat.RolloutTraceConfig.get_instance()._initialized
    ):
        return
    compat.RolloutTraceConfig.init(
        inst.project_name, inst.experiment_name, inst.backend, inst.token2text, inst.max_samples_per_step_per_worker
    )


# ----------------------------------------------------------------------------- deterministic sampling


def _register_candidates_hook(config: Any) -> None:
    """verl's agent loop: register each batch's samples with otel-rl's sampler (keyed choice)."""
    if config.backend is None or not compat.RolloutTraceConfig.deterministic_sampling:
        return
    for name in AGENT_LOOP_MODULES:
        mod: Any = sys.modules.get(name)  # (a module of verl's: its functions are replaced)
        fn = getattr(mod, "get_trajectory_info", None) if mod is not None else None
        if mod is None or fn is None or getattr(fn, "__otel_rl_registers__", False):
            continue
        mod.get_trajectory_info = _registering(fn)
        _state.replaced.append((mod, "get_trajectory_info", fn))


def _registering(fn: Any) -> Any:
    @functools.wraps(fn)
    async def get_trajectory_info(step: Any, index: Any, validate: Any) -> Any:
        info = await fn(step, index, validate)
        try:
            import otel_rl

            otel_rl.select_samples(int(step), [int(i) for i in index], bool(validate))
        except Exception:  # pragma: no cover - never break verl's rollout
            _log.debug("otel-rl: could not register the batch's samples", exc_info=True)
        return info

    get_trajectory_info.__otel_rl_registers__ = True  # type: ignore[attr-defined]
    return get_trajectory_info


# ----------------------------------------------------------------------------- Ray


def _set_env(var: str, value: str) -> None:
    _state.set_env.append((var, os.environ.get(var)))
    os.environ[var] = value


def _prepare_ray() -> None:
    """One run id for the whole job, and install() in every Ray worker process."""
    if not os.environ.get(sc.ENV_RUN_ID):
        _set_env(sc.ENV_RUN_ID, uuid.uuid4().hex[:16])
    if os.environ.get(ENV_INSTALLED) != "1":
        _set_env(ENV_INSTALLED, "1")
    try:
        import ray
    except ImportError:
        return
    original = ray.init
    if getattr(original, "__otel_rl_original__", None) is not None:
        return

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs["runtime_env"] = job_runtime_env(kwargs.get("runtime_env"))
        return original(*args, **kwargs)

    init.__otel_rl_original__ = original  # type: ignore[attr-defined]
    ray.init = init
    _state.ray_init = (ray, original)


def job_runtime_env(runtime_env: Mapping[str, object] | None = None) -> dict[str, object]:
    """`runtime_env` for ``ray.init`` with otel-rl's run id, settings and the worker setup hook."""
    from .ray import worker_env

    out: dict[str, Any] = dict(runtime_env or {})
    env = dict(out.get("env_vars") or {})
    for k, v in worker_env().items():
        env.setdefault(k, v)  # what the job sets explicitly wins
    env.setdefault(ENV_INSTALLED, "1")
    hook = out.get("worker_process_setup_hook")
    if hook is None or hook == SETUP_HOOK:
        out["worker_process_setup_hook"] = SETUP_HOOK
    elif isinstance(hook, str):
        env[ENV_CHAINED_HOOK] = hook
        out["worker_process_setup_hook"] = SETUP_HOOK
    else:
        _log.warning(
            "otel-rl: ray.init has a worker_process_setup_hook that is not a module path; call "
            "otel_rl.integrations.verl.install() in it so Ray workers use otel-rl"
        )
    out["env_vars"] = env
    return out


def _ray_worker_setup() -> None:
    """Ray's worker_process_setup_hook: install() in the worker, then the job's own hook if any."""
    try:
        install(ray_workers=False)
        _configure_compat_for_ray()
    except Exception:
        _log.warning("otel-rl: verl integration not installed in this Ray worker", exc_info=True)
    chained = os.environ.get(ENV_CHAINED_HOOK)
    if chained:
        mod, _, attr = chained.rpartition(".")
        getattr(importlib.import_module(mod), attr)()


def _configure_compat_for_ray() -> None:
    """Pipelines that verl's classes start in a Ray worker get its rank and Ray resource attributes."""
    from .ray import worker_settings

    compat.new_pipeline_settings = worker_settings
