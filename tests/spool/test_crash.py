"""Fault 2: a trainer process logging to MLflow (a real sqlite store) and to an append-only sink is
killed with SIGKILL while both are down; `otel-rl replay` (or the next start with the same spool
directory) then delivers exactly what was acknowledged, nothing twice.

"Down" is real: the test holds an exclusive lock on MLflow's sqlite database (MLflow fails with
"database is locked" after its busy timeout) and switches the sink off.  The trainer prints, after
each step's `flush()`, whether the step is acknowledged (nothing of it only in memory).  After the
kill the test reads what the spool holds (read-only), then checks, reading MLflow back with its own
client (metric history, traces, tables) and the sink file:

- every step up to the last acknowledged one is present exactly once;
- what is present is exactly: the steps delivered before the outage + the steps in the spool;
- nothing is duplicated (the sink appends: a batch delivered twice would show twice; MLflow's
  tables append rows on a re-delivered batch; traces are keyed by trace id).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

from mlflow import MlflowClient  # noqa: E402

from .spool_helpers import HERE, LineProcess, clean_env, read_sink, run_replay, spool_contents  # noqa: E402

pytestmark = pytest.mark.slow

PHASE1_STEPS = 3
ACKED_BEFORE_KILL = 8  # steps acknowledged during the outage before the kill


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash-mlflow")
    db = root / "mlflow.db"
    uri = f"sqlite:///{db}"
    MlflowClient(uri).search_experiments()  # create the schema once (MLflow's migrations take seconds)
    return root, db, uri


class Scenario:
    def __init__(self, tmp_path: Path, store):
        self.root, self.db, self.uri = store
        self.tmp = tmp_path
        self.spool = tmp_path / "spool"
        self.sink = tmp_path / "sink.jsonl"
        self.ctl = tmp_path / "ctl"
        self.ctl.mkdir()
        self.project = f"crash-{uuid.uuid4().hex[:8]}"
        self.run_id = uuid.uuid4().hex[:12]
        self.lock: sqlite3.Connection | None = None

    def env(self, **extra: str) -> dict[str, str]:
        # the trainer's own spool (in-process exporters); the export process has tests of its own
        return clean_env(OTEL_RL_EXPORT_PROCESS="false", MLFLOW_TRACKING_URI=self.uri,
                         OTEL_RL_SPOOL_DIR=str(self.spool), OTEL_RL_RUN_ID=self.run_id, SPOOL_TEST_SINK=str(self.sink), CRASH_DIR=str(self.ctl), PROJECT=self.project, **extra)

    def trainer(self, name: str, **extra: str) -> LineProcess:
        return LineProcess([sys.executable, str(HERE / "crash_trainer.py")], self.env(**extra), self.root, name)

    def tracker_down(self) -> None:
        self.lock = sqlite3.connect(self.db, timeout=120, isolation_level=None)
        self.lock.execute("BEGIN EXCLUSIVE")  # waits for the trainer's write in progress, then holds the db
        (self.sink.parent / (self.sink.name + ".down")).touch()

    def tracker_up(self) -> None:
        if self.lock is not None:
            self.lock.rollback()
            self.lock.close()
            self.lock = None
        (self.sink.parent / (self.sink.name + ".down")).unlink(missing_ok=True)

    def run_until_killed(self) -> int:
        """Phase 1 delivered, outage, SIGKILL after ACKED_BEFORE_KILL acknowledged steps.  The last acked step."""
        t = self.trainer("trainer-1", PHASE1_STEPS=str(PHASE1_STEPS))
        try:
            t.wait_event(lambda e: e.get("event") == "phase1")
            assert [e["delivered"] for e in t.events if e.get("event") == "ack"] == [True] * PHASE1_STEPS
            self.tracker_down()
            (self.ctl / "go").touch()
            target = PHASE1_STEPS + ACKED_BEFORE_KILL
            t.wait_event(lambda e: e.get("event") == "ack" and e["step"] >= target, timeout_s=240)
        finally:
            t.kill()  # SIGKILL, mid-run (the next step is being logged / flushed)
        acks = [e["step"] for e in t.events if e.get("event") == "ack"]
        assert acks == list(range(1, len(acks) + 1))  # every step acknowledged, in order
        late = [e for e in t.events if e.get("event") == "ack" and e["step"] > PHASE1_STEPS]
        assert late and not any(e["delivered"] for e in late)  # the outage was real: nothing delivered
        assert all(e["spooled"]["mlflow"] > 0 and e["spooled"]["appendlog"] > 0 for e in late)
        return acks[-1]

    def spooled(self, exporter: str) -> dict[str, list[int]]:
        """Steps of each record kind in one exporter's spool, in spool order."""
        out: dict[str, list[int]] = {k: [] for k in KINDS}
        for r in spool_contents(self.spool / exporter):
            if type(r).__name__ in out:
                out[type(r).__name__].append(r.step)
        return out

    # -- read back ------------------------------------------------------------------------------
    def mlflow_state(self):
        client = MlflowClient(self.uri)
        exp = client.get_experiment_by_name(self.project)
        runs = client.search_runs([exp.experiment_id])
        assert len(runs) == 1, [r.info.run_name for r in runs]
        run = runs[0]
        rid = run.info.run_id
        points = {k: sorted((m.step, m.value) for m in client.get_metric_history(rid, k))
                  for k in ["n"] + [f"k/{i}" for i in range(5)]}
        from mlflow.tracing.client import TracingClient

        traces = TracingClient(self.uri).search_traces(locations=[exp.experiment_id], max_results=1000)
        trace_steps = sorted(int(t.info.tags["step"]) for t in traces)
        return client, exp, run, points, trace_steps

    def check(self, mlflow: dict[str, set[int]], sink: dict[str, set[int]], acked: int) -> None:
        """Each exporter holds exactly the steps given per record kind, each once."""
        for want in (mlflow, sink):
            for kind in KINDS:
                assert set(range(1, acked + 1)) <= want[kind], kind  # every acknowledged step
        client, exp, run, points, trace_steps = self.mlflow_state()
        metric_steps = sorted(mlflow["StepMetrics"])
        assert [s for s, _ in points["n"]] == metric_steps  # each step once
        for i in range(5):
            assert points[f"k/{i}"] == [(s, s + i / 100) for s in metric_steps]
        assert trace_steps == sorted(mlflow["Trajectory"])  # one trace per step
        tables = sorted(int(f.path.split("_")[-1][:-5])
                        for f in client.list_artifacts(run.info.run_id, "val_generations"))
        assert tables == sorted(mlflow["Generations"])
        for s in tables:  # a re-delivered batch would append its row again
            local = client.download_artifacts(run.info.run_id, f"val_generations/step_{s}.json", str(self.tmp))
            table = json.loads(Path(local).read_text())
            assert [row[1] for row in table["data"]] == [f"p{s}"], s
        got = read_sink(self.sink)
        for kind in KINDS:  # appended: a batch delivered twice would show twice
            assert sorted(e["step"] for e in got if e["kind"] == kind) == sorted(sink[kind]), kind
        assert {e["run_id"] for e in got if e["kind"] == "RunStart"} == {self.run_id}


KINDS = ("StepMetrics", "Trajectory", "Generations")


def expected(*parts: dict[str, list[int]] | set[int]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {k: set() for k in KINDS}
    for p in parts:
        for k in KINDS:
            out[k] |= set(p if isinstance(p, set) else p[k])
    return out


@pytest.fixture
def scenario(tmp_path, store):
    s = Scenario(tmp_path, store)
    try:
        yield s
    finally:
        s.tracker_up()


def test_sigkill_then_replay_delivers_exactly_what_was_acknowledged(scenario):
    acked = scenario.run_until_killed()
    in_spool = {e: scenario.spooled(e) for e in ("mlflow", "appendlog")}
    for kinds in in_spool.values():
        for steps in kinds.values():
            assert steps == sorted(set(steps))  # in order, once
            assert set(range(PHASE1_STEPS + 1, acked + 1)) <= set(steps)  # everything acknowledged is there
            assert max(steps) <= acked + 1  # at most the step being logged at the kill
    # (the two queues are independent: one may hold the unacknowledged last step, the other not)

    env = scenario.env()
    code, out = run_replay(["--list", str(scenario.spool)], env, scenario.root)
    assert code == 0 and "mlflow" in out and "appendlog" in out and "waiting" in out, out
    scenario.tracker_up()
    code, out = run_replay([str(scenario.spool)], env, scenario.root)
    assert code == 0, out
    assert "0 left" in out and "0 dropped" in out, out
    before = set(range(1, PHASE1_STEPS + 1))
    want = {e: expected(before, in_spool[e]) for e in in_spool}
    scenario.check(want["mlflow"], want["appendlog"], acked)
    assert not any(scenario.spool.iterdir())  # delivered spools are removed

    code, out = run_replay([str(scenario.spool)], env, scenario.root)  # again: nothing to do, nothing twice
    assert code == 0 and "no spool" in out, out
    scenario.check(want["mlflow"], want["appendlog"], acked)


def test_sigkill_then_next_start_with_the_same_spool_dir_delivers_first(scenario):
    acked = scenario.run_until_killed()
    in_spool = {e: scenario.spooled(e) for e in ("mlflow", "appendlog")}
    scenario.tracker_up()
    t = scenario.trainer("trainer-2", FIRST_STEP="1000", LAST_STEP="1002", FLUSH_S="60")
    done = t.wait_event(lambda e: e.get("event") == "done", timeout_s=300)
    assert t.wait(60) == 0, t.stderr()[-3000:]
    assert all(e["delivered"] for e in t.events if e.get("event") == "ack")
    stats = done["stats"]
    for name in ("mlflow", "appendlog"):
        assert stats[name]["dropped"] == 0 and stats[name]["queued"] == 0
        assert stats[name]["replayed"] >= sum(map(len, in_spool[name].values()))  # delivered first
    before, new = set(range(1, PHASE1_STEPS + 1)), {1000, 1001, 1002}
    scenario.check(expected(before, in_spool["mlflow"], new), expected(before, in_spool["appendlog"], new), acked)
    sink = read_sink(scenario.sink)
    second = [e["step"] for e in sink if e["pid"] == t.proc.pid and e["kind"] == "StepMetrics"]
    assert second == sorted(second) and second[-3:] == [1000, 1001, 1002]  # old steps before the new ones
    assert not any(scenario.spool.iterdir())
