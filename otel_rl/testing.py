"""Test kit: capture what an instrumented trainer emits, in memory, and query it.

As a pytest plugin (installed with otel-rl) it offers the fixture
``otel_rl_capture``::

    def test_my_trainer(otel_rl_capture):
        train(steps=3)                      # your code, instrumented with otel_rl
        cap = otel_rl_capture.collect()     # flushes the pipeline
        assert cap.metrics_by_step()[2]["actor/pg_loss"] < 1.0
        t = cap.trajectories(step=1, sample_index=0)[0]
        assert [n.name for n in t.root.children] == ["MyAgent.generate"]

The fixture also captures from an ``otel_rl.init()`` made by the code under test (a trainer
that starts its own pipeline, as the README teaches): while the fixture is active, every
pipeline started joins it (`CaptureExporter.joining`), next to the exporters that code asks for.

Without pytest: ``cap = CaptureExporter(); otel_rl.init(exporters=[cap])``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader
from opentelemetry.sdk.trace import ReadableSpan

from .exporters.base import Exporter
from .records import Generations, Record, RunStart, SpanNode, StepMetrics, Trajectory, merge_step_metrics

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import DataPointT

    from ._handle import Handle

R = TypeVar("R", RunStart, StepMetrics, Generations, Trajectory)


class CaptureExporter(Exporter):
    """Keeps every record and span; a metric reader for the OTel instruments."""

    wants_spans = True
    wants_trajectories = True

    def __init__(self, config: object = None):
        self._lock = threading.Lock()
        self.records: list[Record] = []
        self.spans: list[ReadableSpan] = []
        self.metric_reader = InMemoryMetricReader()
        self.handle: Handle | None = None
        self._readers = [self.metric_reader]

    def joining(self) -> CaptureExporter:
        """A new exporter that adds to this capture's records and spans, for another pipeline (a metric
        reader serves one meter provider: it has its own, which `metric_points` reads too)."""
        other = CaptureExporter()
        other._lock, other.records, other.spans = self._lock, self.records, self.spans
        other.name = self.name or "memory"
        self._readers.append(other.metric_reader)
        return other

    # exporter side
    def export_records(self, records: Sequence[Record]) -> None:
        with self._lock:
            self.records.extend(records)

    def export_spans(self, spans: Sequence[ReadableSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)

    def metric_readers(self) -> list[MetricReader]:
        return [self.metric_reader]

    # query side
    def collect(self, timeout_s: float = 30.0) -> CaptureExporter:
        """Flush the pipeline this exporter belongs to, then return self."""
        from . import _runtime

        h = self.handle or _runtime.active.handle
        if h is not None and h.closed and _runtime.active.handle is not None:
            h = _runtime.active.handle
        if h is not None and not h.closed:
            h.flush(timeout_s)
        return self

    def of_type(self, cls: type[R]) -> list[R]:
        with self._lock:
            return [r for r in self.records if isinstance(r, cls)]

    def step_metrics(self) -> list[StepMetrics]:
        return self.of_type(StepMetrics)

    def metrics_by_step(self) -> dict[int, dict[str, float | int | bool]]:
        """{step: {key: value}}, all log() calls of a step merged (later wins)."""
        return {m.step: m.values for m in merge_step_metrics(self.step_metrics())}

    def metric_series(self, key: str) -> list[tuple[int, float | int | bool]]:
        return [(m.step, m.values[key]) for m in self.step_metrics() if key in m.values]

    def run_starts(self) -> list[RunStart]:
        return self.of_type(RunStart)

    def generations(self) -> list[Generations]:
        return self.of_type(Generations)

    def trajectories(
        self, step: int | None = None, sample_index: int | None = None, validate: bool | None = None
    ) -> list[Trajectory]:
        out = [t for t in self.of_type(Trajectory) if t.root.kind != "CHAIN" or t.sample_index is not None]
        if step is not None:
            out = [t for t in out if t.step == step]
        if sample_index is not None:
            out = [t for t in out if t.sample_index == sample_index]
        if validate is not None:
            out = [t for t in out if t.validate == validate]
        return out

    def spans_named(self, name: str) -> list[ReadableSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def span_tree(self, trace_id: int) -> SpanNode | None:
        for t in self.of_type(Trajectory):
            if t.trace_id == trace_id:
                return t.root
        return None

    def metric_points(self, name: str) -> list[DataPointT]:
        """Data points of one OTel instrument (e.g. ``rl.train.actor/pg_loss``)."""
        out: list[DataPointT] = []
        for reader in self._readers:
            try:
                data = reader.get_metrics_data()
            except Exception:  # the reader of a pipeline that is shut down
                data = None
            if data is None:
                continue
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name == name:
                            out.extend(m.data.data_points)
        return out

    def clear(self) -> None:
        with self._lock:
            self.records.clear()
            self.spans.clear()


# ----------------------------------------------------------------------------- pytest plugin

try:
    import pytest
except ImportError:  # pragma: no cover - the kit works without pytest
    pytest = None  # type: ignore

if pytest is not None:

    @pytest.fixture
    def otel_rl_capture() -> Iterator[CaptureExporter]:
        """A running otel-rl pipeline capturing everything in memory (shut down afterwards).

        An ``otel_rl.init()`` made by the code under test starts a pipeline that this capture joins."""
        from . import _init

        cap = CaptureExporter()
        handle = _init.init(exporters=[cap], tracing=True, batch_delay_s=0.05)
        handle.replaced_quietly = True
        cap.handle = handle
        _init.joining.append(cap)
        try:
            yield cap
        finally:
            _init.joining.remove(cap)
            handle.shutdown()
            if cap.handle is not None and cap.handle is not handle:
                cap.handle.shutdown()  # a pipeline the code under test left running
