"""Trajectories into a remote MLflow tracking server (``http://``, ``https://``): the server's own OTLP
endpoint, fed large requests, two at a time.

MLflow's client sends spans the same way (``log_spans`` posts an OTLP/HTTP protobuf request to the
server's ``/v1/traces`` with the ``x-mlflow-experiment-id`` header), but it builds an OpenTelemetry span,
an MLflow span and a protobuf message per span first, and
one call waits for the server before the next one is made.  `RemoteTraceWriter`:

- encodes the request from the exporter's `RowSpan`s directly (`_otlp`: the same bytes, without those objects);
- sends a delivery as requests of up to `MAX_TRACES_PER_REQUEST` trajectories (a smaller delivery as
  `IN_FLIGHT` requests), with up to `IN_FLIGHT` of them on their way at once: the server works on two
  requests at once, and the next one is encoded meanwhile, so the server, not the client, sets the pace;
- links each request's traces to the run (``link_traces_to_run``, 100 per call) once the server has
  stored them, as the exporter always did, on a thread of its own while the next requests go out: the
  server's ``x-mlflow-run-id`` header would link them too, but it drops a link that fails without saying
  so, and takes at most 100 traces.

The server stores what it stores for MLflow's own client: trace info, tags (``mlflow.traceTag.*`` of
the root span), request / response previews and token usage from the root's inputs / outputs, spans;
tests/trackers/test_mlflow_remote.py writes the same trajectories both ways and compares them.

A failed request raises (the core retries the delivery); `done` then says how many of the delivery's
leading requests were stored and linked, and the retry starts after them.  Trace ids come from the
OpenTelemetry trace ids, so a request sent again updates the same traces: nothing is duplicated.

A server that answers ``/v1/traces`` with 404, 405 or 501 (no such endpoint; a file-store backend)
raises `Unsupported`: the exporter then logs those traces one at a time (trace info + span data
artifact), as for any store without span ingestion.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from otel_rl.records import Trajectory

from . import _otlp
from ._traces import RowSpan, mlflow_trace_id

#: the exporter's switch (default on): false sends through MLflow's client (`log_spans`) as before
ENV_OTLP = "OTEL_RL_MLFLOW_OTLP_TRACES"
OTLP_TRACES_PATH = "/v1/traces"  # mlflow.tracing.utils.otlp.OTLP_TRACES_PATH
EXPERIMENT_HEADER = "x-mlflow-experiment-id"  # mlflow.tracing.utils.otlp.MLFLOW_EXPERIMENT_ID_HEADER
#: what one request holds at most (the server stores a request in one transaction)
MAX_TRACES_PER_REQUEST = 500
MAX_SPANS_PER_REQUEST = 5000
MAX_BYTES_PER_REQUEST = 16 << 20
#: requests on their way at once
IN_FLIGHT = 2
#: a delivery of fewer than IN_FLIGHT * MAX_TRACES_PER_REQUEST trajectories is cut into IN_FLIGHT requests
#: of at least this many, so that the server works on them at once
MIN_TRACES_PER_REQUEST = 16
MAX_LINKS_PER_CALL = 100  # MLflow's MAX_TRACE_LINKS_PER_REQUEST
#: answers that mean "no OTLP span ingestion here"
_UNSUPPORTED = {404, 405, 501}


def request_limits(n: int) -> tuple[int, int, int]:
    """How a delivery of `n` trajectories is cut into requests (`_traces.chunks`' limits)."""
    per = min(MAX_TRACES_PER_REQUEST, max(MIN_TRACES_PER_REQUEST, -(-n // IN_FLIGHT)))
    return (per, MAX_SPANS_PER_REQUEST, MAX_BYTES_PER_REQUEST)


class Unsupported(Exception):
    """The server has no usable OTLP trace endpoint."""


def rest_store_of(store: Any) -> Any:
    """`store` if it is MLflow's plain REST store (a tracking server), else None."""
    try:
        from mlflow.store.tracking.rest_store import RestStore
    except ImportError:  # pragma: no cover - MLflow without it
        return None
    if type(store) is not RestStore:  # subclasses (Databricks) ingest spans elsewhere
        return None
    return store


class RemoteTraceWriter:
    """Sends deliveries of trajectories to one tracking server (see the module docstring)."""

    def __init__(self, store: Any):
        self._store = store
        self._pool: ThreadPoolExecutor | None = None
        self._linker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        #: leading requests of the last `write` that were stored and linked (read after it raised)
        self.done = 0

    @classmethod
    def for_store(cls, store: Any) -> RemoteTraceWriter | None:
        rest = rest_store_of(store)
        return cls(rest) if rest is not None else None

    def write(
        self,
        experiment_id: str,
        run_id: str,
        requests: Sequence[list[Trajectory]],
        spans_of: Callable[[Trajectory], list[RowSpan]],
    ) -> None:
        """Store every trajectory of `requests` (one list per request), linked to `run_id`; returns when
        all are stored and linked, raises at the first failure (after the calls on their way ended).

        A request's traces are linked on a thread of their own once the server has stored them, while
        the next requests are sent: the link calls do not hold one of the `IN_FLIGHT` places."""
        self.done = 0
        validate = getattr(self._store, "_validate_workspace_support_if_specified", None)
        if validate is not None:
            validate()
        pool, linker = self._executors()
        posts: deque[tuple[Future, list[str]]] = deque()
        links: list[Future] = []

        def stored() -> None:  # the oldest request on its way is stored: its traces are linked meanwhile
            f, ids = posts.popleft()
            f.result()
            links.append(linker.submit(self._link, run_id, ids))

        try:
            for trajs in requests:
                body = _otlp.export_request([s for t in trajs for s in spans_of(t)])
                ids = [mlflow_trace_id(t.trace_id) for t in trajs]
                while len(posts) >= IN_FLIGHT:
                    stored()
                posts.append((pool.submit(self._post, experiment_id, body), ids))
            while posts:
                stored()
            for f in links:
                f.result()
                self.done += 1
        except BaseException:
            for f in [f for f, _ in posts] + links:  # let them end: a retry must not race them
                try:
                    f.result()
                except Exception:
                    pass
            self.done = 0  # the leading requests stored and linked
            for f in links:
                if f.exception() is not None:
                    break
                self.done += 1
            raise

    def _post(self, experiment_id: str, body: bytes) -> None:
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        response = http_request(
            host_creds=self._store.get_host_creds(),
            endpoint=OTLP_TRACES_PATH,
            method="POST",
            data=body,
            extra_headers={"Content-Type": "application/x-protobuf", EXPERIMENT_HEADER: experiment_id},
        )
        if response.status_code in _UNSUPPORTED:
            raise Unsupported(f"{response.status_code} {response.text[:200]}")
        verify_rest_response(response, OTLP_TRACES_PATH)

    def _link(self, run_id: str, ids: list[str]) -> None:
        for i in range(0, len(ids), MAX_LINKS_PER_CALL):
            self._store.link_traces_to_run(ids[i : i + MAX_LINKS_PER_CALL], run_id)

    def _executors(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        with self._lock:
            if self._pool is None or self._linker is None:
                self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="otel-rl-mlflow-otlp")
                self._linker = ThreadPoolExecutor(1, thread_name_prefix="otel-rl-mlflow-link")
            return self._pool, self._linker

    def close(self) -> None:
        with self._lock:
            pools = (self._pool, self._linker)
            self._pool = self._linker = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False)
