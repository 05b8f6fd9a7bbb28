"""The SwanLab exporter (see the package README for the behaviour in full)."""

from __future__ import annotations

import atexit
import inspect
import logging
import math
import os
import re
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from otel_rl import semconv as sc
from otel_rl.exporters.tracker import TrackerExporter, on_uncaught_exception, run_failure
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics, Trajectory, merge_step_metrics

from ._console import ConsoleLines
from ._keys import KeyMap, clean_text, warn_once
from ._packages import install_swanlab_requirements

_log = logging.getLogger("otel_rl")

#: environment variables read by the exporter (SwanLab's own, as verl reads them, plus ours)
ENV_API_KEY = "SWANLAB_API_KEY"
ENV_LOG_DIR = "SWANLAB_LOG_DIR"
ENV_MODE = "SWANLAB_MODE"
ENV_FRAMEWORK = "OTEL_RL_SWANLAB_FRAMEWORK"
ENV_ALL_RANKS = "OTEL_RL_SWANLAB_ALL_RANKS"

DEFAULT_LOG_DIR = "swanlog"  # verl's default
DEFAULT_FRAMEWORK = "verl"  # verl's config={"FRAMEWORK": "verl", **config}
CONFIG_RUN_ID_KEY = "OTEL_RL_RUN_ID"
GENERATION_HEADERS = [sc.TAG_STEP, "input", "output", "score"]  # verl's table columns
ONLINE_MODES = ("cloud", "online")

_PROJECT_MAX = 100
_PROJECT_BAD = re.compile(r"[^0-9A-Za-z_\-+.]")
_EXPERIMENT_MAX = 512
_STEPS_REMEMBERED = 4  # steps whose written keys are remembered (late-value detection)


def _true(text: str | None) -> bool:
    return (text or "").strip().lower() in ("1", "true", "yes", "on")


def swanlab_project_name(project: str) -> str:
    """SwanLab project names: 1-100 characters of ``0-9 a-z A-Z _ - + .``."""
    out = _PROJECT_BAD.sub("_", project or "")[:_PROJECT_MAX] or "otel_rl"
    if out != project:
        warn_once(
            f"swanlab-project:{project}",
            "otel-rl: project %r is logged to SwanLab as %r (SwanLab project "
            "names: at most 100 characters of letters, digits, '_', '-', '+', '.')",
            project,
            out,
        )
    return out


def _number(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond the double range
        return math.inf if value > 0 else -math.inf


def _console_parts(proxy: Any) -> tuple[Any, type] | None:
    """(a run's way to add a log line, SwanLab's terminal emulator class) from its terminal proxy, or None
    for a SwanLab without them (private parts: looked up, never assumed)."""
    emit = getattr(proxy, "_emit_line", None)
    emulator = getattr(proxy, "_stdout_emulator", None)
    if emit is None or emulator is None:
        return None
    return emit, type(emulator)


def _alive(run: Any) -> bool:
    alive = getattr(run, "alive", None)
    return True if alive is None else bool(alive)


class _Run:
    """One run identity: its SwanLab run and the step row still being collected."""

    def __init__(self, ident: RunIdentity, config: dict[str, Any] | None):
        self.ident = ident
        self.config = config
        self.run: Any = None  # the swanlab Run while this identity is the active one
        self.owned = True  # False when the application created the SwanLab run itself
        self.swanlab_id: str | None = None
        self.opened = 0
        self.dead = False  # its SwanLab run was finished by someone else
        self.keys = KeyMap()
        self.step: int | None = None  # step of the held row
        self.values: dict[str, float] = {}  # the held row (SwanLab keys)
        self.gens: list[tuple[str, str, float]] = []  # generation rows of the held step
        self.written: OrderedDict[int, set[str]] = OrderedDict()  # recent steps -> keys already sent
        self.console: ConsoleLines | None = None  # the training process's console lines, per stream

    def label(self) -> str:
        i = self.ident
        return f"{i.project}/{i.experiment} ({i.run_id})"


class SwanlabExporter(TrackerExporter):
    """Step metrics, config and validation generations to SwanLab, the way verl logs them.

    SwanLab keeps only the first value logged for a key at a step, so a step's
    row is held here until a larger step arrives (or `flush` / `shutdown`) and
    then logged in one call.  SwanLab allows one active run per process: runs of
    several identities take turns (see README).
    """

    tracker_name = "swanlab"
    exports_trajectories = False
    traces_only_as_backend = True
    captures_console = True

    def __init__(self, config: Any):
        super().__init__(config)
        # Imported here, not at the first record: a first import on the export thread while the
        # interpreter exits fails (concurrent.futures cannot register its exit hook any more).
        import swanlab  # noqa: F401

        install_swanlab_requirements()  # its requirements snapshot without a pip child process
        on_uncaught_exception(_on_uncaught)  # failures before any SwanLab run is open (SwanLab hooks in at init)
        _live.add(self)
        if getattr(config, "trace_backend", None) == self.tracker_name:
            warn_once(
                "swanlab-traces",
                "otel-rl: SwanLab has no trace view; trajectories are not sent to SwanLab "
                "(use trace backend 'weave' or 'mlflow')",
            )
        self.wants_trajectories = False
        self._lock = threading.RLock()
        self._active: _Run | None = None
        self._closed = False
        self._mode: str | None = None
        self._logged_in = False
        rank = int(getattr(config, "rank", 0) or 0)
        self._inert = rank != 0 and not _true(os.environ.get(ENV_ALL_RANKS))
        if self._inert:
            _log.info(
                "otel-rl: SwanLab exporter on rank %d is idle: metrics go to SwanLab from rank 0 only "
                "(set %s=true to log from every rank)",
                rank,
                ENV_ALL_RANKS,
            )

    # -- records -------------------------------------------------------------------------
    def export_records(self, records: Sequence[Any]) -> None:
        with self._lock:
            if self._inert:
                return
            wanted = [r for r in records if not isinstance(r, Trajectory)]
            if not wanted:
                return
            if self._closed:
                warn_once(
                    "swanlab-closed",
                    "otel-rl: SwanLab exporter received %d records after shutdown; not logged",
                    len(wanted),
                )
                return
            super().export_records(wanted)

    def open_run(self, run: RunIdentity, start: RunStart | None) -> _Run:
        state = _Run(run, start.config if start is not None else None)
        self._activate(state)  # SwanLab shows the run from its start; an error here retries the batch
        return state

    def update_config(self, handle: _Run, start: RunStart) -> None:
        handle.config = start.config
        if handle is self._active and handle.run is not None and _alive(handle.run):
            handle.run.config.update(self._run_config(handle))

    def write_metrics(self, handle: _Run, metrics: list[StepMetrics]) -> None:
        if not self._activate(handle):
            return
        for m in merge_step_metrics(metrics):
            self._add(handle, m.step, m.values, None)

    def write_generations(self, handle: _Run, generations: list[Generations]) -> None:
        if not self._activate(handle):
            return
        for g in generations:
            self._add(handle, g.step, None, g.rows)

    def close_run(self, handle: _Run) -> None:
        if handle.run is not None and _alive(handle.run):
            self._emit(handle)
        self._finish(handle)
        if self._active is handle:
            self._active = None

    def console_to_run(self, handle: _Run, chunks: list[tuple[str, str]]) -> None:
        """The training process's console into the active run's console log, as the lines SwanLab's own
        capture would record (`ConsoleLines`: a terminal per stream of the training process, apart from the
        export process's own); nothing when the run records no console (``terminal.proxy_type="none"``) or
        is not the active one."""
        run = handle.run
        if run is None or handle is not self._active or not _alive(run):
            return
        proxy = getattr(getattr(run, "_components", None), "terminal", None)
        if proxy is not None and type(proxy).__name__ == "NullTerminalProxy":
            return  # this run records no console
        parts = _console_parts(proxy)
        if parts is not None:
            emit, emulator_class = parts
            if handle.console is None:
                handle.console = ConsoleLines(emulator_class)
            for stream, text in chunks:
                for line in handle.console.write(stream, text):
                    emit(line)
            return
        # a SwanLab without these parts: through its capture's queues (its emulators, shared with this
        # process's own output)
        out, err = getattr(proxy, "_on_stdout_write", None), getattr(proxy, "_on_stderr_write", None)
        if out is None or err is None:
            warn_once(
                "swanlab-console",
                "otel-rl: this SwanLab version offers no way to add the training "
                "process's console output to the run; its log holds the export process's",
            )
            return
        for stream, text in chunks:
            (err if stream == "stderr" else out)(text)

    def _console_finish(self, state: _Run) -> None:
        """The training process's unfinished console lines into `state`'s run before it finishes, as
        SwanLab's proxy does with its own when it stops."""
        with self.console_lock:
            lines, state.console = (state.console.finish() if state.console is not None else []), None
        parts = _console_parts(getattr(getattr(state.run, "_components", None), "terminal", None))
        if parts is not None:
            for line in lines:
                parts[0](line)

    # -- lifecycle --------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> None:
        """Log the held step rows now (later values of the same steps: see README)."""
        with self._lock:
            state = self._active
            if state is not None and state.run is not None and _alive(state.run):
                self._emit(state)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            super().shutdown()
            self._active = None
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # pragma: no cover
            pass

    # -- step rows ----------------------------------------------------------------------------
    def _add(
        self, state: _Run, step: int, values: dict[str, Any] | None, rows: list[tuple[str, str, float]] | None
    ) -> None:
        if step < 0:
            warn_once(
                "swanlab-negative-step",
                "otel-rl: SwanLab does not accept negative steps; values logged at step %d are not sent to SwanLab",
                step,
            )
            return
        vals = {state.keys(k): _number(v) for k, v in values.items()} if values else {}
        if state.step is None or step > state.step:
            self._emit(state)
            state.step = step
            state.values = vals
            state.gens = list(rows) if rows else []
        elif step == state.step:
            state.values.update(vals)
            if rows:
                state.gens.extend(rows)
        else:  # an older step than the held row: logged at once (keys SwanLab already has there are dropped)
            _log.debug("otel-rl: values for step %d of run %s after step %d", step, state.label(), state.step)
            self._send(state, step, vals, list(rows) if rows else [])

    def _emit(self, state: _Run) -> None:
        if state.step is not None and (state.values or state.gens):
            values, gens = state.values, state.gens
            state.values, state.gens = {}, []
            self._send(state, state.step, values, gens)

    def _send(self, state: _Run, step: int, values: dict[str, float], gens: list[tuple[str, str, float]]) -> None:
        done = state.written.get(step)
        data: dict[str, Any] = {}
        late: list[str] = []
        for k, v in values.items():
            if done is not None and k in done:
                late.append(k)
            else:
                data[k] = v
        if gens:
            key = state.keys(sc.VAL_GENERATIONS_KEY)
            if done is not None and key in done:
                late.append(key)
            else:
                data[key] = self._table(step, gens)
        if late:
            warn_once(
                f"swanlab-dup:{state.ident}",
                "otel-rl: %d value(s) for step %d of run %s (e.g. %r) came after "
                "that step was written to SwanLab, which keeps the first value logged at a step; they are "
                "dropped there (flush() in the middle of a step causes this)",
                len(late),
                step,
                state.label(),
                late[0],
            )
        if not data:
            return
        try:
            state.run.log(data, step=step)
        except Exception as exc:  # swanlab.log swallows its own errors; this is a finished / forked run
            warn_once(
                f"swanlab-log:{type(exc).__name__}",
                "otel-rl: SwanLab log failed (%s: %s); values of step %d not logged",
                type(exc).__name__,
                exc,
                step,
            )
            return
        if done is None:
            done = state.written[step] = set()
            while len(state.written) > _STEPS_REMEMBERED:
                state.written.popitem(last=False)
        done.update(data)

    @staticmethod
    def _table(step: int, rows: list[tuple[str, str, float]]) -> Any:
        import swanlab

        table = swanlab.echarts.Table()
        table.add(
            headers=list(GENERATION_HEADERS),
            rows=[[step, clean_text(str(i)), clean_text(str(o)), float(s)] for i, o, s in rows],
        )
        return table

    # -- SwanLab runs -----------------------------------------------------------------------------
    def _run_config(self, state: _Run) -> dict[str, Any]:
        framework = os.environ.get(ENV_FRAMEWORK) or DEFAULT_FRAMEWORK
        return {"FRAMEWORK": framework, CONFIG_RUN_ID_KEY: state.ident.run_id, **(state.config or {})}

    def _activate(self, state: _Run) -> bool:
        """Make `state` the identity whose SwanLab run is open; False when it cannot log."""
        if state.dead:
            return False
        if self._active is state and state.run is not None:
            if _alive(state.run):
                return True
            state.dead = True
            state.run = None
            self._active = None
            warn_once(
                f"swanlab-dead:{state.ident}",
                "otel-rl: the SwanLab run of %s was finished outside otel-rl; its further values are not logged",
                state.label(),
            )
            return False
        cur = self._active
        if cur is not None and cur.run is not None and _alive(cur.run):
            if not cur.owned:
                warn_once(
                    f"swanlab-foreign:{state.ident}",
                    "otel-rl: the application's own SwanLab run is active; "
                    "values of run %s are not logged (SwanLab keeps one run per process)",
                    state.label(),
                )
                return False
            warn_once(
                f"swanlab-switch:{state.ident}",
                "otel-rl: SwanLab keeps one run per process; finishing the run of %s to log %s",
                cur.label(),
                state.label(),
            )
            self._emit(cur)
            self._finish(cur)
        self._active = None
        self._open(state)
        self._active = state
        return True

    def process_failed(self, state: str, text: str, exit_code: int = 1) -> None:
        # the run is finished as crashed / aborted (SwanLab's state for a run stopped by a signal too)
        _mark_failed("crashed" if state == "crashed" else "aborted", text)

    def _finish(self, state: _Run) -> None:
        if state.console is not None and state.run is not None and _alive(state.run):
            try:
                self._console_finish(state)
            except Exception as exc:  # the run is finished below all the same
                warn_once(
                    "swanlab-console-finish",
                    "otel-rl: the training process's last console lines could not be added to the SwanLab run: %s",
                    exc,
                )
        run, state.run = state.run, None
        if run is not None and state.owned and _alive(run):
            if _crash is not None:  # the process is ending with an uncaught exception
                try:
                    run.finish(state=_crash[0], error=_crash[1])
                    return
                except TypeError:  # pragma: no cover - a SwanLab without finish(state=...)
                    pass
            run.finish()

    def _resolve_mode(self) -> str:
        if self._mode is None:
            mode = (os.environ.get(ENV_MODE) or "").strip().lower()
            if not mode:
                if os.environ.get(ENV_API_KEY) or _stored_login():
                    mode = "cloud"  # verl's default
                else:
                    mode = "offline"
                    _log.warning(
                        "otel-rl: %s is not set and there is no saved SwanLab login, so SwanLab runs in "
                        "offline mode (run data under %s; upload later with `swanlab sync <run dir>`; set "
                        "%s to choose)",
                        ENV_API_KEY,
                        os.environ.get(ENV_LOG_DIR) or DEFAULT_LOG_DIR,
                        ENV_MODE,
                    )
            self._mode = mode
        return self._mode

    def _open(self, state: _Run) -> None:
        import swanlab

        has_run = getattr(swanlab, "has_run", None)
        if callable(has_run) and has_run():
            state.run = swanlab.get_run()
            state.owned = False
            state.opened += 1
            _log.info("otel-rl: a SwanLab run is already active in this process; logging run %s into it", state.label())
            state.run.config.update(self._run_config(state))
            return
        mode = self._resolve_mode()
        api_key = os.environ.get(ENV_API_KEY)
        if api_key and mode in ONLINE_MODES and not self._logged_in:
            swanlab.login(api_key=api_key)  # as verl does
            self._logged_in = True
        kwargs: dict[str, Any] = dict(
            project=swanlab_project_name(state.ident.project),
            experiment_name=(state.ident.experiment or "default")[:_EXPERIMENT_MAX],
            config=self._run_config(state),
            logdir=os.environ.get(ENV_LOG_DIR) or DEFAULT_LOG_DIR,
            mode=mode,
        )
        params = _init_params(swanlab.init)
        if "settings" in params and hasattr(swanlab, "Settings"):
            kwargs["settings"] = swanlab.Settings(interactive=False)  # never prompt on the export thread
        if state.opened and mode in ONLINE_MODES and state.swanlab_id and "resume" in params:
            kwargs.update(id=state.swanlab_id, resume="allow")  # the identity's earlier SwanLab experiment
        run = swanlab.init(**kwargs)
        state.run = run
        state.owned = True
        state.opened += 1
        state.swanlab_id = getattr(run, "id", None) or state.swanlab_id
        self._hook()

    # -- process exit ---------------------------------------------------------------------------
    def _hook(self) -> None:
        """Run our exit handler before SwanLab's own (which would finish the run first).

        atexit runs handlers last-in-first-out, and SwanLab registers its handler
        in `swanlab.init`, so ours is (re-)registered after every init.  An
        uncaught exception reaches SwanLab's excepthook (run marked crashed)
        through ours, which first delivers what otel-rl still holds.
        """
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # pragma: no cover
            pass
        atexit.register(self._at_exit)
        previous = sys.excepthook

        def excepthook(tp: Any, value: Any, tb: Any, _previous: Any = previous) -> None:
            _on_uncaught(tp, value, tb)
            _previous(tp, value, tb)

        sys.excepthook = excepthook

    def _owner(self) -> Any:
        try:
            import otel_rl

            h = otel_rl.current()
        except Exception:  # pragma: no cover
            return None
        if h is not None and not h.closed and any(e is self for e in h.exporters):
            return h
        return None

    def _deliver_pending(self, flush_only: bool) -> None:
        h = self._owner()
        if h is not None:
            if flush_only:
                h.flush(10.0)
            else:
                h.shutdown(10.0)  # delivers everything queued, then shuts this exporter down
            return
        try:  # standalone / OTEL_TRACES_EXPORTER use: drain the global SDK provider into us first
            from opentelemetry import trace

            provider = trace.get_tracer_provider()
            if hasattr(provider, "force_flush"):
                provider.force_flush(5000)
        except Exception:  # pragma: no cover
            pass
        if flush_only:
            self.flush()
        else:
            self.shutdown()

    def _at_exit(self) -> None:
        if not self._closed:
            self._deliver_pending(flush_only=False)


# -- uncaught exceptions --------------------------------------------------------------------------

_live: weakref.WeakSet[SwanlabExporter] = weakref.WeakSet()
_crash: tuple[str, str] | None = None  # (SwanLab finish state, traceback) once the process is failing


def _mark_failed(state: str, text: str) -> None:
    global _crash
    if _crash is None:
        _crash = (state, text)


def _on_uncaught(tp: Any, value: Any, tb: Any) -> None:
    """Remember the failure (runs are finished as crashed / aborted) and deliver what is queued."""
    global _crash
    if _crash is None:
        _crash = run_failure(tp, value, tb)  # None in a REPL, which goes on after an uncaught error
    for exporter in list(_live):
        if exporter._closed:
            continue
        try:
            exporter._deliver_pending(flush_only=True)
        except Exception:  # pragma: no cover - never mask the original error
            pass


def _init_params(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return set()


def _stored_login() -> bool:
    """A key saved by `swanlab login` (SwanLab reads it from its .netrc)."""
    try:
        import swanlab

        return bool(getattr(swanlab.Settings(), "api_key", None))
    except Exception:
        return False
