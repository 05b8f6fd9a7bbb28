"""Where shipped batches become deliveries: records, and packed spans built into trajectories.

The packed spans (`otel_rl._wire`) are unpacked into the light spans the training process made
(`otel_rl._lightspan.LightSpan`, the SDK's `ReadableSpan`), materialised here (token2text, the ops'
copies as JSON text) and handed to the `RecordBuilder`, as the pipeline's worker does in-process."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource

from .._lightspan import materialise
from .._wire import unpack
from ..records import RecordBuilder, records_for
from ..serialize import DEFAULT_MAX_CHARS


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
        # trace id -> the batch seq its first held span came in, for the traces the builder holds
        self._held: dict[int, int] = {}
        self._resource: tuple[dict, Resource] | None = None  # the last batch's resource: (attributes, Resource)

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
        trajs = []
        if wire:
            spans = unpack(wire, self._resource_of(resource_attrs or {}), self.tokenizers)
            materialise(spans, self.max_chars)
            with self._lock:
                trajs = self._builder.build(spans)
                self._note_held(spans, seq)
        self.deliver(list(records) + trajs, names, seq, nbytes)

    def _resource_of(self, attrs: dict) -> Resource:
        """The SDK `Resource` of `attrs` (one training process sends the same attributes each time)."""
        last = self._resource
        if last is None or last[0] != attrs:
            last = self._resource = (attrs, Resource(attrs))
        return last[1]

    def _note_held(self, spans: list, seq: int) -> None:
        """Keep, for each trace the builder now holds spans of, the seq of the batch that brought its first."""
        held = self._held
        pending = self._builder.pending_traces()
        for s in spans:
            tid = s.context.trace_id
            if tid in pending:
                held.setdefault(tid, seq)
            else:
                held.pop(tid, None)
        if len(held) > 2 * len(pending) + 64:  # traces the builder let go of as partial meanwhile
            self._held = {tid: s for tid, s in held.items() if tid in pending}

    def flush_partial(self) -> None:
        """Trajectories whose root never came: what there is, to every queue that takes trajectories."""
        with self._lock:
            partial = self._builder.flush_partial()
            self._held.clear()
        self.deliver(partial, tuple(self.queues))

    def held_since(self) -> int | None:
        """The oldest batch seq of spans held for a trajectory whose root has not come; None if none."""
        with self._lock:
            pending = self._builder.pending_traces()
            held = [seq for tid, seq in self._held.items() if tid in pending]
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
