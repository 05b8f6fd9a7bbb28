"""otel_rl.sampling: which trajectories are traced, in one process, across processes, and end to end."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import otel_rl
from otel_rl import semconv as sc
from otel_rl.sampling import Sampler, choose, sample_score
from otel_rl.testing import CaptureExporter

INDICES = st.lists(st.integers(min_value=-5, max_value=200), max_size=60)
RUN_IDS = st.text(min_size=0, max_size=12)
STEPS = st.one_of(st.none(), st.integers(min_value=0, max_value=10**6))


# ----------------------------------------------------------------------------- choose


@settings(max_examples=200, deadline=None)
@given(RUN_IDS, STEPS, INDICES, st.integers(min_value=0, max_value=70), st.randoms(use_true_random=False))
def test_choose_size_determinism_and_order_independence(run_id, step, indices, n, rnd):
    chosen = choose(run_id, step, indices, n)
    unique = set(indices)
    assert len(chosen) == min(n, len(unique))
    assert chosen <= unique
    assert choose(run_id, step, indices, n) == chosen  # deterministic
    shuffled = list(indices) * 2 + list(indices)[:3]  # duplicates do not matter
    rnd.shuffle(shuffled)
    assert choose(run_id, step, shuffled, n) == chosen  # neither does order
    assert choose(run_id, step, iter(shuffled), n) == chosen  # any iterable
    # the n lowest scores: growing n only adds samples, and every chosen one beats every other one
    assert chosen <= choose(run_id, step, indices, n + 1)
    if chosen and unique - chosen:
        worst_in = max((sample_score(run_id, step, i), i) for i in chosen)
        best_out = min((sample_score(run_id, step, i), i) for i in unique - chosen)
        assert worst_in < best_out


def test_choose_edge_cases():
    assert choose("r", 1, [], 3) == set()
    assert choose("r", 1, range(10), 0) == set()
    assert choose("r", 1, range(3), 10) == {0, 1, 2}
    assert choose("r", 1, [4, 4, 4], 2) == {4}
    assert choose("r", 1, range(10), -1) == set()  # a negative budget traces nothing


def test_choose_depends_on_run_and_step():
    picks_by_step = [frozenset(choose("run-a", s, range(100), 5)) for s in range(20)]
    assert len(set(picks_by_step)) > 15  # steps pick different samples
    other_run = [frozenset(choose("run-b", s, range(100), 5)) for s in range(20)]
    assert sum(a != b for a, b in zip(picks_by_step, other_run)) > 15  # runs pick different samples


def test_choose_is_roughly_uniform():
    counts = [0] * 20
    for s in range(2000):
        for i in choose("uniform", s, range(20), 2):
            counts[i] += 1
    # 4000 picks over 20 samples: 200 expected each; a biased hash would be far off
    assert all(120 < c < 280 for c in counts), counts


def test_sample_score_is_stable():
    # pinned: the same value on every platform and Python version (blake2b, not hash())
    assert sample_score("r1", 0, 0) == sample_score("r1", 0, 0)
    assert 0 <= sample_score("r1", 0, 0) < 2**64
    assert sample_score("r1", 0, 0) != sample_score("r1", 0, 1)
    assert sample_score("r1", 0, 0) != sample_score("r1", 1, 0)
    assert sample_score("r1", 0, 0) != sample_score("r2", 0, 0)


# ----------------------------------------------------------------------------- Sampler


def test_registered_plan_traces_all_rollouts_of_chosen_samples():
    s = Sampler("run-x", 3)
    chosen = s.select(7, range(16))
    assert chosen == choose("run-x", 7, range(16), 3)
    for rollout in range(5):
        for i in range(16):
            assert s.decide(7, i) is (i in chosen)
    # the plan is per (step, validate)
    vchosen = s.select(7, range(16), validate=True)
    assert vchosen == choose("run-x", 7, range(16), 3)
    assert all(s.decide(7, i, validate=True) is (i in vchosen) for i in range(16))
    # a sample outside the registered candidates is not traced
    assert s.decide(7, 999) is False


def test_registered_plan_is_not_affected_by_arrival_order():
    a, b = Sampler("r", 2), Sampler("r", 2)
    a.select(1, range(10))
    b.select(1, reversed(range(10)))
    order = list(range(10))
    random.Random(3).shuffle(order)
    assert [a.decide(1, i) for i in range(10)] == [b.decide(1, i) for i in range(10)]
    assert [a.decide(1, i) for i in order] == [b.decide(1, i) for i in order]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 12)), max_size=80),
       st.integers(min_value=1, max_value=5))
def test_fallback_admission_caps_and_remembers(arrivals, n):
    s = Sampler("run", n)
    admitted: dict[tuple, list[int]] = {}
    for step, validate, idx in arrivals:
        first = admitted.setdefault((step, validate), [])
        expected = idx in first or len(first) < n
        if expected and idx not in first:
            first.append(idx)
        assert s.decide(step, idx, validate) is expected
    for (step, validate), first in admitted.items():
        assert len(first) <= n
        # decisions are remembered: admitted samples stay admitted; once full, nobody else gets in
        assert all(s.decide(step, idx, validate) for idx in first)
        if len(first) == n:
            assert not any(s.decide(step, idx, validate) for idx in range(13) if idx not in first)


def test_fallback_is_thread_safe():
    s = Sampler("run", 4)
    results: dict[int, bool] = {}
    barrier = threading.Barrier(32)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = s.decide(0, i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = {i for i, ok in results.items() if ok}
    assert len(admitted) == 4
    assert all(s.decide(0, i) is (i in admitted) for i in range(32))


def test_max_samples_none_traces_all_and_zero_none():
    everything = Sampler("r", None)
    assert everything.select(1, [3, 1, 2]) == {1, 2, 3}
    assert all(everything.decide(1, i) for i in range(100))
    assert everything.decide(None, None) is True
    nothing = Sampler("r", 0)
    assert nothing.select(1, range(10)) == set()
    assert not any(nothing.decide(1, i) for i in range(100))
    assert not any(nothing.decide(2, i, validate=True) for i in range(10))


# ----------------------------------------------------------------------------- across processes

CHILD_CODE = r"""
import json, sys
import otel_rl
plan = json.loads(sys.argv[1])
h = otel_rl.init(exporters=[])          # run id and max_samples come from the environment (worker_env)
try:
    out = {"run_id": h.run_id, "max_samples": h.config.max_samples, "chosen": {}, "decided": {}}
    for step, cands in plan:
        chosen = h.select_samples(step, cands)
        out["chosen"][str(step)] = sorted(chosen)
        out["decided"][str(step)] = sorted(i for i in set(cands) if h.sampler.decide(step, i))
    print(json.dumps(out))
finally:
    h.shutdown()
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k not in ("RANK", "LOCAL_RANK")}


@pytest.mark.slow
def test_same_choice_in_every_process():
    steps = [0, 1, 17, 123456]
    candidates = list(range(40)) + [3, 7, 7, 11]  # duplicates, as when rollouts of a sample repeat its index
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], run_id="xproc-7f3a", max_samples=3, batch_delay_s=0.05)
    try:
        parent = {str(s): sorted(h.select_samples(s, candidates)) for s in steps}
        wenv = h.worker_env()
    finally:
        h.shutdown()
    assert all(len(v) == 3 for v in parent.values())

    procs = []
    for k in range(4):
        rnd = random.Random(k)
        plan = []
        for s in steps:
            shuffled = list(candidates)
            rnd.shuffle(shuffled)
            plan.append([s, shuffled])
        env = {**_clean_env(), **wenv, "RANK": str(k), "PYTHONHASHSEED": str(1000 + k)}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD_CODE, json.dumps(plan)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert len(outs) >= 3
    for out in outs:
        assert out["run_id"] == "xproc-7f3a" and out["max_samples"] == 3
        assert out["chosen"] == parent
        assert out["decided"] == parent
    assert parent == {str(s): sorted(choose("xproc-7f3a", s, candidates, 3)) for s in steps}


# ----------------------------------------------------------------------------- end to end


@otel_rl.op(name="traced_op")
def traced_op(x: int) -> int:
    return x * 2


@otel_rl.op(name="failing_op")
def failing_op(x: int) -> int:
    raise ValueError(f"boom {x}")


@pytest.fixture
def traced():
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], tracing=True, max_samples=2, run_id="r1", batch_delay_s=0.05)
    cap.handle = h
    try:
        yield cap, h
    finally:
        h.shutdown()


def test_end_to_end_two_samples_all_rollouts_per_step(traced):
    cap, h = traced
    assert h.tracing
    steps = [0, 1]
    chosen_by_step = {}
    for s in steps:
        chosen = otel_rl.select_samples(s, range(8))
        assert chosen == choose("r1", s, range(8), 2)
        chosen_by_step[s] = chosen
        with otel_rl.step(s):
            for i in range(8):
                for r in range(3):
                    with otel_rl.trajectory(step=s, sample_index=i, rollout_n=r) as t:
                        assert t.sampled is (i in chosen)
                        assert traced_op(i * 10 + r) == 2 * (i * 10 + r)
    cap.collect()
    all_traj = cap.trajectories()
    assert len(all_traj) == 2 * 2 * 3
    for s in steps:
        trajs = cap.trajectories(step=s)
        assert len(trajs) == 6
        assert {(t.sample_index, t.rollout_n) for t in trajs} == {(i, r) for i in chosen_by_step[s] for r in range(3)}
        for t in trajs:
            assert t.complete and t.status != "ERROR" and t.validate is False
            assert t.run.run_id == "r1"
            assert t.root.name == sc.SPAN_TRAJECTORY
            assert [c.name for c in t.root.children] == ["traced_op"]
            op_node = t.root.children[0]
            assert json.loads(op_node.inputs) == {"x": t.sample_index * 10 + t.rollout_n}
            assert json.loads(op_node.output) == 2 * (t.sample_index * 10 + t.rollout_n)
    assert len({t.trace_id for t in all_traj}) == len(all_traj)  # one trace per trajectory


def test_unregistered_step_falls_back_to_first_two_samples(traced):
    cap, _ = traced
    for i in [5, 2, 5, 7, 2, 0]:
        with otel_rl.trajectory(step=3, sample_index=i, rollout_n=0):
            traced_op(i)
    cap.collect()
    assert sorted(t.sample_index for t in cap.trajectories(step=3)) == [2, 2, 5, 5]


def _exception_events(node):
    return [e for e in node.events if e["name"] == "exception"]


def test_failing_unsampled_trajectory_is_still_captured(traced):
    cap, _ = traced
    chosen = otel_rl.select_samples(4, range(8))
    unsampled = min(set(range(8)) - chosen)
    with pytest.raises(ValueError, match="boom 1"):
        with otel_rl.trajectory(step=4, sample_index=unsampled, rollout_n=1) as t:
            assert not t.sampled
            traced_op(1)  # succeeds: not kept
            failing_op(1)
    # an unsampled trajectory that ends fine leaves no trace
    with otel_rl.trajectory(step=4, sample_index=unsampled, rollout_n=2):
        traced_op(2)
    cap.collect()
    trajs = cap.trajectories(step=4)
    assert len(trajs) == 1
    t = trajs[0]
    assert (t.sample_index, t.rollout_n) == (unsampled, 1)
    assert t.status == "ERROR" and "boom 1" in (t.root.status_message or "")
    assert t.root.attributes.get(sc.RL_SAMPLED) is False
    assert _exception_events(t.root)
    assert [c.name for c in t.root.children] == ["failing_op"]
    child = t.root.children[0]
    assert child.status == "ERROR"
    events = _exception_events(child)
    assert len(events) == 1
    assert events[0]["attributes"]["exception.type"].endswith("ValueError")
    assert "boom 1" in events[0]["attributes"]["exception.message"]
    assert child.start_ns <= child.end_ns and t.root.start_ns <= child.start_ns


def test_unsampled_trajectory_with_caught_op_error_is_kept(traced):
    cap, _ = traced
    chosen = otel_rl.select_samples(6, range(8))
    unsampled = max(set(range(8)) - chosen)
    with otel_rl.trajectory(step=6, sample_index=unsampled, rollout_n=0):
        try:
            failing_op(6)
        except ValueError:
            pass  # the agent handled it, but the failure is still worth seeing
    cap.collect()
    (t,) = cap.trajectories(step=6)
    assert t.sample_index == unsampled and t.status == "ERROR"
    assert not _exception_events(t.root)
    (child,) = t.root.children
    assert child.name == "failing_op" and child.status == "ERROR" and len(_exception_events(child)) == 1


def test_failing_sampled_trajectory(traced):
    cap, _ = traced
    chosen = otel_rl.select_samples(8, range(8))
    sampled = min(chosen)
    with pytest.raises(ValueError):
        with otel_rl.trajectory(step=8, sample_index=sampled, rollout_n=0):
            traced_op(3)
            failing_op(3)
    cap.collect()
    (t,) = cap.trajectories(step=8)
    assert t.status == "ERROR"
    assert sc.RL_SAMPLED not in t.root.attributes
    assert [c.name for c in t.root.children] == ["traced_op", "failing_op"]
    assert t.root.children[0].status != "ERROR"
    assert t.root.children[1].status == "ERROR" and _exception_events(t.root.children[1])
