"""Where shipped batches become deliveries: records, and packed spans built into trajectories."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .._wire import unpack
from ..records import RecordBuilder, records_for
from ..serialize import DEFAULT_MAX_CHARS, materialize


class Receiver:
    """Queues fed what the training process ships to its export process: records, and packed spans
    (`otel_rl._wire`) whose trajectories are built here.  The export process has one; so do the queues
    that take over in the training process when it dies (`Pipeline.adopt`)."""

    def __init__(
        self,
        queues: dict[str, Any],
        on_missing: Any = None,
        tokenizers: dict[int, Any] | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
    ):
        self.queues = queues
        self.on_missing = on_missing  # called (name, n records) for a name without a queue
        self.tokenizers: dict[int, Any] = tokenizers if tokenizers is not None else {}  # token2text: key -> tokenizer
        self.max_chars = max_chars
        self._builder = RecordBuilder()
        self._lock = threading.Lock()

    def put(
        self,
        records: list,
        names: Sequence[str],
        wire: list | None = None,
        resource_attrs: dict | None = None,
        seq: int = 0,
        nbytes: int = 0,
    ) -> None:
        """`nbytes`: what the batch takes in memory, when known (the queues' `queue_max_bytes` counts it)."""
        if wire:
            from .._token2text import decode_packed

            # the token2text jobs shipped with them, first: ids still to be read from an op output's copy are
            # then read from the copy itself (the spans given texts have their copies made into text there)
            decode_packed(wire, self.tokenizers, self.max_chars)
            for t in wire:  # ops' inputs and outputs copied as bytes: their JSON text (serialize.snapshot)
                materialize(t[6], self.max_chars)
        with self._lock:
            trajs = self._builder.build(unpack(wire, resource_attrs or {}, seq)) if wire else []
        self.deliver(list(records) + trajs, names, seq, nbytes)

    def flush_partial(self) -> None:
        """Trajectories whose root never came: what there is, to every queue that takes trajectories."""
        with self._lock:
            partial = self._builder.flush_partial()
        self.deliver(partial, tuple(self.queues))

    def held_since(self) -> int | None:
        """The oldest batch seq of spans held for a trajectory whose root has not come; None if none."""
        with self._lock:
            held = [g[0].seq for g in self._builder.pending() if g]
        return min(held) if held else None

    def deliver(self, records: list, names: Sequence[str], seq: int = 0, nbytes: int = 0) -> None:
        for n in names:
            q = self.queues.get(n)
            if q is None:
                if self.on_missing is not None:
                    self.on_missing(n, len(records))
                continue
            recs = records_for(q.exporter, records)
            if recs:
                q.put([], recs, seq, nbytes)
