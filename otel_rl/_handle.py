"""The `Handle` of a running pipeline: otel-rl's private providers, `log()` and `log_generations()`, the
pipeline changed while it runs, `flush()` and `shutdown()`.  `init()` (otel_rl._init) makes it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, SupportsInt

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from . import _exit, _runtime
from . import semconv as sc
from ._assemble import end_exporter
from ._instruments import Instruments, views
from ._items import GenerationsItem, LogItem
from ._lightspan import LightTracer, TimeOrderedIds
from ._pipeline import Pipeline, make_span_processor
from ._processors import (
    OtherProcessors,
    OwnProvider,
    _forwarding,  # noqa: F401 - the global provider otel-rl installs (tests compare against it)
)
from ._runtime import STEP, Runtime
from ._values import coerce_metrics, coerce_step, generation_rows, warn_once
from .config import Config
from .export_process.client import ExportProcessClient
from .exporters import registry
from .exporters.base import Exporter
from .instrument import end_open_trajectories
from .redact import scrub_secrets
from .sampling import Sampler
from .serialize import to_json
from .spool.replay import note_run_end

_log = logging.getLogger("otel_rl")
__version__ = "0.1.0"


class Handle:
    """A running otel-rl pipeline.  Use as a context manager or call `shutdown()`."""

    #: a later `init()` replaces this pipeline without a warning (the test kit's capture sets it)
    replaced_quietly = False

    def __init__(
        self,
        config: Config,
        exporters: Sequence[Exporter | tuple[str, str, type, bool]],
        tokenizer: object = None,
        global_providers: tuple[TracerProvider | None, MeterProvider | None] = (None, None),
    ):
        self.config = config
        remote_specs = [x[1:] for x in exporters if isinstance(x, tuple)]
        self._export_process: ExportProcessClient | None = None
        built: list[Exporter] = [x for x in exporters if not isinstance(x, tuple)]
        if remote_specs:
            self._export_process = ExportProcessClient(config, remote_specs, on_death=self._export_process_died)
            stubs = iter(self._export_process.exporters)
            built = [next(stubs) if isinstance(x, tuple) else x for x in exporters]
        self.exporters = exporters = built
        # a trace backend that is not in the logger list gets the trajectories only (as in verl), not the
        # metrics nor the generations: `_record_targets` names the exporters that get them (None: all)
        self._trace_only: set[str] = set()
        if config.trace_backend and config.trace_backend not in config.exporters:
            self._trace_only.add(config.trace_backend)
        self._record_targets: frozenset[str] | None = None
        self._update_record_targets()
        self._closed = False
        self._lock = threading.Lock()
        self._last_step = 0
        cfg = config
        tracing = bool(
            not cfg.disabled
            and (
                cfg.tracing
                if cfg.tracing is not None
                else any(e.wants_spans or e.wants_trajectories for e in exporters)
            )
        )
        attrs: dict[str, Any] = dict(cfg.resource_attributes)
        attrs.update(
            {
                sc.SERVICE_NAME: cfg.service_name,
                sc.RL_PROJECT_NAME: cfg.project,
                sc.RL_EXPERIMENT_NAME: cfg.experiment,
                sc.RL_RUN_ID: cfg.run_id,
                sc.RL_WORKER_RANK: cfg.rank,
            }
        )
        self.resource = Resource.create(attrs)
        self.identity = {
            sc.RL_PROJECT_NAME: cfg.project,
            sc.RL_EXPERIMENT_NAME: cfg.experiment,
            sc.RL_RUN_ID: cfg.run_id,
        }
        readers = [r for e in exporters for r in e.metric_readers()]
        self.meter_provider = MeterProvider(resource=self.resource, metric_readers=readers, views=views())
        scope = InstrumentationScope("otel_rl", __version__)
        self._pipeline: Pipeline  # (assigned below: until then the instruments' callback sees no queues)
        glob_tp, glob_mp = global_providers if cfg.feed_global_provider else (None, None)
        self.others = OtherProcessors(glob_tp)
        # without a metric reader nobody reads the instruments: do not pay for updating them
        meters = [self.meter_provider.get_meter("otel_rl", __version__)] if readers else []
        if glob_mp is not None:
            meters.append(glob_mp.get_meter("otel_rl", __version__))
        instruments = Instruments.on(
            meters, self.identity, lambda: self._pipeline.queues if hasattr(self, "_pipeline") else []
        )
        self._pipeline = Pipeline(
            cfg,
            self.resource,
            [e for e in exporters if not getattr(e, "remote", False)],
            instruments,
            scope,
            remote=self._export_process,
            others=self.others,
        )
        self.tracer_provider = OwnProvider(
            self.others, self._update_tracing, resource=self.resource, id_generator=TimeOrderedIds()
        )
        TracerProvider.add_span_processor(self.tracer_provider, make_span_processor(self._pipeline, self.others))
        self.tracer = self.tracer_provider.get_tracer("otel_rl", __version__)
        # step, timer, trajectory and op spans: light spans ending into the pipeline, which materialises
        # them off the training thread (also for the span processors outside otel-rl: _processors)
        self.light = LightTracer(self._pipeline.submit, self.resource, scope, self.others)
        if self.others.active and not cfg.disabled and cfg.tracing is None:
            tracing = True
        self.sampler = Sampler(cfg.run_id, cfg.max_samples)
        self.tokenizer = tokenizer
        # what the decorators read (installed by init(); `tracing` lives there)
        self.runtime = Runtime(self, self._pipeline, tracing)
        self._emit_run_start()

    def _update_record_targets(self) -> None:
        only = self._trace_only & {e.name for e in self.exporters}
        self._record_targets = frozenset(e.name for e in self.exporters if e.name not in only) if only else None

    def _export_process_died(self, client: ExportProcessClient, unsettled: list) -> None:
        """The export process ended unexpectedly: its exporters continue here, in-process, and get
        the batches it had not settled again (at least once)."""
        made: dict[str, Exporter] = {}
        for stub in client.exporters:
            e = registry.create(stub.name, self.config)
            e.wants_trajectories = stub.wants_trajectories
            made[stub.name] = e
        takeover = self._pipeline.adopt(client, list(made.values()))
        for _, shipment in unsettled:  # (seq, protocol.Shipment)
            takeover.put(shipment.records, shipment.names, shipment.wire, shipment.resource_attrs)
        client.fallback = takeover.put
        with self._lock:
            self.exporters = [made.get(e.name, e) if getattr(e, "remote", False) else e for e in self.exporters]

    # -- identity ------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.config.run_id

    def worker_env(self) -> dict[str, str]:
        """Environment for worker processes so they join this run (same run id, own rank)."""
        c = self.config
        env = {
            sc.ENV_RUN_ID: c.run_id,
            "OTEL_RL_PROJECT": c.project,
            "OTEL_RL_EXPERIMENT": c.experiment,
            "OTEL_RL_EXPORTERS": ",".join(c.exporters),
        }
        if c.trace_backend:
            env["OTEL_RL_TRACE_BACKEND"] = c.trace_backend
        if c.max_samples is not None:
            env["OTEL_RL_MAX_SAMPLES"] = str(c.max_samples)
        if c.token2text:
            env["OTEL_RL_TOKEN2TEXT"] = "true"
        return env

    def _emit_run_start(self) -> None:
        text, _ = to_json(scrub_secrets(self.config.verl_config), 1 << 20)
        self.light.start(sc.SPAN_RUN, None, {sc.RL_RUN_CONFIG: text, sc.RL_SPAN_KIND: sc.KIND_METRICS}).end()

    # -- logging ---------------------------------------------------------------------
    def log(
        self,
        data: Mapping[str, object],
        step: SupportsInt | str | bytes | None = None,
        *,
        exporters: Iterable[str] | None = None,
    ) -> None:
        """Record `data` (metric name -> scalar) at training step `step`.

        Never raises for bad values: non-scalars are skipped with one warning per
        key; a step given as a string of digits (``"7"``) is that integer; any other
        step that is not an integer is replaced by the current step (or the last one
        logged) with a warning; a step outside the signed 64-bit range (which no
        tracker stores) rejects the call, with a warning naming it.  An empty `data`
        is recorded too (verl's ``step:N``); a call whose values were all skipped
        records nothing.  `exporters` (names) restricts the record to those
        exporters, as verl's ``Tracking.log(..., backend=...)``.
        """
        if self._closed:
            warn_once("log-after-shutdown", "otel-rl: log() after shutdown; nothing recorded")
            return
        st = STEP.get()
        n = coerce_step(step, st.n if st is not None else self._last_step)
        if n is None:
            return
        self._last_step = n
        try:
            values, skipped = coerce_metrics(data)
        except TypeError as exc:
            warn_once(f"log-type:{type(data).__name__}", "otel-rl: %s; nothing recorded", exc)
            return
        for k in skipped:
            v = data.get(k) if hasattr(data, "get") else None
            warn_once(
                f"skip:{k}",
                "otel-rl: metric %r has a non-scalar value of type %s; skipped "
                "(log numbers, numpy scalars or 0-d tensors)",
                k,
                type(v).__name__,
            )
        if not values and skipped:
            return  # every value was skipped (warned): nothing to record
        # an empty call is recorded: verl prints ``step:N`` and writes ``{"step":N,"data":{}}`` for it
        if exporters is None:
            exporters = self._record_targets
        self._pipeline.submit(
            LogItem(
                n,
                values,
                time.time_ns(),
                st.span_context if st is not None else None,
                None if exporters is None else frozenset(exporters),
            )
        )

    def log_generations(
        self,
        samples: Iterable[Sequence[object]],
        step: SupportsInt | str | bytes | None = None,
        limit: int | None = None,
        *,
        exporters: Iterable[str] | None = None,
    ) -> None:
        """Validation generations: rows of (input, output, score) as verl builds them.

        `exporters` (names) restricts them to those exporters."""
        if self._closed:
            return
        st = STEP.get()
        n = coerce_step(step, st.n if st is not None else self._last_step)
        if n is None:
            return
        self._last_step = n
        if limit is None and self.config.log_val_generations > 0:
            limit = self.config.log_val_generations
        rows = generation_rows(samples, limit)
        if exporters is None:
            exporters = self._record_targets
        if rows:
            self._pipeline.submit(
                GenerationsItem(n, rows, time.time_ns(), None if exporters is None else frozenset(exporters))
            )

    # -- changing a running pipeline ---------------------------------------------------------
    def add_exporter(self, exporter: str | Exporter, *, trace_only: bool = False) -> Exporter:
        """Add an exporter (a registered name or an instance) to this running pipeline.

        A name that is already there returns the existing exporter.  The new one gets
        the run start, then everything recorded from now on.  OpenTelemetry metric
        readers cannot join a running MeterProvider: an added exporter's readers get
        nothing (warned).  Tracing is turned on when it consumes spans or trajectories.
        """
        if self._closed:
            raise RuntimeError("otel-rl: add_exporter() on a pipeline that is shut down")
        with self._lock:
            if isinstance(exporter, str):
                name = "wandb" if exporter == "tracking" else exporter
                if not trace_only:
                    self._trace_only.discard(name)
                for e in self.exporters:
                    if e.name == name:
                        self._update_record_targets()
                        return e
                exporter = registry.create(name, self.config)
            elif not exporter.name:
                exporter.name = type(exporter).__name__
            if exporter.metric_readers():
                warn_once(
                    f"late-readers:{exporter.name}",
                    "otel-rl: exporter %r added to a running pipeline gets "
                    "no OpenTelemetry metrics (give it to init() for those)",
                    exporter.name,
                )
            self.exporters = self.exporters + [exporter]
            if trace_only:
                self._trace_only.add(exporter.name)
            self._update_record_targets()
            self._pipeline.add_exporter(exporter, [self._run_start_record()])
            self._update_tracing()
        return exporter

    def set_trace_settings(
        self, trace_backend: str | None = None, token2text: bool | None = None, max_samples: int | None = None
    ) -> None:
        """Change the rollout-trace settings of a running pipeline (None: unchanged).

        `trace_backend` names the exporter that receives trajectories: it is added when
        missing; a tracker exporter already there starts taking trajectories.
        """
        if trace_backend:
            previous, self.config.trace_backend = self.config.trace_backend, trace_backend
            existing = next((e for e in self.exporters if e.name == trace_backend), None)
            if existing is None:
                try:
                    # created with the new setting: it takes trajectories (only those, as in verl)
                    self.add_exporter(trace_backend, trace_only=True)
                except Exception:
                    self.config.trace_backend = previous
                    raise
            elif getattr(existing, "tracker_name", None) == trace_backend:
                existing.wants_trajectories = True
        if token2text is not None:
            self.config.token2text = bool(token2text)
        if max_samples is not None:
            self.config.max_samples = max_samples
            self.sampler.max_samples = max_samples
        self._update_tracing()

    def _update_tracing(self) -> None:
        cfg = self.config
        if cfg.disabled or cfg.tracing is not None:
            return
        self.tracing = self.others.active or any(e.wants_spans or e.wants_trajectories for e in self.exporters)

    def _run_start_record(self) -> Any:
        import json

        from .records import RunIdentity, RunStart

        c = self.config
        text, _ = to_json(scrub_secrets(c.verl_config), 1 << 20)
        try:
            config = json.loads(text)
        except ValueError:
            config = {}
        return RunStart(RunIdentity(c.project, c.experiment, c.run_id), config, c.rank, time.time_ns())

    def select_samples(self, step: int | None, sample_indices: Iterable[int], validate: bool = False) -> set[int]:
        """Register a step's candidate samples; returns the ones that will be traced."""
        return self.sampler.select(step, sample_indices, validate)

    # -- lifecycle ---------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        p = self._pipeline
        ovf = p._overflow if p else None
        return {
            "pipeline_dropped": p.dropped if p else 0,
            "shed": dict(p.shed) if p else {},  # spans dropped by a full queue, per kind (records never are)
            "records_spilled": ovf.spilled if ovf is not None else 0,  # records beyond queue_size, via disk
            "records_waited": p.waited if p else 0,  # log() calls that waited for room
            "exporters": {q.name: q.stats.as_dict() for q in (p.queues if p else [])},
        }

    def flush(self, timeout_s: float = 30.0) -> bool:
        if self._closed:
            return True
        deadline = time.monotonic() + timeout_s
        ok = self._pipeline.flush(timeout_s)
        self.others.force_flush(int(max(0.1, deadline - time.monotonic()) * 1000))
        for e in self.exporters:
            try:
                e.flush(max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                warn_once(f"flush:{e.name}", "otel-rl: exporter %r flush failed: %s", e.name, exc)
        try:
            self.meter_provider.force_flush(int(max(0.1, deadline - time.monotonic()) * 1000))
        except Exception:
            pass
        return ok

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Deliver what was recorded and end the tracker runs, within `timeout_s` overall (default: the
        ``shutdown_timeout_s`` setting, 10 s): what an exporter has not delivered by then stays in its
        spool (``otel-rl replay``), and an exporter still busy ending its run is left to it.  Traced
        trajectories still open are stored as interrupted (status ERROR).  The tracker runs are marked
        as the process ends (`otel_rl._exit.outcome`: failed, aborted, killed) or as finished."""
        self._shutdown(timeout_s, _exit.outcome())

    def _shutdown(self, timeout_s: float | None, outcome: _exit.Outcome | None) -> None:
        # (bounded: a SIGTERM handler may have interrupted this thread inside add_exporter, lock held)
        locked = self._lock.acquire(timeout=1.0)
        try:
            if self._closed:
                return
            self._closed = True
        finally:
            if locked:
                self._lock.release()
        if timeout_s is None:
            timeout_s = self.config.shutdown_timeout_s
        deadline = time.monotonic() + timeout_s  # one budget for all stages and exporters
        if _runtime.active is self.runtime:
            end_open_trajectories()  # before the pipeline's last batches: their traces go whole
            _runtime.uninstall()
        if self._export_process is not None:
            self._export_process.outcome = outcome
        told = [e for e in self.exporters if not getattr(e, "remote", False)]
        if outcome is not None:
            for e in told:
                _exit.tell_outcome(e, outcome)
        self._pipeline.shutdown(timeout_s)
        # (again: exporters taken back from an export process that died meanwhile are in the list now)
        local = [e for e in self.exporters if not getattr(e, "remote", False)]
        if outcome is not None:
            for e in local:
                if not any(e is x for x in told):
                    _exit.tell_outcome(e, outcome)
        for q in self._pipeline.queues:
            if not getattr(q, "remote", False):
                note_run_end(q, outcome)
        # each exporter flushes and ends its run on its own thread, all within what is left of the budget:
        # a tracker whose server is down or hung costs the budget, not its own timeouts one after another
        threads = [
            threading.Thread(target=end_exporter, args=(e, deadline), name=f"otel-rl-end-{e.name}", daemon=True)
            for e in local
        ]
        for t in threads:
            t.start()
        try:
            self.meter_provider.shutdown(timeout_millis=max(100.0, (deadline - time.monotonic()) * 1000))
        except Exception:
            pass
        for t in threads:
            t.join(max(0.05, deadline - time.monotonic()))
        left = [t.name[len("otel-rl-end-") :] for t in threads if t.is_alive()]
        if left:
            _log.warning(
                "otel-rl: exporter(s) %s still ending their runs after the shutdown budget of %.1f s "
                "(shutdown_timeout_s); left to finish in the background",
                ", ".join(left),
                timeout_s,
            )
        try:
            self.tracer_provider.shutdown()
        except Exception:
            pass

    @property
    def tracing(self) -> bool:
        """Whether spans are made (kept in the handle's runtime, which the decorators read)."""
        return self.runtime.tracing

    @tracing.setter
    def tracing(self, value: bool) -> None:
        self.runtime.tracing = value

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        # an exception leaving the block ends the runs as failed (as MLflow's `with start_run()` does)
        self._shutdown(None, _exit.outcome_of(et, ev, tb) or _exit.outcome())


def __getattr__(name: str) -> Any:
    # (`init`, `current` and the test kit's `joining` were defined here: otel_rl._init holds them now)
    if name in ("init", "current", "joining", "forked_from"):
        from . import _init

        return getattr(_init, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
