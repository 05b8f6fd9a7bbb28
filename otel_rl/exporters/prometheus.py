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


class PrometheusExporter(Exporter):
    wants_records = False

    def __init__(self, config: Any = None):
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, CollectorRegistry
        from prometheus_client.exposition import start_http_server

        host = getattr(config, "prometheus_host", "127.0.0.1")
        port = int(getattr(config, "prometheus_port", 9464))
        self._reader = PrometheusMetricReader()
        # the reader registers its collector in the default registry; serve it from our own
        self._collector = getattr(self._reader, "_collector", None)
        self.registry = CollectorRegistry(auto_describe=True)
        if self._collector is not None:
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
