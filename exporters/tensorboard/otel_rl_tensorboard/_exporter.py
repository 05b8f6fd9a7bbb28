"""The TensorBoard exporter (see the package README for the behaviour in full)."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

from otel_rl import semconv as sc
from otel_rl.exporters.base import warn_once
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics

_log = logging.getLogger("otel_rl")

#: verl's variable: the event file directory of every run of the process
ENV_DIR = "TENSORBOARD_DIR"
#: verl's default: ``tensorboard_log/<project>/<experiment>`` under the working directory at init()
DEFAULT_ROOT = "tensorboard_log"
CONFIG_TAG = "config"
GENERATIONS_TAG = sc.VAL_GENERATIONS_KEY
GENERATION_HEADERS = ("input", "output", "score")


def log_dir(project: str, experiment: str, env: Any = None, cwd: str | None = None) -> str:
    """Where a run's event files go: ``$TENSORBOARD_DIR``, else ``tensorboard_log/<project>/<experiment>``
    (verl's choice), relative paths taken from `cwd`."""
    env = os.environ if env is None else env
    path = env.get(ENV_DIR) or os.path.join(DEFAULT_ROOT, project or "otel_rl", experiment or "default")
    return os.path.join(cwd or os.getcwd(), os.path.expanduser(path))


def scalar(value: Any) -> float:
    """A logged value as the float TensorBoard stores (as float32: beyond its range it is ±inf)."""
    try:
        return float(value)
    except OverflowError:  # an int beyond the double range
        return math.inf if value > 0 else -math.inf


def _text(value: str) -> str:
    """`value` as protobuf accepts it (lone surrogates would fail the whole event)."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")


def _score(score: Any) -> str:
    return "" if score is None else str(score)


class _Run:
    def __init__(self, ident: RunIdentity, path: str, writer: Any):
        self.ident = ident
        self.path = path
        self.writer = writer

    def label(self) -> str:
        i = self.ident
        return f"{i.project}/{i.experiment} ({i.run_id})"


class TensorboardExporter(TrackerExporter):
    """Scalars, config and validation generations to TensorBoard event files, as verl writes them.

    Each ``log()`` call becomes one event at its step holding one scalar per key
    (TensorBoard keeps every point: see README for repeated and out-of-order steps).
    """

    tracker_name = "tensorboard"
    exports_trajectories = False

    def __init__(self, config: Any):
        super().__init__(config)
        # imported here: a missing package fails at init(), not on the delivery thread
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._Event, self._Summary, self._text_pb, self._Writer = Event, Summary, text_pb, EventFileWriter
        if getattr(config, "trace_backend", None) == self.tracker_name:
            warn_once(
                "tensorboard-traces",
                "otel-rl: TensorBoard has no trace view; trajectories are not written "
                "to TensorBoard (use trace backend 'mlflow' or 'weave')",
            )
        self.wants_trajectories = False
        self._env_dir = os.environ.get(ENV_DIR)
        self._cwd = os.getcwd()  # relative directories as at init() (a trainer may chdir later)
        self._dirs: dict[str, RunIdentity] = {}

    # -- runs ------------------------------------------------------------------------------
    def open_run(self, run: RunIdentity, start: RunStart | None) -> _Run:
        path = log_dir(run.project, run.experiment, {ENV_DIR: self._env_dir} if self._env_dir else {}, self._cwd)
        owner = self._dirs.get(path)
        if owner is not None and owner != run:
            # a second run identity in this exporter (a bridge serving several trainings): its own directory
            path = os.path.join(path, run.run_id or "run")
            warn_once(
                f"tensorboard-shared:{path}",
                "otel-rl: run %s/%s (%s) shares its TensorBoard directory with another run; its event files go to %s",
                run.project,
                run.experiment,
                run.run_id,
                path,
            )
        os.makedirs(path, exist_ok=True)
        writer = self._Writer(path)
        self._dirs.setdefault(path, run)
        state = _Run(run, path, writer)
        _log.info("otel-rl: TensorBoard event files of run %s in %s", state.label(), path)
        if start is not None:
            self._write_config(state, start)
        return state

    def update_config(self, handle: _Run, start: RunStart) -> None:
        self._write_config(handle, start)

    def _write_config(self, state: _Run, start: RunStart) -> None:
        text = "```json\n" + json.dumps(start.config, indent=2, ensure_ascii=False, default=str) + "\n```"
        summary = self._text_pb(CONFIG_TAG, _text(text))
        state.writer.add_event(self._Event(wall_time=start.time_ns / 1e9, step=0, summary=summary))
        state.writer.flush()

    def write_metrics(self, handle: _Run, metrics: list[StepMetrics]) -> None:
        Event, Summary = self._Event, self._Summary
        add = handle.writer.add_event
        for m in metrics:
            values = []
            for k, v in m.values.items():
                try:
                    values.append(Summary.Value(tag=k, simple_value=scalar(v)))
                except (ValueError, TypeError):  # a tag protobuf refuses (lone surrogates)
                    values.append(Summary.Value(tag=_text(k), simple_value=scalar(v)))
            if values:
                add(Event(wall_time=m.time_ns / 1e9, step=m.step, summary=Summary(value=values)))
        handle.writer.flush()

    def write_generations(self, handle: _Run, generations: list[Generations]) -> None:
        import numpy as np

        for g in generations:
            cells = [list(GENERATION_HEADERS)] + [[_text(str(i)), _text(str(o)), _score(s)] for i, o, s in g.rows]
            summary = self._text_pb(GENERATIONS_TAG, np.array(cells, dtype=object))
            handle.writer.add_event(self._Event(wall_time=g.time_ns / 1e9, step=g.step, summary=summary))
        handle.writer.flush()

    def close_run(self, handle: _Run) -> None:
        handle.writer.close()

    def flush(self, timeout_s: float = 10.0) -> None:
        for state in list(self.runs.values()):
            try:
                state.writer.flush()
            except Exception as exc:  # reported here; the next delivery raises it again and is retried
                warn_once(
                    f"tensorboard-flush:{type(exc).__name__}",
                    "otel-rl: TensorBoard event file flush failed (%s: %s)",
                    type(exc).__name__,
                    exc,
                )
