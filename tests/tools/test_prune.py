"""`otel-rl prune` on a real MLflow store, real spool directories and JSONL files."""

from __future__ import annotations

import io
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from otel_rl import cli
from otel_rl.prune import TracePolicy, TraceRow, decide, human, parse_cutoff
from otel_rl.records import RunIdentity, StepMetrics
from otel_rl.spool.codec import encode_batch
from otel_rl.spool.replay import replay_one
from otel_rl.spool.store import Spool, SpoolOptions

from .conftest import FAILED, PROJECT, REPO, STEPS, TRACE_TABLES, VALIDATION_STEPS, SAMPLES


@pytest.fixture
def db(store, tmp_path):
    copy = tmp_path / "mlflow.db"
    shutil.copy(store, copy)
    return copy


def client_of(db: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{db}")


def all_traces(client):
    exp = client.get_experiment_by_name(PROJECT)
    out, token = [], None
    while True:
        page = client.search_traces(
            locations=[exp.experiment_id], include_spans=False, max_results=500, page_token=token
        )
        out += list(page)
        token = page.token
        if not token:
            return out


def key(t):
    tags = t.info.tags
    return int(tags["step"]), int(tags["sample_index"]), tags["validate"] == "True"


def prune(*args) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main(["prune", *args])
    return rc, buf.getvalue()


def rows_left(db: Path, trace_ids: set[str]) -> dict[str, int]:
    con = sqlite3.connect(db)
    try:
        out = {}
        for table in TRACE_TABLES:
            cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
            col = "request_id" if "request_id" in cols else "trace_id"
            out[table] = sum(1 for (tid,) in con.execute(f"SELECT {col} FROM {table}") if tid in trace_ids)
        out["entity_associations"] = sum(
            1
            for (tid,) in con.execute(
                "SELECT source_id FROM entity_associations WHERE source_type = 'TRACE' OR source_type = 'trace'"
            )
            if tid in trace_ids
        )
        return out
    finally:
        con.close()


def test_decide_keeps_exactly_the_policy_set():
    rows = [
        TraceRow(f"t{s}-{v}-{f}", s, v, f, 100.0 + s)
        for s in range(1, 11)
        for v in (False, True)
        for f in (False, True)
    ]
    gone, kept = decide(rows, TracePolicy(keep_last_steps=3, keep_every=4), running=False)
    assert {(r.step, r.validate, r.failed) for r in gone} == {(s, False, False) for s in (1, 2, 3, 5, 6, 7)}
    assert sum(kept.values()) + len(gone) == len(rows)
    gone, _ = decide(rows, TracePolicy(keep_last_steps=3, include_failed=True, include_validation=True), running=True)
    assert {r.step for r in gone} == set(range(1, 8))  # the newest step of a running run stays in any case
    gone, _ = decide(rows, TracePolicy(older_than=105.0), running=False)  # date alone: steps logged before it
    assert {r.step for r in gone} == {1, 2, 3, 4} and not any(r.failed or r.validate for r in gone)
    gone, _ = decide(rows, TracePolicy(older_than=105.0, keep_last_steps=8), running=False)  # both must hold
    assert {r.step for r in gone} == {1, 2}


def test_parse_cutoff_dates_and_ages():
    assert parse_cutoff("2026-01-31") == 1769817600.0
    assert parse_cutoff("30d", now=1e9) == 1e9 - 30 * 86400
    with pytest.raises(ValueError, match="expected a date"):
        parse_cutoff("last tuesday")


@pytest.mark.slow
def test_dry_run_deletes_nothing(db):
    client = client_of(db)
    before = len(all_traces(client))
    rc, out = prune("--tracking-uri", f"sqlite:///{db}", "--experiment", PROJECT, "--keep-last-steps", "4")
    assert rc == 0 and "would delete" in out and "nothing was deleted (dry run)" in out
    assert len(all_traces(client_of(db))) == before == STEPS * SAMPLES + 2 * len(VALIDATION_STEPS)


@pytest.mark.slow
def test_yes_deletes_exactly_the_policy_set_and_leaves_no_rows(db):
    client = client_of(db)
    traces = all_traces(client)
    run = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])[0]
    metrics_before = client.get_metric_history(run.info.run_id, "critic/score/mean")
    want_kept = {
        key(t) for t in traces if key(t)[0] > STEPS - 4 or key(t)[0] % 5 == 0 or key(t)[2] or key(t)[:2] in FAILED
    }
    rc, out = prune(
        "--tracking-uri",
        f"sqlite:///{db}",
        "--experiment",
        PROJECT,
        "--keep-last-steps",
        "4",
        "--keep-every",
        "5",
        "--yes",
    )
    assert rc == 0, out
    after = all_traces(client_of(db))
    assert {key(t) for t in after} == want_kept
    gone = {t.info.trace_id for t in traces} - {t.info.trace_id for t in after}
    assert len(gone) == len(traces) - len(want_kept) and f"deleted {len(gone)} (steps 1-8)" in out
    assert set(rows_left(db, gone).values()) == {0}
    assert len(client_of(db).get_metric_history(run.info.run_id, "critic/score/mean")) == len(metrics_before)
    rc, out = prune(
        "--tracking-uri",
        f"sqlite:///{db}",
        "--experiment",
        PROJECT,
        "--keep-last-steps",
        "4",
        "--keep-every",
        "5",
        "--yes",
    )
    assert "deleted 0" in out  # the policy applied twice changes nothing more


@pytest.mark.slow
def test_running_runs_newest_step_is_never_touched(db):
    client = client_of(db)
    run = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])[0]
    client.update_run(run.info.run_id, status="RUNNING")
    rc, out = prune(
        "--tracking-uri",
        f"sqlite:///{db}",
        "--mlflow-run-id",
        run.info.run_id,
        "--keep-last-steps",
        "1",
        "--include-failed",
        "--include-validation",
        "--older-than",
        "0s",
        "--yes",
    )
    assert rc == 0, out
    assert {key(t)[0] for t in all_traces(client_of(db))} == {STEPS}
    assert "newest step of a running run" in out


@pytest.mark.slow
def test_pruned_store_served_by_mlflow_server_lists_the_same_traces(db, tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    from _mlflow_server import MlflowServer

    prune("--tracking-uri", f"sqlite:///{db}", "--experiment", PROJECT, "--keep-last-steps", "3", "--yes")
    local = {t.info.trace_id for t in all_traces(client_of(db))}
    srv = MlflowServer(tmp_path)
    shutil.copy(db, tmp_path / "server.db")
    srv.start()
    try:
        from mlflow import MlflowClient

        remote = MlflowClient(srv.url)
        served = all_traces(remote)
        assert {t.info.trace_id for t in served} == local
        for tid in sorted(local)[:5]:
            assert remote.get_trace(tid).data.spans  # every kept trace still opens with its spans
    finally:
        srv.kill()


def _spool(path: Path, frames: int, deliver: int) -> Spool:
    sp = Spool(SpoolOptions(path=str(path), meta={"exporter": "mlflow", "class": "x:y", "config": {}}))
    assert sp.open()
    for step in range(frames):
        sp.append(encode_batch([], [StepMetrics(RunIdentity("p", "e", "r"), step, {"a": 1.0}, step)], False), 1)
    for _ in range(deliver):
        sp.advance(sp.peek())
    return sp


def test_spool_delivered_segments_go_pending_ones_stay(tmp_path):
    root = tmp_path / "spool"
    _spool(root / "done", 3, 3).close(remove_if_empty=False)  # all delivered, directory left behind
    _spool(root / "waiting", 4, 1).close(remove_if_empty=False)
    busy = _spool(root / "busy", 2, 2)  # held by a live owner
    try:
        rc, out = prune("--spool", str(root))
        assert rc == 0 and (root / "done").is_dir() and "would delete the whole directory" in out
        rc, out = prune("--spool", str(root), "--yes")
        assert rc == 0, out
        assert not (root / "done").exists()
        assert "busy: in use by a running process; skipped" in out and (root / "busy").is_dir()
        r = replay_one(str(root / "waiting"), list_only=True)
        assert r.pending_items == 3  # undelivered items untouched
    finally:
        busy.close(remove_if_empty=False)


def test_old_jsonl_files_go_recent_ones_stay(tmp_path):
    old, new = tmp_path / "p" / "old.jsonl", tmp_path / "p" / "new.jsonl"
    old.parent.mkdir()
    old.write_text('{"step":1,"data":{"a":1}}\n' * 100)
    new.write_text('{"step":1,"data":{"a":1}}\n')
    (tmp_path / "p" / "notes.txt").write_text("kept")
    t = time.time() - 40 * 86400
    os.utime(old, (t, t))
    rc, out = prune("--jsonl", str(tmp_path), "--older-than", "30d")
    assert rc == 0 and old.exists() and "would delete, 2.5 KiB" in out
    rc, out = prune("--jsonl", str(tmp_path), "--older-than", "30d", "--yes")
    assert not old.exists() and new.exists() and (tmp_path / "p" / "notes.txt").exists()


_WRITER = """
import sys, otel_rl
h = otel_rl.init(["trainer.logger=[file]", "trainer.project_name=p", "trainer.experiment_name=live"])
otel_rl.log({"a": 1.0}, step=1)
h.flush()
print("logged", flush=True)
sys.stdin.readline()  # silent for as long as the test wants
otel_rl.log({"a": 2.0}, step=2)
"""


def test_a_silent_running_trainers_jsonl_file_is_kept(tmp_path):
    """Old by its last write, but a running trainer still holds it open: kept; gone once the trainer ended."""
    path = tmp_path / "live.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(path), "OTEL_RL_SPOOL_DIR": str(tmp_path / "spool")}
    p = subprocess.Popen([sys.executable, "-c", _WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env, cwd=tmp_path)
    try:
        while "logged" not in (line := p.stdout.readline()):
            assert line, "the trainer ended early"
        t = time.time() - 40 * 86400
        os.utime(path, (t, t))
        rc, out = prune("--jsonl", str(tmp_path), "--older-than", "30d", "--yes")
        assert rc == 0 and path.exists() and "kept, a running process writes it" in out, out
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
    assert path.read_text().count("\n") == 2  # the trainer went on writing after the prune
    os.utime(path, (t, t))
    rc, out = prune("--jsonl", str(tmp_path), "--older-than", "30d", "--yes")
    assert rc == 0 and not path.exists(), out


def test_bad_arguments_are_refused():
    assert prune("--experiment", "x")[0] == 2  # no criterion
    assert prune("--jsonl", "/tmp")[0] == 2  # no date
    assert prune("--spool", "/tmp", "--keep-every", "0")[0] == 2


def test_spool_segments_before_the_ack_go_the_rest_replays_whole(tmp_path):
    """A process that died after moving the ack past a segment but before unlinking it leaves a delivered
    segment behind: prune removes exactly those, and the spool still opens with every undelivered item."""
    path = tmp_path / "spool" / "mlflow"
    sp = Spool(
        SpoolOptions(path=str(path), segment_bytes=4096, meta={"exporter": "mlflow", "class": "x:y", "config": {}})
    )
    assert sp.open()
    for step in range(60):
        metrics = {f"k{i}": float(step) for i in range(20)}
        sp.append(encode_batch([], [StepMetrics(RunIdentity("p", "e", "r"), step, metrics, step)], False), 1)
    segs = sorted(path.glob("*.seg"))
    assert len(segs) >= 4, segs
    first = {p.name: p.read_bytes() for p in segs[:2]}
    delivered = 0
    while any((path / n).exists() for n in first):  # deliver until the first two segments are gone
        sp.advance(sp.peek())
        delivered += 1
    sp.close(remove_if_empty=False)
    for name, data in first.items():  # put them back, as a crash before the unlink leaves them
        (path / name).write_bytes(data)
    rc, out = prune("--spool", str(tmp_path / "spool"))
    size = sum(len(d) for d in first.values())
    assert rc == 0 and all((path / n).exists() for n in first)
    assert f"would delete 2 delivered segment(s), {human(size)}" in out, out
    rc, out = prune("--spool", str(tmp_path / "spool"), "--yes")
    assert rc == 0 and f"deleted 2 delivered segment(s), {human(size)}" in out, out
    assert not any((path / n).exists() for n in first)
    assert sorted(p.name for p in path.glob("*.seg")) == [p.name for p in segs[2:]]
    assert replay_one(str(path), list_only=True).pending_items == 60 - delivered
    sp = Spool(
        SpoolOptions(path=str(path), segment_bytes=4096, meta={"exporter": "mlflow", "class": "x:y", "config": {}})
    )
    assert sp.open()
    try:
        from otel_rl.spool.codec import decode_batch

        steps = [m.step for f in sp.iter_pending() for m in decode_batch(f.payload)[1]]
    finally:
        sp.close(remove_if_empty=False)
    assert steps == list(range(delivered, 60))


@pytest.mark.slow
def test_deletion_goes_in_batches_of_delete_batch_ids(db, monkeypatch):
    from mlflow import MlflowClient

    from otel_rl import prune as prune_mod

    calls: list[int] = []

    class Counting(MlflowClient):
        def delete_traces(self, experiment_id, *args, trace_ids=None, **kw):
            calls.append(len(trace_ids))
            return super().delete_traces(experiment_id, *args, trace_ids=trace_ids, **kw)

    monkeypatch.setattr(prune_mod, "DELETE_BATCH", 7)
    client = Counting(f"sqlite:///{db}")
    runs = prune_mod.mlflow_runs(client, PROJECT, None)
    n, nbytes = prune_mod.prune_traces(client, runs, TracePolicy(keep_last_steps=2), True, io.StringIO())
    assert n == sum(calls) and nbytes > 0
    assert calls == [7] * (n // 7) + ([n % 7] if n % 7 else [])
    assert len(all_traces(client_of(db))) == STEPS * SAMPLES + 2 * len(VALIDATION_STEPS) - n
