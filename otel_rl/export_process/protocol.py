"""The messages between the training process and its export process: one small class per kind.

Each end dispatches on a message's type.  They travel as frames of `frames.py` over two pipes:

    trainer -> export process
        Hello      the config, the exporters to start (name, wants_trajectories), their queue size
        Batch      records and packed spans for some exporters, pickled once (`Shipment`); its seq
        Flush      answer (`Flushed`) when every batch up to seq is delivered
        Routing    an exporter's wants_trajectories changed
        Tokenizer  token2text: a pickled tokenizer that shipped spans name by key
        Console    what the training process printed, for the tracker runs that record a console
        Stop       deliver, finish the tracker runs, exit; failure: how the training process ends
                   (None: well, or (state, traceback text, exit code))
    export process -> trainer
        Ready      {name: error or None} once the exporters are made
        Stats      {name: stats} and the settled seq, about twice a second
        Flushed    the answer to a Flush
        Stopped    every tracker run finished (nothing is delivered again after it)
        Done       the exit hooks have run too; the process ends right after (its end is not waited for)

A batch is *settled* once the export process has delivered it or written it to its spool: the training
process keeps a copy of every unsettled batch, to deliver again should the export process die.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: set in the export process's environment: an `init()` there keeps every exporter in-process
IN_EXPORT_PROCESS = "OTEL_RL_IN_EXPORT_PROCESS"


class Shipment(NamedTuple):
    """What a `Batch` carries (pickled): records, and packed spans (`otel_rl._wire`) whose trajectories the
    export process builds, for the exporters `names`."""

    records: list
    names: tuple[str, ...]
    wire: list | None
    resource_attrs: dict | None


# ----------------------------------------------------------------------------- trainer -> export process


class Hello(NamedTuple):
    config: Any
    exporters: list[tuple[str, bool]]
    queue_size: int


class Batch(NamedTuple):
    seq: int
    payload: bytes  # a pickled Shipment


class Flush(NamedTuple):
    seq: int
    timeout_s: float


class Routing(NamedTuple):
    name: str
    wants_trajectories: bool


class Tokenizer(NamedTuple):
    key: int
    blob: bytes


class Console(NamedTuple):
    chunks: list[tuple[str, str]]


class Stop(NamedTuple):
    timeout_s: float
    failure: tuple[str, str, int] | None = None


# ----------------------------------------------------------------------------- export process -> trainer


class Ready(NamedTuple):
    errors: dict[str, str | None]


class Stats(NamedTuple):
    stats: dict[str, dict]
    settled: int


class Flushed(NamedTuple):
    seq: int
    ok: bool
    stats: dict[str, dict]
    settled: int


class Stopped(NamedTuple):
    stats: dict[str, dict]


class Done(NamedTuple):
    pass
