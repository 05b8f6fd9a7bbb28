"""The bridge's own exporters: `Delivered` wraps each tracker exporter (sanitised records, delivery
latency, the last records it delivered), `DiscardExporter` drops everything (load tests), and
`ForwardExporter` sends the received OTLP bodies on as they came (`Raw`) to another endpoint.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from .. import semconv as sc
from .._values import warn_once
from ..exporters.base import Exporter
from ..records import Generations, RunStart, StepMetrics, Trajectory


class DiscardExporter(Exporter):
    """``discard``: builds every record (trajectories too) and drops it; for benchmarks and tests."""

    wants_records = True
    wants_trajectories = True

    def __init__(self, config: Any = None):
        self.records = 0
        self.by_type: dict[str, int] = {}

    def export_records(self, records: Sequence[Any]) -> None:
        self.records += len(records)
        for r in records:
            t = type(r).__name__
            self.by_type[t] = self.by_type.get(t, 0) + 1


class Delivered(Exporter):
    """Wraps a tracker exporter: measures delivery latency; drops a sender-chosen wandb proxy.

    A tracker's API key belongs to the bridge's environment only.  The wandb exporter follows
    verl's ``trainer.wandb_proxy`` from the run's config; for a bridge that config comes from
    whoever sends spans, so a received proxy is dropped (set the bridge's ``HTTPS_PROXY``).
    """

    def __init__(self, inner: Exporter, latency: Any = None, keep: int = 100_000):
        self.inner = inner
        self.name = inner.name
        self.wants_records = inner.wants_records
        self.wants_spans = inner.wants_spans
        self.wants_trajectories = inner.wants_trajectories
        self._latency = latency
        self._labels = {sc.EXPORTER: self.name}
        self.latencies: deque[float] = deque(maxlen=keep)  # seconds from span end to delivered, newest last
        self._strip = getattr(inner, "tracker_name", inner.name) in ("wandb", "tracking")
        self._last_in: Any = None
        self._last_out: Any = None

    def __getattr__(self, item: str) -> Any:  # e.g. `.runs` of a tracker exporter
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(item)
        return getattr(inner, item)

    def _sanitized(self, records: Sequence[Any]) -> Sequence[Any]:
        if records is self._last_in:  # a retried batch keeps its identity (the tracker base relies on it)
            return self._last_out
        out: Any = records
        for i, r in enumerate(records):
            trainer = r.config.get("trainer") if isinstance(r, RunStart) and isinstance(r.config, dict) else None
            if isinstance(trainer, dict) and trainer.get("wandb_proxy"):
                if out is records:
                    out = list(records)
                warn_once(
                    f"bridge-proxy:{r.run.run_id}",
                    "otel-rl bridge: run %s names a wandb proxy in its config; "
                    "the bridge ignores it (its own HTTPS_PROXY applies)",
                    r.run.run_id,
                )
                out[i] = dataclasses.replace(r, config=dict(r.config, trainer=dict(trainer, wandb_proxy=None)))
        self._last_in, self._last_out = records, out
        return out

    def export_records(self, records: Sequence[Any]) -> None:
        self.inner.export_records(self._sanitized(records) if self._strip else records)
        now = time.time_ns()
        worst = -1.0
        keep = self.latencies.append
        for r in records:
            if isinstance(r, (StepMetrics, Generations)):
                t = r.time_ns
            elif isinstance(r, Trajectory):
                t = r.root.end_ns
            else:
                continue
            if t:
                lat = max(0.0, (now - t) / 1e9)
                keep(lat)
                if lat > worst:
                    worst = lat
        if worst >= 0 and self._latency is not None:  # one observation per batch (a record() costs ~10 us)
            self._latency.record(worst, self._labels)

    def export_spans(self, spans: Sequence[Any]) -> None:
        self.inner.export_spans(spans)

    def flush(self, timeout_s: float = 10.0) -> None:
        self.inner.flush(timeout_s)

    def shutdown(self) -> None:
        self.inner.shutdown()


def create_exporters(names: Sequence[str], config: Any) -> list[Exporter]:
    from ..exporters import registry

    out: list[Exporter] = []
    seen = set()
    for name in names:
        name = "wandb" if name == "tracking" else name
        if name in seen:
            continue
        seen.add(name)
        if name == "discard":
            e: Exporter = DiscardExporter(config)
            e.name = "discard"
        else:
            e = registry.create(name, config)
        out.append(e)
    return out


# ----------------------------------------------------------------------------- counters


class Raw:
    __slots__ = ("path", "body", "content_type", "content_encoding")

    def __init__(self, path: str, body: bytes, content_type: str, content_encoding: str):
        self.path = path
        self.body = body
        self.content_type = content_type
        self.content_encoding = content_encoding


class SizedBatch(list):
    """One forwarded request; counts as its size in KiB in the DeliveryQueue, which bounds items."""

    def __len__(self) -> int:
        return max(1, sum(len(r.body) for r in self) >> 10)


class ForwardExporter(Exporter):
    """Posts received OTLP request bodies, as received, to another OTLP/HTTP endpoint."""

    wants_records = True  # receives Raw items through a DeliveryQueue of its own (not the pipeline)

    def __init__(self, endpoint: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0):
        from urllib.parse import urlsplit

        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--forward-endpoint must be an http(s) URL, got {endpoint!r}")
        self.name = "forward"
        self.endpoint = endpoint.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._base = parts.path.rstrip("/")
        self._headers = dict(headers or {})
        self._timeout = timeout_s
        self._conn: Any = None

    def _connection(self) -> Any:
        import http.client

        if self._conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        return self._conn

    def export_records(self, records: Sequence[Any]) -> None:
        for raw in records:
            headers = {"Content-Type": raw.content_type, **self._headers}
            if raw.content_encoding:
                headers["Content-Encoding"] = raw.content_encoding
            try:
                conn = self._connection()
                conn.request("POST", self._base + raw.path, body=raw.body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                status = resp.status
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                    self._conn = None
            except OSError as exc:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                raise ConnectionError(f"forward to {self.endpoint}: {exc}") from None
            except Exception as exc:  # http.client protocol errors: reconnect and retry
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                raise ConnectionError(f"forward to {self.endpoint}: {type(exc).__name__}") from None
            if status in (429, 502, 503, 504) or status >= 500:
                raise ConnectionError(f"forward to {self.endpoint}{raw.path}: HTTP {status} (retrying)")
            if status >= 300:
                raise ValueError(f"forward to {self.endpoint}{raw.path}: HTTP {status}")  # dropped after 3 tries

    def shutdown(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# ----------------------------------------------------------------------------- root spans
