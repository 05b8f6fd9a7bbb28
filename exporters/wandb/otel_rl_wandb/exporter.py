"""The WandB exporter: one wandb run per otel-rl run identity.

Mapping (see README.md beside this package for the why):

- `RunStart`    -> ``wandb.init(project, name=experiment, config=<run config>, id=<stable id>,
                   resume="allow", reinit="create_new")``; a later `RunStart` updates the config;
- `StepMetrics` -> merged per (run, step) with `merge_step_metrics`, one ``run.log(row)`` per step,
                   the training step carried in the row as the step metric (``train/global_step``)
                   and never as ``step=``: wandb drops a ``step=`` lower than the last one, so
                   out-of-order steps would be lost;
- `Generations` -> a `wandb.Table` in verl's wide layout (``step, input_1, output_1, score_1, ...``),
                   one row per validation step, accumulated across steps, logged under
                   ``val/generations``;
- `Trajectory`  -> not exported (the weave exporter is the trace backend for W&B).
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from otel_rl import semconv as sc
from otel_rl.exporters.base import warn_once
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics, merge_step_metrics

from ._packages import install_wandb_working_set

_log = logging.getLogger("otel_rl")

#: the row key that carries the training step; every other key is plotted against it
STEP_METRIC = "train/global_step"
#: environment variable to choose another step key
ENV_STEP_METRIC = sc.ENV_PREFIX + "WANDB_STEP_METRIC"
#: wandb drops a history item whose key is empty; it is logged under this key instead
EMPTY_KEY = "(empty)"

_RUN_ID_OK = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def wandb_run_id(ident: RunIdentity) -> str:
    """Stable wandb run id of an otel-rl run: the same in every process and after a restart.

    The otel-rl run id itself when it is a valid wandb id (lowercase letters, digits, ``-``
    and ``_``, at most 64 characters; the generated ids are), else a hash of it.
    """
    rid = ident.run_id
    if _RUN_ID_OK.fullmatch(rid):
        return rid
    basis = rid if rid else f"{ident.project}\x00{ident.experiment}"
    return hashlib.sha256(basis.encode("utf-8")).hexdigest()[:32]


def _reinit_kwarg(wandb: Any) -> Any:
    """``"create_new"`` (several live runs per process) where this wandb has it (>= 0.19.10)."""
    try:
        ann = str(inspect.signature(wandb.init).parameters["reinit"].annotation)
    except Exception:
        ann = ""
    return "create_new" if "create_new" in ann else True


def _redact_url_password(url: Any) -> Any:
    if not isinstance(url, str) or "@" not in url:
        return url
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return url


def _proxy_from(config: Any) -> str | None:
    trainer = config.get("trainer") if isinstance(config, dict) else None
    proxy = trainer.get("wandb_proxy") if isinstance(trainer, dict) else None
    return proxy if isinstance(proxy, str) and proxy else None


def _config_for_wandb(config: dict[str, Any]) -> dict[str, Any]:
    """The run config as wandb gets it: a proxy URL's password is not kept."""
    proxy = _proxy_from(config)
    if proxy is None or _redact_url_password(proxy) == proxy:
        return config
    out = dict(config)
    out["trainer"] = dict(out["trainer"], wandb_proxy=_redact_url_password(proxy))
    return out


_env_lock = threading.Lock()

#: the module through which launch inputs are staged for the next run (wandb's launch package)
_LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


def _skip_unstaged_launch_inputs(wandb: Any) -> None:
    """Spare `wandb.init` importing wandb's launch package when nothing can have been staged.

    Each run start ends by applying the "launch inputs" staged for it, which imports
    ``wandb.sdk.launch`` (its agent and the public API's models: 0.3-0.5 s of CPU time, more in
    a process with many modules loaded, such as the export process beside MLflow and SwanLab).
    Inputs are staged only through that very module, so while it is not imported there is
    nothing to apply: the step is skipped then, and runs as before once it is imported.
    """
    run_cls: Any = getattr(getattr(getattr(wandb, "sdk", None), "wandb_run", None), "Run", None)
    original = getattr(run_cls, "_detect_and_apply_job_inputs", None)
    if original is None or getattr(original, "_otel_rl_skips_unstaged", False):
        return

    def _detect_and_apply_job_inputs(self: Any) -> None:
        if _LAUNCH_INPUTS in sys.modules:
            original(self)

    _detect_and_apply_job_inputs._otel_rl_skips_unstaged = True  # type: ignore[attr-defined]
    _detect_and_apply_job_inputs.__doc__ = original.__doc__
    run_cls._detect_and_apply_job_inputs = _detect_and_apply_job_inputs


def _dataframe_check_without_importing_pandas(wandb: Any) -> None:
    """Spare wandb importing pandas to tell that a logged value is not a DataFrame.

    ``wandb.util.is_pandas_data_frame`` imports pandas (0.4-0.5 s of CPU time) whenever it is installed,
    and wandb asks it of every value that is not a number or a string: the validation table does, at its
    first log.  No object can be a DataFrame while pandas is not imported, so the answer is then False
    without the import; once pandas is imported, wandb's own check runs.
    """
    util: Any = getattr(wandb, "util", None)
    original = getattr(util, "is_pandas_data_frame", None)
    if not callable(original) or getattr(original, "_otel_rl_no_import", False):
        return

    def is_pandas_data_frame(obj: Any) -> bool:
        if "pandas" not in sys.modules:
            return False
        return original(obj)

    is_pandas_data_frame._otel_rl_no_import = True  # type: ignore[attr-defined]
    util.is_pandas_data_frame = is_pandas_data_frame


class _no_weave_autoinit:
    """``WANDB_DISABLE_WEAVE=true`` around our `wandb.init` unless the user set it.

    `wandb.init` calls ``weave.init`` when weave is imported (the weave exporter imports
    it); offline, or without a key, weave then asks for an API key on the terminal — from
    our delivery thread.  Weave is the weave exporter's business, so our runs never start it.
    """

    def __enter__(self) -> None:
        _env_lock.acquire()
        self.set = "WANDB_DISABLE_WEAVE" not in os.environ
        if self.set:
            os.environ["WANDB_DISABLE_WEAVE"] = "true"

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.set:
                os.environ.pop("WANDB_DISABLE_WEAVE", None)
        finally:
            _env_lock.release()


#: the most of a training-process line not yet ended that is held back from the run's log (characters); a
#: longer one (a progress bar redrawn with carriage returns for the whole run) is passed on as it is
CONSOLE_HELD_MAX = 1 << 16


class WandbRun:
    """What the exporter keeps per wandb run."""

    __slots__ = (
        "ident",
        "run",
        "init_kwargs",
        "latest",
        "stale",
        "gen_rows",
        "gen_width",
        "gen_step",
        "gen_dirty",
        "console_rest",
    )

    def __init__(self, ident: RunIdentity, run: Any, init_kwargs: dict[str, Any]):
        self.ident = ident
        self.run = run
        self.init_kwargs = init_kwargs  # to resume the run if something else finishes it
        self.latest: dict[str, tuple[int, Any]] = {}  # key -> (highest step seen, its value)
        self.stale: set[str] = set()  # keys whose last logged value is not the one of the highest step
        self.gen_rows: list[list[Any]] = []  # the validation table, verl's wide rows
        self.gen_width = 0  # samples per row (columns are step + 3 per sample)
        self.gen_step = 0
        self.gen_dirty = False  # rows added that are not in a logged table yet
        # stream -> the training process's text after its last newline there: [its length, the pieces written]
        self.console_rest: dict[str, list] = {}


class WandbExporter(TrackerExporter):
    """``trainer.logger=["wandb"]`` (and verl's deprecated ``tracking``)."""

    tracker_name = "wandb"
    exports_trajectories = False
    captures_console = True

    def __init__(self, config: Any):
        super().__init__(config)
        import wandb  # the missing-dependency error belongs to exporter creation

        self._wandb = wandb
        _skip_unstaged_launch_inputs(wandb)
        install_wandb_working_set(wandb)  # the packages a run start records, from the metadata headers
        _dataframe_check_without_importing_pandas(wandb)
        self.wants_trajectories = False  # trajectories go to the weave exporter
        if getattr(config, "trace_backend", None) == self.tracker_name:
            warn_once(
                "wandb-trace-backend",
                "otel-rl: the wandb exporter does not export trajectories; W&B's "
                "trace backend is weave (actor_rollout_ref.rollout.trace.backend=weave)",
            )
        self.step_metric = os.environ.get(ENV_STEP_METRIC) or STEP_METRIC
        self._reinit = _reinit_kwarg(wandb)
        self._lock = threading.RLock()
        # parts of the batch being delivered that are already written: key -> the record
        # (kept referenced so that its id() cannot be reused while the key is here)
        self._done: dict[tuple[int, Any], Any] = {}
        self._batch: Any = None  # the batch being delivered (the same list object when retried)
        self._atexit_hook: Any = None

    # -- run lifecycle -----------------------------------------------------------------
    def init_kwargs(self, ident: RunIdentity, start: RunStart | None) -> dict[str, Any]:
        """Arguments of `wandb.init` for one run (a subclass may add its own)."""
        config = dict(start.config) if start is not None else {}
        run_id = wandb_run_id(ident)
        if ident.run_id == getattr(self.config, "run_id", None) and os.environ.get("WANDB_RUN_ID"):
            run_id = os.environ["WANDB_RUN_ID"]  # the user's choice for this process's own run
        kwargs: dict[str, Any] = {
            "project": ident.project or None,
            "name": ident.experiment or None,
            "config": _config_for_wandb(config),
            "id": run_id,
            "resume": "allow",
            "reinit": self._reinit,
        }
        entity = os.environ.get("WANDB_ENTITY")
        if entity:
            kwargs["entity"] = entity
        # verl: trainer.wandb_proxy -> wandb.Settings(https_proxy=...); the in-process config is
        # not secret-scrubbed, so it wins over the run start's copy
        proxy = _proxy_from(getattr(self.config, "verl_config", None)) or _proxy_from(config)
        settings: dict[str, Any] = {"https_proxy": proxy} if proxy else {}
        if self.training_pid and not os.environ.get("WANDB_X_STATS_PID"):
            # in the export process: wandb's system metrics (the run's "System" charts: the process's CPU,
            # memory, threads) are those of the training process, as when wandb runs in it
            settings["x_stats_pid"] = self.training_pid
        if settings:
            try:
                kwargs["settings"] = self._wandb.Settings(**settings)
            except Exception:  # a wandb without that setting: its system metrics are this process's
                settings.pop("x_stats_pid", None)
                if settings:
                    kwargs["settings"] = self._wandb.Settings(**settings)
        return kwargs

    def open_run(self, run: RunIdentity, start: RunStart | None) -> WandbRun:
        kwargs = self.init_kwargs(run, start)
        return WandbRun(run, self._start(kwargs), kwargs)

    def _start(self, kwargs: dict[str, Any]) -> Any:
        with _no_weave_autoinit():
            wb_run = self._wandb.init(**kwargs)
        self._register_atexit()
        wb_run.define_metric(self.step_metric)
        wb_run.define_metric("*", step_metric=self.step_metric)
        return wb_run

    def _live(self, handle: WandbRun) -> Any:
        """The handle's wandb run, resumed when other code finished it.

        ``wandb.init(reinit="finish_previous")`` (or ``reinit=True``) in user code finishes
        every live run of the process, ours included; its next rows resume the same run id.
        """
        if getattr(handle.run, "_is_finished", False):
            warn_once(
                f"wandb-resumed:{handle.ident.run_id}",
                "otel-rl: the wandb run %s was finished by other "
                "code (wandb.init with reinit=True / 'finish_previous'?); resuming it",
                handle.init_kwargs["id"],
            )
            handle.run = self._start(handle.init_kwargs)
        return handle.run

    def update_config(self, handle: WandbRun, start: RunStart) -> None:
        config = _config_for_wandb(dict(start.config))
        handle.init_kwargs["config"] = config
        self._live(handle).config.update(config, allow_val_change=True)

    def process_failed(self, state: str, text: str, exit_code: int = 1) -> None:
        self._exit_code = exit_code or 1  # the training process failed: its runs finish with its exit code

    def close_run(self, handle: WandbRun) -> None:
        if handle.console_rest:  # the training process's unfinished lines, before the run ends
            try:
                with self.console_lock:
                    rest, handle.console_rest = handle.console_rest, {}
                    self.console_to_run(
                        handle, [(stream, "".join(held[1:])) for stream, held in rest.items()], whole=True
                    )
            except Exception as exc:  # the run is finished below all the same
                warn_once(
                    "wandb-console-rest",
                    "otel-rl: the training process's last console text could not be added to the wandb run: %s",
                    exc,
                )
        try:
            code = getattr(self, "_exit_code", None)
            handle.run.finish() if code is None else handle.run.finish(exit_code=code)
        except Exception as exc:
            warn_once(
                f"wandb-finish:{type(exc).__name__}",
                "otel-rl: wandb run %s did not finish cleanly: %s",
                handle.ident.run_id,
                exc,
            )

    def console_to_run(self, handle: WandbRun, chunks: list[tuple[str, str]], whole: bool = False) -> None:
        """The training process's console into the run's log (``output.log``, the Logs tab), by the
        callback wandb's own console capture calls with what it captures; nothing when the run
        records no console (``console="off"``, ``WANDB_CONSOLE=off``).

        wandb's terminal for a stream is shared with this process's own output, so the training
        process's text goes there in whole lines: what follows a stream's last newline is held until
        that line ends (or the run does; `whole`: pass everything on), and this process's own lines
        cannot land inside a line of the trainer's (a progress bar's, say)."""
        run = handle.run
        if run is None or getattr(run, "_is_finished", False):
            return
        if str(getattr(getattr(run, "settings", None), "console", "")) == "off":
            return
        write = getattr(run, "_console_raw_callback", None)
        if write is None:
            warn_once(
                "wandb-console",
                "otel-rl: this wandb version offers no way to add the training process's "
                "console output to the run; its log holds the export process's",
            )
            return
        rest = handle.console_rest
        for stream, text in chunks:
            end = len(text) if whole else text.rfind("\n") + 1
            if end == 0:
                if text:
                    held = rest.setdefault(stream, [0])  # [characters held, pieces...]
                    held.append(text)
                    held[0] += len(text)
                    if held[0] > CONSOLE_HELD_MAX:  # a line that does not end (a run-long progress bar)
                        del rest[stream]
                        write(stream, "".join(held[1:]))
                continue
            pending = rest.pop(stream, None)
            write(stream, "".join(pending[1:]) + text[:end] if pending else text[:end])
            if end < len(text):
                rest[stream] = [len(text) - end, text[end:]]

    # -- delivery ------------------------------------------------------------------------
    def export_records(self, records: Sequence[Any]) -> None:
        with self._lock:
            if records is not self._batch:  # a new batch: the previous one was delivered or given up
                self._done.clear()
                self._batch = records
            super().export_records(records)
            self._done.clear()  # the whole batch is delivered
            self._batch = None

    def log(self, handle: WandbRun, data: dict[str, Any]) -> None:
        """The one place rows reach wandb (``Run.log``, never the global ``wandb.log``)."""
        self._live(handle).log(data)

    def write_metrics(self, handle: WandbRun, metrics: list[StepMetrics]) -> None:
        rows = merge_step_metrics(metrics)
        rows.sort(key=lambda r: r.step)  # stable: a batch's rows go in step order
        first = metrics[0]
        sm = self.step_metric
        for i, row in enumerate(rows):
            key = (id(first), i)
            if key in self._done:
                continue  # written before this batch was retried
            data: dict[str, Any] = {}
            for k, v in row.values.items():
                if not k:
                    warn_once("wandb-empty-key", "otel-rl: wandb drops an empty metric name; logged as %r", EMPTY_KEY)
                    k = EMPTY_KEY
                data[k] = v
            if sm in data and data[sm] != row.step:
                warn_once(
                    f"wandb-step-key:{sm}",
                    "otel-rl: metric %r is wandb's step key here; the logged step (%d) replaces the value %r",
                    sm,
                    row.step,
                    data[sm],
                )
            data[sm] = row.step
            self.log(handle, data)
            self._done[key] = first
            self._track(handle, data, row.step)
        self._fix_summary(handle)

    @staticmethod
    def _track(handle: WandbRun, data: dict[str, Any], step: int) -> None:
        latest, stale = handle.latest, handle.stale
        for k, v in data.items():
            cur = latest.get(k)
            if cur is None or step >= cur[0]:
                latest[k] = (step, v)
                stale.discard(k)
            else:
                stale.add(k)

    def _fix_summary(self, handle: WandbRun) -> None:
        """wandb's summary is the last logged value; after a late (lower) step, put back the
        value of the highest step, which is what a summary of a training run should show."""
        if handle.stale:
            self._live(handle).summary.update({k: handle.latest[k][1] for k in handle.stale})
            handle.stale.clear()

    def write_generations(self, handle: WandbRun, generations: list[Generations]) -> None:
        for g in generations:
            key = (id(g), "gen")
            if key in self._done:
                continue
            row: list[Any] = [g.step]
            for inp, out, score in g.rows:
                row.extend((inp, out, score))
            handle.gen_rows.append(row)
            handle.gen_width = max(handle.gen_width, len(g.rows))
            handle.gen_step = g.step
            handle.gen_dirty = True
            self._done[key] = g
        if handle.gen_dirty:
            self.log(handle, {sc.VAL_GENERATIONS_KEY: self._table(handle), self.step_metric: handle.gen_step})
            handle.gen_dirty = False
            self._track(handle, {self.step_metric: handle.gen_step}, handle.gen_step)
            self._fix_summary(handle)

    def _table(self, handle: WandbRun) -> Any:
        # verl's layout: one row per validation step; a row with fewer samples than the
        # widest one is padded with None
        width = handle.gen_width
        columns: list[str | int] = [sc.TAG_STEP]
        for i in range(1, width + 1):
            columns += [f"input_{i}", f"output_{i}", f"score_{i}"]
        n = len(columns)
        data = [r + [None] * (n - len(r)) for r in handle.gen_rows]
        return self._wandb.Table(columns=columns, data=data, allow_mixed_types=True)

    # -- lifecycle -----------------------------------------------------------------------
    def shutdown(self) -> None:
        got = self._lock.acquire(timeout=30.0)  # a delivery stuck in wandb must not hang the exit
        try:
            super().shutdown()
        finally:
            if got:
                self._lock.release()
            hook, self._atexit_hook = self._atexit_hook, None
            if hook is not None:
                atexit.unregister(hook)

    def _register_atexit(self) -> None:
        """Deliver and finish before wandb tears its service down at exit.

        wandb registers its teardown at its first `wandb.init`, after otel-rl's own exit
        hook, so it would run first (atexit is last-in first-out) and what is still queued
        would be lost.  This hook, registered after wandb's, runs before it.
        """
        if self._atexit_hook is not None:
            return
        ref = weakref.ref(self)

        def hook() -> None:
            exporter = ref()
            if exporter is not None:
                exporter._exit_flush()

        self._atexit_hook = hook
        atexit.register(hook)

    def _exit_flush(self) -> None:
        try:
            import otel_rl

            h = otel_rl.current()
            if h is not None and not h.closed and any(e is self for e in h.exporters):
                h.shutdown(10.0)  # delivers everything, then finishes our runs
                return
            from opentelemetry import trace as trace_api

            flush = getattr(trace_api.get_tracer_provider(), "force_flush", None)
            if flush is not None:  # the OTel SDK path (WandbSpanExporter)
                flush(10_000)
        except Exception as exc:  # never fail an exit
            _log.warning("otel-rl: wandb exporter exit flush failed: %s", exc)
        self.shutdown()
