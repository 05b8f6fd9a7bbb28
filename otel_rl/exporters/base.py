"""The exporter plug-in contract.

An exporter is created by a factory registered under the entry-point group
``otel_rl.exporters`` (the name users write in ``trainer.logger`` or
``trace.backend``).  The factory is called as ``factory(config)`` with the
resolved `otel_rl.config.Config` and returns an `Exporter`.

An exporter says what it consumes:

- ``export_records(records)``: typed records (run start, step metrics,
  generations, trajectories), built once by the core for everybody;
- ``export_spans(spans)``: the raw finished spans (OTLP and the test kit);
- ``metric_readers()``: OpenTelemetry metric readers to attach to the meter
  provider (Prometheus, OTLP metrics).

Both export methods run on the exporter's own delivery thread, in batches,
never on the training thread.  Raising from them means "not delivered": the
batch is kept and retried with backoff, the failure counted and logged once
per kind.  They must not retain the list objects they are given.  An error
that says the *data* is wrong (`is_data_error`: ``ValueError``, ``TypeError``,
``OverflowError``, ... or a tracker error caused by one) will be the same at
every attempt: the tracker exporters then find the records it is about and
reject only those; for any other exporter its queue does, handing the batch
over in parts until the bad items are alone (docs/delivery.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.trace import ReadableSpan

    from ..records import Record

from .._values import warn_once  # re-exported: exporters log a problem once per kind with it

__all__ = ["DATA_ERRORS", "Exporter", "is_data_error", "warn_once"]

#: errors that say "this data is wrong", not "the tracker is unreachable"
DATA_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    IndexError,
    RecursionError,
    NotImplementedError,
    OverflowError,
)


def is_data_error(exc: BaseException) -> bool:
    """Whether `exc` says the data is wrong (retrying the same data cannot help): one of `DATA_ERRORS`,
    or an error raised while handling an ``OverflowError`` (MLflow's store wraps sqlite's "Python int
    too large to convert to SQLite INTEGER" in its own exception)."""
    if isinstance(exc, DATA_ERRORS):
        return True
    cause = exc.__cause__ or exc.__context__
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, OverflowError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class Exporter:
    #: registered name, filled in by the registry
    name: str = ""
    #: consumes sampled trajectories (turns tracing on in "auto" mode)
    wants_trajectories: bool = False
    #: consumes raw spans (turns tracing on in "auto" mode)
    wants_spans: bool = False
    #: consumes records at all (console/jsonl/trackers); False for metric-only exporters
    wants_records: bool = True
    #: its queue gathers the batches of `export_interval_s` into one delivery (the trackers: fewer
    #: calls and store transactions; console and JSONL: fewer wake-ups of their thread in the
    #: training process); False: each batch goes out as soon as it is queued
    gathers: bool = False

    def export_records(self, records: Sequence[Record]) -> None:  # pragma: no cover - default
        return None

    def export_spans(self, spans: Sequence[ReadableSpan]) -> None:  # pragma: no cover - default
        return None

    #: set by the export process on the exporters it runs: the pid of the training process it serves (a
    #: tracker's system metrics belong to that one); None for the training process's own exporters
    training_pid: int | None = None

    @property
    def in_export_process(self) -> bool:
        return self.training_pid is not None

    #: ``prepare(records)`` or None: work that `export_records` would do for these records, done ahead
    #: of their delivery while its queue gathers (see `gathers`); `export_records` of the same records
    #: must give the same result whether or not it ran, and nothing may depend on it having run
    prepare: Callable[[Sequence[Record]], None] | None = None

    def metric_readers(self) -> list[MetricReader]:
        return []

    def flush(self, timeout_s: float = 10.0) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def process_failed(self, state: str, text: str, exit_code: int = 1) -> None:
        """The training process is not ending well, called before `shutdown` (in whichever process the
        exporter runs): `state` ``crashed`` (an uncaught exception, or a non-zero ``sys.exit``),
        ``aborted`` (Ctrl-C) or ``killed`` (a termination signal, SIGTERM); `text` the traceback or the
        cause; `exit_code` as wandb records it (1, the exit code, 255 for Ctrl-C, 128 + signal number).
        An exporter whose tracker records how a run ended marks its runs so.  (An implementation may
        leave out `exit_code`.)"""
        return None
