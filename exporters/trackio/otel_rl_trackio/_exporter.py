"""The Trackio exporter (see the package README for the behaviour in full)."""

from __future__ import annotations

import logging
import math
from typing import Any

from otel_rl import semconv as sc
from otel_rl.exporters.base import warn_once
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics

_log = logging.getLogger("otel_rl")

CONFIG_RUN_ID_KEY = "OTEL_RL_RUN_ID"
GENERATIONS_KEY = sc.VAL_GENERATIONS_KEY


def _value(v: Any) -> Any:
    """What Trackio stores for a logged value: ints and bools exact, floats as they are (NaN, ±Inf too)."""
    if isinstance(v, bool) or isinstance(v, int) and -(2**63) <= v < 2**63:
        return v
    try:
        return float(v)
    except OverflowError:  # an int beyond what Trackio's JSON column can hold
        return math.inf if v > 0 else -math.inf


class _Run:
    def __init__(self, ident: RunIdentity, run: Any, owned: bool):
        self.ident = ident
        self.run = run
        self.owned = owned  # False: the application opened this Trackio run; it is not finished here

    def label(self) -> str:
        i = self.ident
        return f"{i.project}/{i.experiment} ({i.run_id})"


class TrackioExporter(TrackerExporter):
    """Step metrics, config and validation generations to Trackio's local store, the way verl logs them.

    verl reuses a Trackio run already open in the process: so does this exporter, for the
    first run identity, when the application opened one before ``otel_rl.init()``.
    """

    tracker_name = "trackio"
    exports_trajectories = False

    def __init__(self, config: Any):
        super().__init__(config)
        # imported here: a missing package fails at init(), and the run open on this (the
        # application's) thread is seen: Trackio keeps it in a context variable
        import trackio
        from trackio import context_vars

        self._trackio = trackio
        self._app_run = context_vars.current_run.get()
        if getattr(config, "trace_backend", None) == self.tracker_name:
            warn_once(
                "trackio-traces",
                "otel-rl: trajectories are not written to Trackio (use trace backend "
                "'mlflow' or 'weave'); metrics and validation generations are",
            )
        self.wants_trajectories = False

    # -- runs ------------------------------------------------------------------------------
    def open_run(self, run: RunIdentity, start: RunStart | None) -> _Run:
        config = {CONFIG_RUN_ID_KEY: run.run_id, **(start.config if start is not None else {})}
        app, self._app_run = self._app_run, None
        if app is not None:
            _log.info(
                "otel-rl: a Trackio run is already open in this process; logging run %s into it",
                f"{run.project}/{run.experiment}",
            )
            return _Run(run, app, owned=False)
        handle = self._trackio.init(project=run.project or "otel_rl", name=run.experiment or None, config=config)
        return _Run(run, handle, owned=True)

    def update_config(self, handle: _Run, start: RunStart) -> None:
        warn_once(
            f"trackio-config:{handle.ident}",
            "otel-rl: Trackio keeps the config given when its run opens; a later config of run %s is not recorded",
            handle.label(),
        )

    def write_metrics(self, handle: _Run, metrics: list[StepMetrics]) -> None:
        for m in metrics:
            handle.run.log({k: _value(v) for k, v in m.values.items()}, step=m.step)

    def write_generations(self, handle: _Run, generations: list[Generations]) -> None:
        trace = self._trackio.Trace
        for g in generations:
            traces = [
                trace(
                    messages=[{"role": "user", "content": str(i)}, {"role": "assistant", "content": str(o)}],
                    metadata={
                        "source": "validation_generations",
                        "sample_index": n,
                        "score": None if s is None or isinstance(s, float) and math.isnan(s) else s,
                    },
                )
                for n, (i, o, s) in enumerate(g.rows)
            ]
            if traces:
                handle.run.log({GENERATIONS_KEY: traces}, step=g.step)

    def close_run(self, handle: _Run) -> None:
        if handle.owned:
            handle.run.finish()
        else:
            self._write_now(handle.run)

    def flush(self, timeout_s: float = 10.0) -> None:
        for state in list(self.runs.values()):
            self._write_now(state.run)

    @staticmethod
    def _write_now(run: Any) -> None:
        """Write what the run queued to its store now (its own thread does so every few seconds)."""
        write, lock = getattr(run, "_flush_queues_inline", None), getattr(run, "_client_lock", None)
        if write is None or lock is None or not getattr(run, "_is_local", False):
            return
        try:
            with lock:
                write()
        except Exception as exc:  # its own thread writes it later
            warn_once(
                f"trackio-flush:{type(exc).__name__}", "otel-rl: Trackio flush failed (%s: %s)", type(exc).__name__, exc
            )
