"""The ClearML exporter (see the package README for the behaviour in full)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from otel_rl import semconv as sc
from otel_rl.exporters.base import warn_once
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics

_log = logging.getLogger("otel_rl")

#: ClearML's own variables: offline mode, and the server that turns it off
ENV_OFFLINE = "CLEARML_OFFLINE_MODE"
ENV_API_HOST = "CLEARML_API_HOST"
ENV_CONFIG_FILE = "CLEARML_CONFIG_FILE"
CONFIG_NAME = "Hyperparameters"  # verl's connect_configuration(config, name="Hyperparameters")
CONFIG_RUN_ID_KEY = "OTEL_RL_RUN_ID"
GENERATIONS_TITLE = "Validation"  # verl's report_table(title=..., series=...)
GENERATIONS_SERIES = "Validation generations"
GENERATION_HEADERS = [sc.TAG_STEP, "input", "output", "score"]


def _true(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def offline_mode(env: Any = None) -> bool:
    """ClearML runs offline unless a server is configured: ``CLEARML_OFFLINE_MODE`` set, or neither
    ``CLEARML_API_HOST`` nor a ClearML config file (``CLEARML_CONFIG_FILE``, ``~/clearml.conf``)."""
    env = os.environ if env is None else env
    if _true(env.get(ENV_OFFLINE)):
        return True
    if env.get(ENV_API_HOST):
        return False
    config_file = env.get(ENV_CONFIG_FILE) or os.path.join(os.path.expanduser("~"), "clearml.conf")
    return not os.path.isfile(config_file)


def split_key(key: str) -> tuple[str, str]:
    """(title, series) of a metric key: split at the first ``/`` as verl does; a key without one is both
    title and series (verl's logger raises on it), as ClearML's TensorBoard binding reports such tags."""
    title, sep, series = key.partition("/")
    return (title, series) if sep else (key, key)


def _number(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond the double range
        return math.inf if value > 0 else -math.inf


class _Run:
    def __init__(self, ident: RunIdentity, config: dict[str, Any]):
        self.ident = ident
        self.config = config
        self.task: Any = None  # the ClearML task while this identity is the active one
        self.owned = True  # False: the application's own task, never closed here
        self.opened = 0

    def label(self) -> str:
        i = self.ident
        return f"{i.project}/{i.experiment} ({i.run_id})"


class ClearmlExporter(TrackerExporter):
    """Scalars, configuration and validation tables to ClearML, as verl reports them.

    ClearML has one task per process: runs of several identities take turns (the
    active task is closed before the next one opens), as with SwanLab.
    """

    tracker_name = "clearml"
    exports_trajectories = False

    def __init__(self, config: Any):
        super().__init__(config)
        from clearml import Task  # imported here: a missing package fails at init()

        self._Task = Task
        self._offline = offline_mode()
        self._app_task: Task | None = Task.current_task()  # a task the application opened: reused, not closed
        self._active: _Run | None = None
        if getattr(config, "trace_backend", None) == self.tracker_name:
            warn_once(
                "clearml-traces",
                "otel-rl: ClearML has no trace view; trajectories are not sent to ClearML "
                "(use trace backend 'mlflow' or 'weave')",
            )
        self.wants_trajectories = False

    # -- runs ------------------------------------------------------------------------------
    def open_run(self, run: RunIdentity, start: RunStart | None) -> _Run:
        state = _Run(run, {CONFIG_RUN_ID_KEY: run.run_id, **(start.config if start is not None else {})})
        self._activate(state)
        return state

    def update_config(self, handle: _Run, start: RunStart) -> None:
        handle.config = {CONFIG_RUN_ID_KEY: handle.ident.run_id, **start.config}
        if handle is self._active and handle.task is not None:
            handle.task.connect_configuration(handle.config, name=CONFIG_NAME)

    def write_metrics(self, handle: _Run, metrics: list[StepMetrics]) -> None:
        logger = self._activate(handle).get_logger()
        for m in metrics:
            for k, v in m.values.items():
                title, series = split_key(k)
                logger.report_scalar(title=title, series=series, value=_number(v), iteration=m.step)

    def write_generations(self, handle: _Run, generations: list[Generations]) -> None:
        logger = self._activate(handle).get_logger()
        for g in generations:
            rows = [[g.step, str(i), str(o), None if s is None or math.isnan(s) else s] for i, o, s in g.rows]
            logger.report_table(
                title=GENERATIONS_TITLE,
                series=GENERATIONS_SERIES,
                iteration=g.step,
                table_plot=[list(GENERATION_HEADERS)] + rows,
            )

    def close_run(self, handle: _Run) -> None:
        self._close(handle)
        if self._active is handle:
            self._active = None

    def flush(self, timeout_s: float = 10.0) -> None:
        state = self._active
        if state is not None and state.task is not None:
            state.task.flush(wait_for_uploads=False)

    # -- tasks -------------------------------------------------------------------------------
    def _activate(self, state: _Run) -> Any:
        """The task of `state`, opened now when another identity's task was the active one."""
        if self._active is state and state.task is not None:
            return state.task
        cur = self._active
        if cur is not None and cur.task is not None:
            warn_once(
                f"clearml-switch:{state.ident}",
                "otel-rl: ClearML keeps one task per process; closing the task of %s to report %s",
                cur.label(),
                state.label(),
            )
            self._close(cur)
        self._active = None
        self._open(state)
        self._active = state
        return state.task

    def _open(self, state: _Run) -> None:
        Task = self._Task
        app, self._app_task = self._app_task, None
        if app is not None:
            _log.info(
                "otel-rl: a ClearML task is already open in this process; reporting run %s into it", state.label()
            )
            state.task, state.owned = app, False
        else:
            if self._offline:
                if not Task.is_offline():
                    _log.warning(
                        "otel-rl: no ClearML server is configured (%s, %s or ~/clearml.conf), so ClearML "
                        "runs in offline mode: sessions are written under ClearML's cache directory "
                        "(import them later with `clearml-task --import-offline-session` or "
                        "Task.import_offline_session)",
                        ENV_API_HOST,
                        ENV_CONFIG_FILE,
                    )
                    Task.set_offline(True)
                # ClearML's reporter subprocess holds close() for ~10 s in offline mode; this thread is already
                # off the training thread, so ClearML reports from a thread of its own here
                if hasattr(Task, "_report_subprocess_enabled"):
                    setattr(Task, "_report_subprocess_enabled", False)  # noqa: B010 - a private flag clearml types otherwise
            state.task = Task.init(
                project_name=state.ident.project or "otel_rl",
                task_name=state.ident.experiment or "default",
                continue_last_task=True,
                output_uri=False,
                auto_connect_frameworks=False,
                auto_connect_arg_parser=False,
            )
            state.owned = True
        state.opened += 1
        state.task.connect_configuration(state.config, name=CONFIG_NAME)

    def _close(self, state: _Run) -> None:
        task, state.task = state.task, None
        if task is None:
            return
        if state.owned:
            task.close()
        else:
            task.flush(wait_for_uploads=True)
