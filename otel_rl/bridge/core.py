"""The bridge: OTLP in, the tracker exporters out, through the same pipeline as the in-process path.

    OTLP/HTTP ─┐                                      ┌─► DeliveryQueue(mlflow)  ──► MlflowExporter
    OTLP/gRPC ─┴─► decode ─► RecordBuilder (Pipeline) ─┼─► DeliveryQueue(wandb)   ──► WandbExporter
                 (ReadableSpans)  ▲                   └─► DeliveryQueue(swanlab) ──► SwanlabExporter
                 └─► root spans ──┘ after root_grace_s
               └─► DeliveryQueue(forward) ──► another OTLP endpoint (raw bodies)

Received spans become records in `otel_rl._pipeline.Pipeline` (the `RecordBuilder` and one
`DeliveryQueue` per exporter, retries with backoff), so a tracker gets exactly what it would
get in the trainer's process.  Records carry their run identity (resource attributes
``rl.project.name``, ``rl.experiment.name``, ``rl.run.id``) and the tracker exporters keep one
tracker run per identity, so one bridge serves any number of trainers.  A request's spans are
built on the thread that received and decoded them (`Pipeline.build_now`), while they are still
in that core's cache: handing them to the pipeline's worker thread cost more than building them.

Spans may arrive out of order behind a Collector (its batches are sent by several consumers):
the `RecordBuilder` closes a trajectory when its root span arrives, so a child arriving after
its root would be left out.  Root spans are therefore held for ``root_grace_s`` (1 s) before they
go into the builder; children that arrive within that time are part of the trajectory.

A request is acknowledged once its spans are records in the exporters' memory queues (its root
spans: held in memory).  When an exporter falls behind (its queue reaches `BUSY_FRACTION` of
``queue_size``) requests are refused with a retryable status (HTTP 503 / gRPC UNAVAILABLE) so the
senders keep their data and retry, instead of the bridge dropping it.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from .. import semconv as sc
from .._delivery import DeliveryQueue
from .._pipeline import Pipeline
from .._values import warn_once
from ..exporters.base import Exporter
from ..records import RecordBuilder, RunIdentity
from . import decode as _decode
from ._inflate import Budget
from .sinks import Delivered, ForwardExporter, Raw, SizedBatch, create_exporters

_log = logging.getLogger("otel_rl.bridge")

MIB = 1 << 20
BUSY_FRACTION = 0.8
SIGNALS = ("traces", "metrics")

# the bridge's own metric names (OpenTelemetry names; Prometheus shows them with `_` and `_total`)
M_REQUESTS = "otel_rl.bridge.requests"
M_SPANS = "otel_rl.bridge.spans"
M_METRIC_POINTS = "otel_rl.bridge.metric_points"
M_BYTES = "otel_rl.bridge.received_bytes"
M_RUNS = "otel_rl.bridge.runs"
# seconds beyond the root grace a trace may wait for its root before the record builder's bound applies
PENDING_MARGIN_S = 10.0
M_BACKLOG = "otel_rl.bridge.pipeline.backlog"
M_PIPELINE_DROPPED = "otel_rl.bridge.pipeline.dropped"
M_LATENCY = "otel_rl.bridge.delivery.latency"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclasses.dataclass
class Settings:
    """Everything `otel-rl bridge` can be told (flags in `otel_rl.bridge.cli`)."""

    http_address: tuple[str, int] | None = ("127.0.0.1", 4318)
    grpc_address: tuple[str, int] | None = ("127.0.0.1", 4317)
    exporters: tuple[str, ...] = ("console",)
    trace_backend: str | None = None
    forward_endpoint: str | None = None
    forward_headers: dict[str, str] = dataclasses.field(default_factory=dict)
    forward_queue_mib: int = 256
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int | None = None
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_body_bytes: int = 20 * MIB
    max_decompressed_bytes: int = 64 * MIB
    max_decompression_ratio: float = 200.0
    decompression_budget_bytes: int = 256 * MIB
    max_connections: int = 256
    idle_timeout_s: float = 30.0
    request_timeout_s: float = 30.0
    queue_size: int = 100_000
    batch_delay_s: float = 0.2
    grpc_workers: int = 4
    shutdown_timeout_s: float = 60.0
    root_grace_s: float = 1.0


class Busy(Exception):
    """Refused for now (exporters behind, or shutting down); the sender should retry."""


@dataclasses.dataclass
class IngestResult:
    accepted: int = 0
    rejected: int = 0
    error_message: str = ""


# ----------------------------------------------------------------------------- exporters


class Counters:
    """The bridge's own counts: the single source for /readyz, the final summary and the metrics."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str, str, str], int] = {}  # (transport, signal, outcome, reason)
        self.spans: dict[tuple[str, str, str], int] = {}  # (transport, outcome, reason of a rejection)
        self.points: dict[str, int] = {}  # transport -> metric data points received
        self.bytes: dict[tuple[str, str], int] = {}  # (transport, signal) -> request bytes as received
        self.runs: set[RunIdentity] = set()

    def request(self, transport: str, signal: str, outcome: str, reason: str = "") -> None:
        key = (transport, signal, outcome, reason)
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + 1

    def add(self, table: dict, key: Any, n: int) -> None:
        if n:
            with self.lock:
                table[key] = table.get(key, 0) + n

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            req: dict[str, int] = {}
            rejected: dict[str, int] = {}
            for (t, s, o, r), n in self.requests.items():
                req[f"{t}/{s}/{o}"] = req.get(f"{t}/{s}/{o}", 0) + n
                if o == "rejected":
                    rejected[r] = rejected.get(r, 0) + n
            return {
                "requests": req,
                "rejected_by_reason": rejected,
                "spans_accepted": sum(n for (t, o, r), n in self.spans.items() if o == "accepted"),
                "spans_rejected": sum(n for (t, o, r), n in self.spans.items() if o == "rejected"),
                "spans_rejected_by_reason": _by_reason(self.spans),
                "metric_points": sum(self.points.values()),
                "bytes": sum(self.bytes.values()),
                "runs": len(self.runs),
            }


def _by_reason(spans: dict[tuple[str, str, str], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_, outcome, reason), n in spans.items():
        if outcome == "rejected":
            out[reason] = out.get(reason, 0) + n
    return out


# ----------------------------------------------------------------------------- forwarding


class RootHold:
    """Holds the spans that begin trajectories for `grace_s` before submitting them, in arrival order."""

    def __init__(self, submit: Any, grace_s: float):
        self._submit = submit  # takes a list of spans, in order
        self.grace_s = grace_s
        self._held: deque[tuple[float, Sequence[Any]]] = deque()  # (due, the roots of one request)
        self._count = 0  # spans held
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="otel-rl-bridge-roots", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return self._count

    def add(self, spans: Sequence[Any], roots: Sequence[Any]) -> None:
        """Submit `spans` now, and `roots` (the spans that begin trajectories) after the grace period."""
        if spans:
            self._submit(spans)
        if roots:
            due = time.monotonic() + self.grace_s
            with self._cond:
                if self._stop:
                    self._submit(roots)
                    return
                self._held.append((due, roots))
                self._count += len(roots)
                if len(self._held) == 1:  # (otherwise the thread is waiting for an earlier one)
                    self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (not self._held or self._held[0][0] > time.monotonic()):
                    self._cond.wait(self._held[0][0] - time.monotonic() if self._held else None)
                if self._stop and not self._held:
                    return
                now = time.monotonic()
                batch: list[Any] = []
                while self._held and (self._stop or self._held[0][0] <= now):
                    batch.extend(self._held.popleft()[1])
                self._count -= len(batch)
            self._submit(batch)

    def release_all(self, timeout_s: float = 10.0) -> None:
        """Shutting down: submit what is held now (the receivers are closed by then)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)


# ----------------------------------------------------------------------------- the bridge


def _in_memory(q: DeliveryQueue) -> int:
    """Items a queue holds in memory: with a durable spool (otel_rl.spool) what spilled to disk does
    not count against the bridge's memory; without one, everything queued does."""
    if getattr(q, "spool", None) is not None:
        return int(getattr(q.stats, "in_memory", q.stats.queued))
    return q.stats.queued


class Bridge:
    """Receives OTLP on HTTP and gRPC and delivers it to exporters.  `start()`, then `stop()`."""

    def __init__(self, settings: Settings, exporters: Sequence[Exporter] | None = None, config: Any = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from .. import __version__
        from ..config import resolve

        self.settings = settings
        self.config = (
            config
            if config is not None
            else resolve(
                exporters=[],
                trace_backend=settings.trace_backend,
                queue_size=settings.queue_size,
                batch_delay_s=settings.batch_delay_s,
            )
        )
        self.counters = Counters()
        self._meter_provider: Any = None
        self._prometheus: Any = None
        inner = list(exporters) if exporters is not None else create_exporters(settings.exporters, self.config)
        latency = self._start_metrics()
        self.exporters = [e if isinstance(e, Delivered) else Delivered(e, latency) for e in inner]
        # the children of a trajectory wait for its root, which waits `root_grace_s` here: at a high span rate
        # many traces are pending at once, and none may be cut into a partial trajectory for that
        builder = RecordBuilder(min_age_s=settings.root_grace_s + PENDING_MARGIN_S, node=_decode.node_maker)
        self.pipeline = Pipeline(
            self.config,
            Resource({}),
            self.exporters,
            None,
            InstrumentationScope("otel_rl.bridge", __version__),
            builder=builder,
        )
        self.roots = RootHold(self.pipeline.build_now, settings.root_grace_s) if settings.root_grace_s > 0 else None
        self.forward: DeliveryQueue | None = None
        if settings.forward_endpoint:
            fwd = ForwardExporter(settings.forward_endpoint, settings.forward_headers)
            self.forward = DeliveryQueue(fwd, max(1, settings.forward_queue_mib) << 10)
        self._token = settings.auth_token.encode() if settings.auth_token else None
        self.inflate_budget = Budget(max(settings.decompression_budget_bytes, settings.max_decompressed_bytes))
        self._busy_at = max(1, int(self.config.queue_size * BUSY_FRACTION))
        self._state_lock = threading.Condition()
        self._inflight = 0
        self._draining = False
        self._started = False
        self.http: Any = None
        self.grpc: Any = None
        self._stopped: dict[str, Any] | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Bridge:
        from ._grpc import GrpcReceiver
        from ._http import HttpReceiver

        s = self.settings
        try:
            if s.http_address is not None:
                self.http = HttpReceiver(self, s.http_address)
            if s.grpc_address is not None:
                self.grpc = GrpcReceiver(self, s.grpc_address)
        except Exception:
            self._close_receivers(1.0)
            raise
        if self.http is not None:
            self.http.start()
        self._started = True
        return self

    @property
    def prometheus_port(self) -> int | None:
        return self._prometheus.port if self._prometheus is not None else None

    def addresses(self) -> dict[str, Any]:
        return {
            "http": f"{self.http.host}:{self.http.port}" if self.http else None,
            "grpc": f"{self.grpc.host}:{self.grpc.port}" if self.grpc else None,
            "prometheus": f"{self.settings.prometheus_host}:{self.prometheus_port}" if self._prometheus else None,
            "tls": bool(self.settings.tls_cert),
            "auth": self._token is not None,
            "exporters": [e.name for e in self.exporters],
            "forward": self.settings.forward_endpoint,
        }

    def _close_receivers(self, grace_s: float) -> None:
        if self.grpc is not None:
            self.grpc.stop(grace_s)
        if self.http is not None:
            self.http.stop()

    def stop(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop accepting, deliver what was accepted (within `timeout_s`), close the tracker runs."""
        if self._stopped is not None:
            return self._stopped
        timeout_s = self.settings.shutdown_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._state_lock:
            self._draining = True
        self._close_receivers(min(5.0, timeout_s / 4))
        with self._state_lock:  # requests already past the door finish (they were acknowledged or will be)
            while self._inflight and time.monotonic() < deadline:
                self._state_lock.wait(0.05)
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        if self.roots is not None:
            self.roots.release_all(left())
        self.pipeline.shutdown(left())
        for e in self.exporters:
            try:
                e.flush(left())
            except Exception as exc:
                _log.warning("otel-rl bridge: exporter %r flush failed: %s", e.name, exc)
        for e in self.exporters:
            try:
                e.shutdown()
            except Exception as exc:
                _log.warning("otel-rl bridge: exporter %r shutdown failed: %s", e.name, exc)
        if self.forward is not None:
            self.forward.stop(left())
            self.forward.exporter.shutdown()
        summary = self.stats()
        if self._meter_provider is not None:
            try:
                self._meter_provider.shutdown(timeout_millis=1000)
            except Exception:
                pass
        if self._prometheus is not None:
            self._prometheus.shutdown()
        self._stopped = summary
        return summary

    # -- state --------------------------------------------------------------------------------
    def queues(self) -> list[DeliveryQueue]:
        qs = list(self.pipeline.queues)
        if self.forward is not None:
            qs.append(self.forward)
        return qs

    def backlog(self) -> int:
        """Spans waiting for the pipeline worker, plus the longest exporter queue."""
        waiting = len(getattr(self.pipeline, "_items", ())) + (len(self.roots) if self.roots is not None else 0)
        return waiting + max((_in_memory(q) for q in self.pipeline.queues), default=0)

    def ready(self) -> tuple[bool, str]:
        if not self._started:
            return False, "starting"
        if self._draining:
            return False, "shutting down"
        if self.backlog() >= self._busy_at:
            return False, "exporters are behind"
        return True, "ready"

    def stats(self) -> dict[str, Any]:
        out = self.counters.snapshot()
        out["pipeline_dropped"] = self.pipeline.dropped
        out["decompression_peak_bytes"] = self.inflate_budget.peak
        out["exporters"] = {q.name: q.stats.as_dict() for q in self.queues()}
        return out

    def authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        if not header:
            return False
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.strip().encode("utf-8", "surrogateescape"), self._token)

    def enter(self) -> bool:
        """A request starts; False when shutting down (it must be refused)."""
        with self._state_lock:
            if self._draining:
                return False
            self._inflight += 1
            return True

    def leave(self) -> None:
        with self._state_lock:
            self._inflight -= 1
            if not self._inflight:
                self._state_lock.notify_all()

    # -- ingest -------------------------------------------------------------------------------
    def ingest(
        self, signal: str, body: bytes, *, json_body: bool, transport: str, raw: Raw | None = None
    ) -> IngestResult:
        """Decode one request body and hand it over.  Raises `DecodeError` (400) or `Busy` (503)."""
        if signal == "traces":
            if self.backlog() >= self._busy_at:
                warn_once(
                    "bridge-busy",
                    "otel-rl bridge: exporters are behind (backlog >= %d items); refusing "
                    "requests with a retryable status until they catch up",
                    self._busy_at,
                )
                raise Busy("exporters are behind; retry later")
            roots = self.roots
            decoded = _decode.decode_traces(body, json_body, roots=roots is not None)
            self._note_runs(decoded.resources, transport)
            if roots is not None:
                roots.add(decoded.spans, decoded.roots)
            else:
                self.pipeline.build_now(decoded.spans)
            accepted = len(decoded.spans) + len(decoded.roots)
            self.counters.add(self.counters.spans, (transport, "accepted", ""), accepted)
            for reason, n in decoded.reasons.items():
                self.counters.add(self.counters.spans, (transport, "rejected", reason), n)
                warn_once(
                    f"bridge-rejected-spans:{reason}",
                    "otel-rl bridge: rejected span(s): %s; the rest of "
                    "their request was accepted (further ones are counted, not logged)",
                    reason,
                )
            result = IngestResult(accepted, decoded.rejected, decoded.error_message() if decoded.rejected else "")
        else:
            summary = _decode.decode_metrics(body, json_body)
            self.counters.add(self.counters.points, transport, summary.points)
            for project, experiment, run_id in summary.runs:
                self._note_run(RunIdentity(project, experiment, run_id), transport, "metrics")
            _log.debug(
                "otel-rl bridge: %d metric points (%d metrics) from %d resources via %s",
                summary.points,
                summary.metrics,
                summary.resources,
                transport,
            )
            result = IngestResult(summary.points, 0, "")
        if self.forward is not None and raw is not None:
            self.forward.put([], SizedBatch([raw]))
        return result

    def _note_runs(self, resources: Sequence[Any], transport: str) -> None:
        for res in resources:
            self._note_run(RunIdentity.from_attributes(res.attributes), transport, "spans")

    def _note_run(self, ident: RunIdentity, transport: str, what: str) -> None:
        if ident in self.counters.runs:
            return
        with self.counters.lock:
            if ident in self.counters.runs or len(self.counters.runs) >= 100_000:
                return
            self.counters.runs.add(ident)
        _log.info(
            "otel-rl bridge: %s of run %r (project %r, experiment %r) via %s",
            what,
            ident.run_id,
            ident.project,
            ident.experiment,
            transport,
        )

    # -- the bridge's own metrics ---------------------------------------------------------------
    def _start_metrics(self) -> Any:
        s = self.settings
        if s.prometheus_port is None:
            return None
        from types import SimpleNamespace

        from opentelemetry.metrics import CallbackOptions, Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource

        from .. import __version__
        from ..exporters.prometheus import PrometheusExporter

        self._prometheus = PrometheusExporter(
            SimpleNamespace(prometheus_host=s.prometheus_host, prometheus_port=s.prometheus_port)
        )
        self._meter_provider = MeterProvider(
            resource=Resource({sc.SERVICE_NAME: "otel-rl-bridge"}),
            metric_readers=self._prometheus.metric_readers(),
            views=[View(instrument_name=M_LATENCY, aggregation=ExplicitBucketHistogramAggregation(LATENCY_BUCKETS))],
        )
        meter = self._meter_provider.get_meter("otel_rl.bridge", __version__)
        c = self.counters

        def obs(table_name: str, labels: Any) -> Any:
            def cb(options: CallbackOptions) -> list[Observation]:
                with c.lock:
                    items = list(getattr(c, table_name).items())
                return [Observation(n, labels(k)) for k, n in items]

            return cb

        meter.create_observable_counter(
            M_REQUESTS,
            [obs("requests", lambda k: {"transport": k[0], "signal": k[1], "outcome": k[2], "reason": k[3]})],
            unit="{request}",
            description="OTLP requests, by outcome (accepted/rejected) and rejection reason",
        )
        meter.create_observable_counter(
            M_SPANS,
            [obs("spans", lambda k: {"transport": k[0], "outcome": k[1], "reason": k[2]})],
            unit="{span}",
            description="Spans received: accepted into the pipeline, or rejected (invalid ids, wrong rl.* types)",
        )
        meter.create_observable_counter(
            M_METRIC_POINTS,
            [obs("points", lambda k: {"transport": k})],
            unit="{point}",
            description="Metric data points received (counted, forwarded)",
        )
        meter.create_observable_counter(
            M_BYTES,
            [obs("bytes", lambda k: {"transport": k[0], "signal": k[1]})],
            unit="By",
            description="Request body bytes read (as sent, before decompression)",
        )
        meter.create_observable_gauge(
            M_RUNS, [lambda o: [Observation(len(c.runs))]], unit="{run}", description="Distinct run identities seen"
        )
        meter.create_observable_gauge(
            M_BACKLOG,
            [lambda o: [Observation(self.backlog())]],
            unit="{item}",
            description="Spans waiting for the pipeline plus the longest exporter queue",
        )
        meter.create_observable_counter(
            M_PIPELINE_DROPPED,
            [lambda o: [Observation(self.pipeline.dropped)]],
            unit="{span}",
            description="Spans dropped because the pipeline queue was full",
        )

        def items(options: CallbackOptions) -> list[Observation]:
            out = []
            for q in self.queues():
                for outcome, value in (
                    ("exported", q.stats.exported),
                    ("failed", q.stats.failed_attempts),
                    ("dropped", q.stats.dropped),
                    ("retried", q.stats.retried),
                ):
                    out.append(Observation(value, {sc.EXPORTER: q.name, sc.OUTCOME: outcome}))
            return out

        meter.create_observable_counter(
            sc.METRIC_EXPORT_ITEMS,
            [items],
            unit="{item}",
            description="Items handled by each exporter, by outcome (forward: KiB)",
        )
        meter.create_observable_gauge(
            sc.METRIC_EXPORT_QUEUED,
            [lambda o: [Observation(q.stats.queued, {sc.EXPORTER: q.name}) for q in self.queues()]],
            unit="{item}",
            description="Items waiting in each exporter's queue (forward: KiB)",
        )
        return meter.create_histogram(
            M_LATENCY,
            unit="s",
            description="Per delivered batch: time from the end of "
            "its oldest span (in the trainer) to the exporter having written it",
        )


def summary_line(event: str, **fields: Any) -> str:
    return json.dumps({"event": event, **fields}, sort_keys=False, default=str)


def env_flag(name: str) -> bool:
    return (os.environ.get(name) or "").strip().lower() in ("1", "true", "yes", "on")
