"""`prometheus`: a pull endpoint served by the official OpenTelemetry Prometheus reader.

Address: config ``prometheus_host``/``prometheus_port`` or the standard
``OTEL_EXPORTER_PROMETHEUS_HOST`` / ``OTEL_EXPORTER_PROMETHEUS_PORT``
(default 127.0.0.1:9464; port 0 picks a free one, see ``.port``).
The endpoint serves its own registry, so several pipelines in one process
(tests) do not mix.
"""

from __future__ import annotations

from typing import Any

from .base import Exporter


def _latest_only_reader(**kwargs: Any) -> Any:
    """The official pull reader, keeping only the newest collection for the next scrape.

    The reader queues every collection made between two scrapes (each
    `Handle.flush()` collects through ``force_flush``) and its collector then
    serves every metric family once per queued collection, so a scrape after a
    flush carried each family twice, which Prometheus rejects.  All our
    instruments are cumulative or last-value: the newest collection supersedes
    the older ones.
    """
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class _LatestOnlyReader(PrometheusMetricReader):
        def _receive_metrics(self, metrics_data: Any, timeout_millis: float = 10_000, **kw: Any) -> None:
            queued = getattr(getattr(self, "_collector", None), "_metrics_datas", None)
            if metrics_data is not None and queued is not None:
                queued.clear()
            super()._receive_metrics(metrics_data, timeout_millis, **kw)

    try:
        return _LatestOnlyReader(**kwargs)
    except TypeError:  # an older reader without the `registry` argument
        return _LatestOnlyReader()


class PrometheusExporter(Exporter):
    wants_records = False

    def __init__(self, config: Any = None):
        from prometheus_client import REGISTRY, CollectorRegistry
        from prometheus_client.exposition import start_http_server

        host = getattr(config, "prometheus_host", "127.0.0.1")
        port = int(getattr(config, "prometheus_port", 9464))
        self.registry = CollectorRegistry()
        self._reader = _latest_only_reader(registry=self.registry)
        # older readers register their collector in the default registry; serve it from our own
        self._collector = getattr(self._reader, "_collector", None)
        if self._collector is not None and getattr(self._reader, "_registry", REGISTRY) is not self.registry:
            try:
                REGISTRY.unregister(self._collector)
            except Exception:
                pass
            self.registry.register(self._collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def metric_readers(self) -> list[Any]:
        return [self._reader]

    def shutdown(self) -> None:
        try:
            self._server.shutdown()
            self._server.server_close()
        except Exception:
            pass
