"""The interval that bench_demo.py --lockstep prints around the median of its runs' ratios."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_demo import median_interval  # noqa: E402


def test_order_statistics_and_their_exact_coverage():
    xs = [1.024, 1.046, 1.032, 1.018, 1.033, 1.025, 1.022, 1.022, 1.025, 1.005]
    low, high, coverage = median_interval(xs)
    # n = 10: the 2nd smallest and 2nd largest, 1 - 2 * P(Bin(10, 1/2) <= 1) = 1 - 22/1024
    assert (low, high) == (1.018, 1.033)
    assert coverage == pytest.approx(1 - 22 / 1024)
    # n = 6: only the extremes reach 95 % (1 - 2/64); n = 5 cannot (1 - 2/32 < 0.95)
    assert median_interval(xs[:6]) == (1.018, 1.046, pytest.approx(1 - 2 / 64))
    assert median_interval(xs[:5]) is None
    assert median_interval([]) is None


def test_the_interval_covers_the_median_as_often_as_it_says():
    rng = random.Random(7)
    for n in (6, 10, 20):
        hits, trials, stated = 0, 4000, None
        for _ in range(trials):
            low, high, stated = median_interval([rng.expovariate(1.0) for _ in range(n)])
            hits += low <= 0.6931471805599453 <= high  # the median of Exp(1): ln 2
        assert stated >= 0.95
        assert hits / trials == pytest.approx(stated, abs=0.015)
