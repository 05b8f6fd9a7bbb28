"""Which trajectories are traced: at most N unique samples per step per worker.

The choice is a pure function of (run id, step, sample_index): every sample
gets a score from a keyed hash, and a step's traced samples are the N with the
lowest scores among that step's candidates.  Every process that sees the same
candidates makes the same choice, and all `rollout_n` of a chosen sample are
kept because the score does not depend on `rollout_n`.

The candidates of a step are known when the trainer registers them with
`select(step, sample_indices)` (the way verl's agent loop knows its chunk of the
batch before it starts the rollouts).  When they are not registered, samples
are admitted as they arrive: a sample is traced when fewer than N distinct
samples have been admitted for that step in this process; the decision is
remembered, so later rollouts of an admitted sample are traced too.  That
fallback is still "at most N per step per worker" but depends on arrival order.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable

_MAX_STEPS_REMEMBERED = 64


def sample_score(run_id: str, step: int | None, sample_index: int | None) -> int:
    """A stable 64-bit score for one sample (same in every process and platform)."""
    h = hashlib.blake2b(f"{run_id}\x1f{step}\x1f{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def choose(run_id: str, step: int | None, sample_indices: Iterable[int], n: int) -> set[int]:
    """The `n` samples of `sample_indices` with the lowest scores (none when n <= 0)."""
    if n <= 0:
        return set()
    unique = sorted(set(sample_indices))
    if n >= len(unique):
        return set(unique)
    scored = sorted(unique, key=lambda i: (sample_score(run_id, step, i), i))
    return set(scored[:n])


class Sampler:
    """Per-process sampling state; thread-safe."""

    def __init__(self, run_id: str, max_samples: int | None):
        self.run_id = run_id
        self.max_samples = max_samples
        self._lock = threading.Lock()
        # (step, validate) -> chosen set (registered) or admitted set (fallback)
        self._plans: OrderedDict[tuple, set[int]] = OrderedDict()
        self._admitted: OrderedDict[tuple, set[int | None]] = OrderedDict()

    def select(self, step: int | None, sample_indices: Iterable[int], validate: bool = False) -> set[int]:
        """Register a step's candidates; returns the chosen sample indices."""
        indices = list(sample_indices)
        chosen = set(indices) if self.max_samples is None else choose(self.run_id, step, indices, self.max_samples)
        with self._lock:
            self._plans[(step, bool(validate))] = chosen
            _trim(self._plans)
        return chosen

    def decide(self, step: int | None, sample_index: int | None, validate: bool = False) -> bool:
        n = self.max_samples
        if n is None:
            return True
        if n <= 0:
            return False
        key = (step, bool(validate))
        plan = self._plans.get(key)
        if plan is not None:
            return sample_index in plan
        with self._lock:
            admitted = self._admitted.get(key)
            if admitted is None:
                admitted = self._admitted[key] = set()
                _trim(self._admitted)
            if sample_index in admitted:
                return True
            if len(admitted) < n:
                admitted.add(sample_index)
                return True
            return False


def _trim(d: OrderedDict) -> None:
    while len(d) > _MAX_STEPS_REMEMBERED:
        d.popitem(last=False)
