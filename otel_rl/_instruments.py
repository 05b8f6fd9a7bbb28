"""OpenTelemetry metric instruments, updated in the pipeline worker (never on the caller's thread).

- every `log()` key becomes a gauge ``rl.train.<key>`` (last value; no step
  attribute, which would explode cardinality), attributes = run identity;
- trajectories: a duration histogram and a counter (sampled or not);
- LLM spans: GenAI token usage and operation duration histograms;
- tool spans: call and error counters;
- exporters' own health: items exported/failed/dropped/retried/spooled, queued, spool bytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from . import semconv as sc
from .records import Record, StepMetrics, Trajectory

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)

_BAD = re.compile(r"[^A-Za-z0-9_./\-]")


def instrument_name(key: str) -> str:
    """The gauge name of a `log()` key: ``rl.train.`` + key with invalid characters as ``_``."""
    name = sc.METRIC_PREFIX + _BAD.sub("_", key)
    return name[:255]


def views() -> list[View]:
    return [
        View(
            instrument_name=sc.METRIC_TRAJECTORY_DURATION,
            aggregation=ExplicitBucketHistogramAggregation(SECONDS_BUCKETS),
        ),
        View(
            instrument_name=sc.METRIC_GEN_AI_OPERATION_DURATION,
            aggregation=ExplicitBucketHistogramAggregation(SECONDS_BUCKETS),
        ),
        View(
            instrument_name=sc.METRIC_GEN_AI_TOKEN_USAGE, aggregation=ExplicitBucketHistogramAggregation(TOKEN_BUCKETS)
        ),
    ]


class Instruments:
    @classmethod
    def on(cls, meters: Sequence[Any], identity: dict[str, Any], queues_getter: Any) -> Any:
        """Instruments made on each of `meters` (otel-rl's own provider's, a global one's), updated
        together; None without a meter (nobody reads them: nothing to pay for)."""
        made = [cls(m, identity, queues_getter) for m in meters]
        if len(made) <= 1:
            return made[0] if made else None
        return _Together(made)

    def __init__(self, meter: Any, identity: dict[str, Any], queues_getter: Any):
        self.meter = meter
        self.identity = identity
        self._gauges: dict[str, Any] = {}
        self._traj_duration = meter.create_histogram(
            sc.METRIC_TRAJECTORY_DURATION, unit="s", description="Wall time of one trajectory (rollout)"
        )
        self._traj_count = meter.create_counter(
            sc.METRIC_TRAJECTORIES, unit="{trajectory}", description="Trajectories finished"
        )
        self._tool_calls = meter.create_counter(sc.METRIC_TOOL_CALLS, unit="{call}", description="Tool calls (traced)")
        self._tool_errors = meter.create_counter(
            sc.METRIC_TOOL_ERRORS, unit="{call}", description="Tool calls that raised (traced)"
        )
        self._tokens = meter.create_histogram(
            sc.METRIC_GEN_AI_TOKEN_USAGE, unit="{token}", description="Tokens per generation (traced)"
        )
        self._gen_duration = meter.create_histogram(
            sc.METRIC_GEN_AI_OPERATION_DURATION, unit="s", description="Generation wall time (traced)"
        )
        self._queues_getter = queues_getter
        self.pipeline: Any = None  # set by the Pipeline these instruments belong to
        meter.create_observable_counter(
            sc.METRIC_EXPORT_ITEMS,
            callbacks=[self._observe_items],
            unit="{item}",
            description="Items handled by each exporter, by outcome",
        )
        meter.create_observable_gauge(
            sc.METRIC_EXPORT_QUEUED,
            callbacks=[self._observe_queued],
            unit="{item}",
            description="Items waiting in each exporter's queue",
        )
        meter.create_observable_gauge(
            sc.METRIC_EXPORT_SPOOL_BYTES,
            callbacks=[self._observe_spool_bytes],
            unit="By",
            description="Bytes of each exporter's on-disk spool",
        )

    def _observe_items(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for q in self._queues_getter():
            for outcome, value in (
                ("exported", q.stats.exported),
                ("failed", q.stats.failed_attempts),
                ("dropped", q.stats.dropped),
                ("retried", q.stats.retried),
                ("spooled", q.stats.spooled),
                ("rejected", q.stats.rejected),
                ("shed", q.stats.shed),
            ):
                out.append(Observation(value, {sc.EXPORTER: q.name, sc.OUTCOME: outcome, **self.identity}))
        p = self.pipeline
        if p is not None:  # the pipeline's queue, before the exporters': spans shed per kind, records spilled
            for kind, value in list(p.shed.items()):
                out.append(
                    Observation(
                        value, {sc.EXPORTER: sc.PIPELINE, sc.OUTCOME: "shed", sc.RL_SPAN_KIND: kind, **self.identity}
                    )
                )
            ovf = p._overflow
            out.append(
                Observation(
                    ovf.spilled if ovf is not None else 0,
                    {sc.EXPORTER: sc.PIPELINE, sc.OUTCOME: "spilled", **self.identity},
                )
            )
        return out

    def _observe_queued(self, options: CallbackOptions) -> list[Observation]:
        return [Observation(q.stats.queued, {sc.EXPORTER: q.name, **self.identity}) for q in self._queues_getter()]

    def _observe_spool_bytes(self, options: CallbackOptions) -> list[Observation]:
        return [
            Observation(q.stats.spool_bytes, {sc.EXPORTER: q.name, **self.identity})
            for q in self._queues_getter()
            if getattr(q, "spool", None) is not None
        ]

    def _gauge(self, key: str) -> Any:
        g = self._gauges.get(key)
        if g is None:
            g = self._gauges[key] = self.meter.create_gauge(instrument_name(key), description=f"log() key {key}")
        return g

    def update(self, records: Sequence[Record], spans: Sequence[Any], stats: Sequence[Any]) -> None:
        ident = self.identity
        for r in records:
            if isinstance(r, StepMetrics):
                for k, v in r.values.items():
                    try:
                        f = float(v)
                    except OverflowError:  # an int beyond the double range: not finite either
                        continue
                    if f - f == 0.0:  # finite; the record keeps NaN/Inf, a gauge cannot
                        self._gauge(k).set(f, ident)
            elif isinstance(r, Trajectory) and r.complete and r.root.kind == sc.KIND_AGENT:
                attrs = {sc.RL_VALIDATE: r.validate, sc.OUTCOME: "error" if r.status == "ERROR" else "ok", **ident}
                self._traj_duration.record(max(0.0, (r.root.end_ns - r.root.start_ns) / 1e9), attrs)
                self._traj_count.add(1, attrs)
        for s in stats:
            attrs = {sc.RL_VALIDATE: s.validate, sc.OUTCOME: "error" if s.error else "ok", **ident}
            self._traj_duration.record(max(0.0, s.duration_s), attrs)
            self._traj_count.add(1, attrs)
        for span in spans:
            a = span.attributes or {}
            kind = a.get(sc.RL_SPAN_KIND)
            if kind == sc.KIND_LLM:
                base = {sc.GEN_AI_OPERATION_NAME: a.get(sc.GEN_AI_OPERATION_NAME, sc.GEN_AI_OP_CHAT), **ident}
                model = a.get(sc.GEN_AI_REQUEST_MODEL)
                if model:
                    base[sc.GEN_AI_REQUEST_MODEL] = model
                if span.end_time and span.start_time:
                    self._gen_duration.record((span.end_time - span.start_time) / 1e9, base)
                for key, ttype in ((sc.GEN_AI_USAGE_INPUT_TOKENS, "input"), (sc.GEN_AI_USAGE_OUTPUT_TOKENS, "output")):
                    if key in a:
                        self._tokens.record(int(a[key]), {**base, sc.GEN_AI_TOKEN_TYPE: ttype})
            elif kind == sc.KIND_TOOL:
                tool_name = a.get(sc.GEN_AI_TOOL_NAME)
                if not tool_name:  # a failed op of an unsampled trajectory is re-emitted with its kind only
                    prefix = sc.GEN_AI_OP_EXECUTE_TOOL + " "
                    tool_name = span.name[len(prefix) :] if (span.name or "").startswith(prefix) else ""
                attrs = {sc.GEN_AI_TOOL_NAME: tool_name, **ident}
                self._tool_calls.add(1, attrs)
                if span.status.status_code.name == "ERROR":
                    self._tool_errors.add(1, attrs)


class _Together:
    """Instruments on several meter providers, updated from one batch."""

    def __init__(self, parts: list[Instruments]) -> None:
        self.parts = parts

    def update(self, records: Sequence[Record], spans: Sequence[Any], stats: Sequence[Any]) -> None:
        for p in self.parts:
            p.update(records, spans, stats)
