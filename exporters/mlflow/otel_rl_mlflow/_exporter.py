"""The MLflow tracker exporter.

One MLflow run per otel-rl run identity, through `MlflowClient` (never the fluent
active run, so several runs coexist in one process and nothing leaks into the
user's own ``mlflow.start_run()``):

=========================  ===================================================
otel-rl                    MLflow
=========================  ===================================================
project                    experiment (created when missing)
experiment                 run name
run id                     run tag ``rl.run.id``; a later process with the same
                           run id reattaches to that run
config (RunStart)          params, flattened like verl (``a/b/c``, lists as
                           ``list_len`` + indices), 100 per ``log_batch``
``log()`` (StepMetrics)    metrics, ``log_batch`` with up to 1000 points per
                           call across steps, timestamp and step of the record
``log_generations()``      table ``val_generations/step_<n>.json`` per step
                           (``mlflow.load_table`` reads it)
trajectories               one trace each (full span tree) linked to the run
=========================  ===================================================

Everything runs on the exporter's delivery thread.  Any MLflow error propagates
(the core keeps the batch and retries it); every write is safe to repeat.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from otel_rl import semconv as sc
from otel_rl.exporters.packages import hidden_imports
from otel_rl.exporters.tracker import TrackerExporter, flatten_config
from otel_rl.records import Generations, Record, RunIdentity, RunStart, StepMetrics

from . import _traces
from ._context import run_context_tags
from ._keys import (
    MAX_EXPERIMENT_NAME_CHARS,
    MAX_KEY_CHARS,
    MAX_PARAM_VALUE_CHARS,
    MAX_TAG_VALUE_CHARS,
    KeyMapper,
    param_value,
    shorten_name,
    truncate,
)
from ._run import (
    INF_METRICS_TAG,
    INF_STEPS_KEPT,
    LOGGED_ARTIFACTS_TAG,
    MlflowRun,
    data_errors,
    resolve_tracking_uri,
)
from ._trajectories import TrajectoryWriting
from .direct import metrics as direct_metrics
from .direct.store import create_sqlite_store

_log = logging.getLogger("otel_rl")

#: run tag holding the otel-rl run id (how a later process finds the run again)
RUN_ID_TAG = sc.RL_RUN_ID
#: artifact location of the experiments this exporter creates (a path or URI; default: MLflow's)
ENV_ARTIFACT_LOCATION = "OTEL_RL_MLFLOW_ARTIFACT_LOCATION"
#: artifact path of the validation generations table of step n
GENERATIONS_TABLE = "val_generations/step_{step}.json"
GENERATIONS_COLUMNS = ["step", "input", "output", "score"]

MAX_METRICS_PER_BATCH = 1000  # MLflow MAX_METRICS_PER_BATCH
MAX_ENTITIES_PER_BATCH = 1000  # MLflow MAX_ENTITIES_PER_BATCH (metrics + params + tags)
MAX_PARAMS_TAGS_PER_BATCH = 100  # MLflow MAX_PARAMS_TAGS_PER_BATCH
CLOSE_TIMEOUT_S = 10.0


class MlflowExporter(TrajectoryWriting, TrackerExporter):
    """otel-rl -> MLflow.  Settings come from the environment (see the README)."""

    tracker_name = "mlflow"
    #: MLflow's cost calculation tries ``import litellm`` for every LLM span it stores (~0.2 ms when it is
    #: not installed); the export process marks these absent once (`otel_rl.export_process.ostune.mark_absent`)
    probed_modules = ("litellm",)
    #: what MLflow's import and its store's opening would load for nothing here
    #: (`otel_rl.exporters.packages.hidden_imports`): pandas for MLflow's dataset helpers; pygments for the
    #: syntax highlighting of mako's HTML error pages (mako is a dependency of alembic, which MLflow's sqlalchemy
    #: store imports for its migrations; mako falls back to plain text without pygments)
    unused_imports = ("pandas", "pygments")

    def prepare(self, records: Sequence[Record]) -> None:
        """While its queue gathers a delivery (`otel_rl.exporters.base.Exporter.prepare`): the trajectories'
        MLflow spans and direct-writer rows computed ahead (`prepare_trajectories`)."""
        self.prepare_trajectories(records)

    @staticmethod
    def store_client(tracking_uri: str) -> Any:
        """An ``mlflow.MlflowClient`` of `tracking_uri` (`otel_rl.exporters.registry.store_client`)."""
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri)

    def __init__(self, config: Any, tracking_uri: str | None = None):
        super().__init__(config)
        self._explicit_uri = tracking_uri
        self.tracking_uri: str | None = None
        self._client: Any = None
        self._tracing: Any = None
        self._spans: _traces.SpanBuilder | None = None
        self._metric_keys = KeyMapper("metric")
        self._param_keys = KeyMapper("param")
        self._progress: dict[tuple, int] = {}  # chunks of a failed write already delivered
        self._chunking: dict[tuple, tuple[int, int, int]] = {}  # the chunk limits of that failed write
        self._warned: set[str] = set()
        self._log_spans_supported = True
        self._bulk: Any = None  # direct_traces.BulkTraceWriter, False (not applicable), None (not looked at)
        self._bulk_metrics: Any = None  # direct_metrics.BulkMetricWriter, False, None: the same
        self._remote: Any = None  # _remote.RemoteTraceWriter (a tracking server), False, None: the same
        self._ahead: dict[int, list[Any]] = {}  # trace id -> its spans (`_traces.RowSpan`), built by `prepare`
        self._end_status = "FINISHED"  # how the runs end at shutdown (process_failed: FAILED / KILLED)
        self._leave_open = False  # leave_runs_open(): runs keep the status they have (a replay)

    # -- clients ------------------------------------------------------------------------
    def _clients(self) -> tuple[Any, Any]:
        if self._client is None:
            hide = self.unused_imports if self.in_export_process else ()
            try:
                with hidden_imports(hide):
                    self._open_clients()
            except ImportError:
                if not hide:
                    raise
                _log.debug(
                    "otel-rl: MLflow could not be imported, or its store opened, without %s; doing it again "
                    "as MLflow comes",
                    hide,
                    exc_info=True,
                )
                self._open_clients()
        return self._client, self._tracing

    def _open_clients(self) -> None:
        """MLflow's clients for the tracking URI (a new sqlite store created first).  In the export process
        `_clients` calls it with the optional libraries this exporter never uses hidden (`unused_imports`),
        which MLflow's import and its store's opening would load; should that fail, again as MLflow comes."""
        from mlflow import MlflowClient
        from mlflow.tracing.client import TracingClient

        uri = resolve_tracking_uri(self._explicit_uri)
        create_sqlite_store(uri)
        client = MlflowClient(tracking_uri=uri)  # raises for an unusable URI: retried later
        self._tracing = TracingClient(uri)
        self._client = client
        self.tracking_uri = uri

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(msg, *args)

    def export_records(self, records: Sequence[Any]) -> None:
        if records is not getattr(self, "_inflight", None):
            self._progress.clear()  # a new batch: partial progress of a dropped one is void
            self._chunking.clear()
        super().export_records(records)

    # -- runs -----------------------------------------------------------------------------
    def _identity(self, ident: RunIdentity) -> RunIdentity:
        c = self.config
        return RunIdentity(
            ident.project or getattr(c, "project", "") or "otel_rl",
            ident.experiment or getattr(c, "experiment", "") or "default",
            ident.run_id or getattr(c, "run_id", ""),
        )

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        client, _ = self._clients()
        name = shorten_name(name, MAX_EXPERIMENT_NAME_CHARS)
        exp = client.get_experiment_by_name(name)
        if exp is None:
            try:
                # where the artifacts of an experiment created here go (MLflow's default: ./mlruns)
                location = os.environ.get(ENV_ARTIFACT_LOCATION) or None
                return client.create_experiment(name, artifact_location=location)
            except MlflowException as exc:  # created meanwhile by another process
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    raise exc
        if exp.lifecycle_stage != "active":
            raise RuntimeError(
                f"MLflow experiment {name!r} is deleted; restore it "
                f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) "
                "or use another project name"
            )
        return exp.experiment_id

    def _find_runs(self, experiment_id: str, run_id: str) -> list[Any]:
        from mlflow.entities import ViewType

        client, _ = self._clients()
        if "'" not in run_id:
            literal = f"'{run_id}'"
        elif '"' not in run_id:
            literal = f'"{run_id}"'
        else:
            self._warn_once(
                f"quote:{run_id}", "otel-rl: run id %r cannot be searched in MLflow; a new run is created", run_id
            )
            return []
        runs = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_ID_TAG}` = {literal}",
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=10,
        )
        return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))

    def open_run(self, run: RunIdentity, start: RunStart | None) -> MlflowRun:
        client, _ = self._clients()
        ident = self._identity(run)
        env_run = os.environ.get("MLFLOW_RUN_ID")
        mlrun = None
        new = False
        if env_run and ident.run_id == (getattr(self.config, "run_id", "") or ident.run_id):
            mlrun = client.get_run(env_run)  # attach to the run the user named
            if RUN_ID_TAG not in mlrun.data.tags and ident.run_id:
                client.set_tag(mlrun.info.run_id, RUN_ID_TAG, ident.run_id)
                mlrun.data.tags[RUN_ID_TAG] = ident.run_id
        else:
            experiment_id = self._experiment_id(ident.project)
            found = self._find_runs(experiment_id, ident.run_id) if ident.run_id else []
            if found:
                mlrun = found[0]
            else:
                # User and Source on the run page, as mlflow.start_run sets them
                tags = run_context_tags()
                if ident.run_id:
                    tags[RUN_ID_TAG] = ident.run_id
                mlrun = client.create_run(
                    experiment_id, run_name=shorten_name(ident.experiment, MAX_KEY_CHARS), tags=tags
                )
                new = True
                if ident.run_id:  # two processes created it at once: all keep the oldest
                    found = self._find_runs(experiment_id, ident.run_id)
                    if found and found[0].info.run_id != mlrun.info.run_id:
                        client.delete_run(mlrun.info.run_id)
                        mlrun, new = found[0], False
        if mlrun.info.status != "RUNNING" and not self._leave_open:
            client.update_run(mlrun.info.run_id, status="RUNNING")
        handle = MlflowRun(
            mlrun.info.run_id, mlrun.info.experiment_id, dict(mlrun.data.params), dict(mlrun.data.tags), new
        )
        if start is not None:
            self.update_config(handle, start)
        return handle

    def update_config(self, handle: MlflowRun, start: RunStart) -> None:
        with data_errors():
            self._update_config(handle, start)

    def _update_config(self, handle: MlflowRun, start: RunStart) -> None:
        from mlflow.entities import Param

        client, _ = self._clients()
        todo: list[Any] = []
        for k, v in flatten_config(start.config).items():
            key = self._param_keys(str(k))
            value, cut = truncate(param_value(v), MAX_PARAM_VALUE_CHARS)
            if cut:
                self._warn_once(
                    f"param-cut:{key}",
                    "otel-rl: MLflow param %r is longer than %d characters; truncated",
                    key,
                    MAX_PARAM_VALUE_CHARS,
                )
            old = handle.params.get(key)
            if old == value:
                continue
            if old is not None:
                self._warn_once(
                    f"param-changed:{handle.run_id}:{key}",
                    "otel-rl: MLflow param %r of run %s is already %r; new value %r not logged "
                    "(MLflow params cannot change)",
                    key,
                    handle.run_id,
                    old[:200],
                    value[:200],
                )
                continue
            todo.append(Param(key, value))
        for i in range(0, len(todo), MAX_PARAMS_TAGS_PER_BATCH):
            part = todo[i : i + MAX_PARAMS_TAGS_PER_BATCH]
            client.log_batch(handle.run_id, params=part)
            for p in part:
                handle.params[p.key] = p.value

    def process_failed(self, state: str, text: str, exit_code: int = 1) -> None:
        # as MLflow's own fluent API ends a run: FAILED for an exception or a failing exit, KILLED when it was
        # stopped (Ctrl-C, a termination signal)
        self._end_status = "FAILED" if state == "crashed" else "KILLED"

    def leave_runs_open(self, leave: bool = True) -> None:
        """Runs keep the status they have: not set RUNNING when opened, not ended at shutdown (`otel-rl
        replay` of a spool whose trainer never said how it ended: killed, or still running)."""
        self._leave_open = leave

    def close_run(self, handle: MlflowRun) -> None:
        if handle.closed:
            return
        if not self._leave_open:
            client, _ = self._clients()
            client.set_terminated(handle.run_id, self._end_status)
        handle.closed = True

    def shutdown(self) -> None:
        """End the runs (FINISHED, or as `process_failed` says), bounded in time: a dead server must not
        hold up the exit."""
        runs = list(self.runs.values())
        self.runs.clear()
        if self._bulk:
            self._bulk.close()
        if self._bulk_metrics:
            self._bulk_metrics.close()
        if self._remote:
            self._remote.close()
        if not runs or self._client is None:
            return

        def close_all() -> None:
            for h in runs:
                try:
                    self.close_run(h)
                except Exception as exc:
                    _log.warning("otel-rl: could not mark MLflow run %s finished: %s", h.run_id, exc)

        t = threading.Thread(target=close_all, name="otel-rl-mlflow-close", daemon=True)
        t.start()
        t.join(CLOSE_TIMEOUT_S)

    # -- metrics -------------------------------------------------------------------------
    def write_metrics(self, handle: MlflowRun, metrics: list[StepMetrics]) -> None:
        with data_errors():
            self._write_metrics(handle, metrics)

    def _write_metrics(self, handle: MlflowRun, metrics: list[StepMetrics]) -> None:
        from mlflow.entities import Metric, RunTag

        client, _ = self._clients()
        keys = self._metric_keys
        points: list[Any] = []
        inf = handle.inf
        isinf = math.isinf
        for r in metrics:
            ts = r.time_ns // 1_000_000
            step = r.step
            for k, v in r.values.items():
                key = keys(k)
                t = type(v)
                if t is float:
                    value = v
                elif t is bool:
                    value = 1.0 if v else 0.0
                else:
                    try:
                        value = float(v)
                    except OverflowError:  # an int beyond the double range
                        value = math.inf if v > 0 else -math.inf
                if isinf(value):  # stored by MLflow as +-1.797e308: flagged in a run tag
                    steps = inf.setdefault(key, {})
                    if len(steps) < INF_STEPS_KEPT:
                        steps[step] = "+inf" if value > 0 else "-inf"
                points.append(Metric(key, value, ts, step))
        tags = []
        inf_text = handle.inf_tag_value()
        if inf_text is not None and inf_text != handle.inf_tag_sent:
            tags.append(RunTag(INF_METRICS_TAG, inf_text))
        self._send_metrics(client, handle, metrics, points, tags)
        if tags:
            handle.inf_tag_sent = inf_text

    def _send_metrics(
        self, client: Any, handle: MlflowRun, records: list[Any], points: list[Any], tags: list[Any]
    ) -> None:
        calls: list[tuple[list[Any], list[Any]]] = []
        i = 0
        n = len(points)
        while i < n:
            calls.append((points[i : i + MAX_METRICS_PER_BATCH], []))
            i += MAX_METRICS_PER_BATCH
        if tags:
            if calls and len(calls[-1][0]) + len(tags) <= MAX_ENTITIES_PER_BATCH:
                calls[-1] = (calls[-1][0], tags)
            else:
                calls.append(([], tags))
        key = self._progress_key("metrics", records)
        done = self._progress.get(key, 0)
        bulk = self._bulk_metric_writer(client)
        for j in range(done, len(calls)):
            ms, ts = calls[j]
            try:
                if bulk is not None and not ts:
                    bulk.log(handle.run_id, ms, lambda part: client.log_batch(handle.run_id, metrics=part))
                else:
                    client.log_batch(handle.run_id, metrics=ms, tags=ts)
            except Exception:
                self._progress[key] = j
                raise
        self._progress.pop(key, None)

    def _bulk_metric_writer(self, client: Any) -> Any:
        """The direct sqlite metric writer for this store (`direct.metrics`), or None."""
        if self._bulk_metrics is None:
            try:
                store = client._tracking_client.store
                self._bulk_metrics = direct_metrics.BulkMetricWriter.for_store(store) or False
            except Exception:
                self._bulk_metrics = False
        return self._bulk_metrics or None

    def _progress_key(self, part: str, records: Sequence[Any]) -> tuple:
        first, last = records[0], records[-1]
        return (part, id(first), getattr(first, "time_ns", 0), id(last), getattr(last, "time_ns", 0), len(records))

    # -- generations ---------------------------------------------------------------------
    def write_generations(self, handle: MlflowRun, generations: list[Generations]) -> None:
        with data_errors():
            self._write_generations(handle, generations)

    def _write_generations(self, handle: MlflowRun, generations: list[Generations]) -> None:
        client, _ = self._clients()
        by_step: OrderedDict[int, list[Generations]] = OrderedDict()
        seen: set[tuple] = set()  # a redelivered record can come in the same batch as the first copy
        for g in generations:
            key = (g.step, g.time_ns, len(g.rows))
            if key not in handle.gen_done and key not in seen:
                seen.add(key)
                by_step.setdefault(g.step, []).append(g)
        for step, gens in by_step.items():
            path = GENERATIONS_TABLE.format(step=step)
            rows = self._table_rows(client, handle, step, path)
            new_rows = rows + [
                [step, inp, out, score if math.isfinite(score) else None] for g in gens for inp, out, score in g.rows
            ]
            text = json.dumps({"columns": GENERATIONS_COLUMNS, "data": new_rows}, ensure_ascii=False)
            client.log_text(handle.run_id, text, path)  # the whole table of the step: a retry rewrites it
            handle.gen_rows[step] = new_rows
            handle.gen_rows.move_to_end(step)
            while len(handle.gen_rows) > 4:
                handle.gen_rows.popitem(last=False)
            if handle.gen_listing is not None:
                handle.gen_listing.add(path)
            for g in gens:
                handle.gen_done.add((g.step, g.time_ns, len(g.rows)))
            self._register_table(client, handle, path)

    def _table_rows(self, client: Any, handle: MlflowRun, step: int, path: str) -> list[list[Any]]:
        rows = handle.gen_rows.get(step)
        if rows is not None:
            return rows
        if handle.new and handle.gen_listing is None:
            handle.gen_listing = set()
        if handle.gen_listing is None:
            handle.gen_listing = {f.path for f in client.list_artifacts(handle.run_id, "val_generations")}
        if path not in handle.gen_listing:
            return []
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            local = client.download_artifacts(handle.run_id, path, tmp)
            with open(local, encoding="utf-8") as f:
                data = json.load(f)
        return [list(r) for r in data.get("data", [])]

    def _register_table(self, client: Any, handle: MlflowRun, path: str) -> None:
        entry = {"path": path, "type": "table"}
        if entry in handle.tables:
            return
        tables = handle.tables + [entry]
        text = json.dumps(tables)
        if len(text) > MAX_TAG_VALUE_CHARS:
            self._warn_once(
                f"tables-tag:{handle.run_id}",
                "otel-rl: run %s has too many tables for MLflow's %s tag; later tables are logged "
                "(mlflow.load_table reads them) but not listed in the UI's table view",
                handle.run_id,
                LOGGED_ARTIFACTS_TAG,
            )
            return
        client.set_tag(handle.run_id, LOGGED_ARTIFACTS_TAG, text)
        handle.tables = tables
