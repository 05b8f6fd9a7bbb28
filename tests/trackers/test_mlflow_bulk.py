"""The direct sqlite trace writer of the MLflow exporter (otel_rl_mlflow.direct.traces) against MLflow itself.

The same trajectory records go to two real sqlite stores: one written by the exporter with the
direct writer, one with ``OTEL_RL_MLFLOW_BULK_TRACES=false`` (MLflow's ``log_spans`` +
``link_traces_to_run`` for every trace).  Every row that refers to those traces, in every table
of the store, must be equal (the random association id and its creation time aside), and
MLflow's own read APIs must find the traces as verl documents them.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from typing import Any

import pytest

pytest.importorskip("mlflow")
otel_rl_mlflow = pytest.importorskip("otel_rl_mlflow")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from opentelemetry import trace as trace_api  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, StepMetrics, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402
from otel_rl_mlflow.direct import traces as direct_traces  # noqa: E402
from otel_rl_mlflow._exporter import MlflowExporter  # noqa: E402

from .test_mlflow import calculator, generate, plan, score  # noqa: E402  (the same ops as there)

VOLATILE = {"entity_associations": {"association_id", "created_time"}}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv(direct_traces.ENV_BULK, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# ----------------------------------------------------------------------------- workload


@otel_rl.generate(model="gpt-4o-mini")
def chat(messages: list) -> dict:
    return {"prompt_ids": list(range(12)), "response_ids": [1, 2, 3, 4], "text": "ok"}


@otel_rl.op
def as_json_text(x: int) -> str:
    return json.dumps({"nested": [x, "text"]})  # a string holding JSON: MLflow unwraps one layer


@otel_rl.op
def outer(n: int) -> int:
    return inner(n) + 1


@otel_rl.op
def inner(n: int) -> int:
    return n * 2


def workload(steps: int) -> None:
    for n in range(steps):
        with otel_rl.step(n):
            for i in range(4):
                try:
                    with otel_rl.trajectory(sample_index=i, rollout_n=n % 3, validate=(n % 4 == 3)) as t:
                        if i == 0:  # the common shape
                            plan(f"q{n}-{i}")
                            generate(list(range(5 + n)), temperature=0.5)
                            t.set_reward(score(calculator("2+2", tool_call_id=f"c{n}")))
                        elif i == 1:  # a failing tool call, unicode, a long value
                            generate([1, 2, 3])
                            try:
                                calculator("8/0", tool_call_id=f"e{n}")
                            except ZeroDivisionError:
                                pass
                            plan("数学 🔥 " + "x" * (3000 + n))
                            t.set_reward(0.0)
                        elif i == 2:  # priced model, JSON text output, nested ops, user/session attributes
                            otel_rl.annotate(**{"user.id": f"user-{n}", "session.id": f"sess-{n % 2}"})
                            chat([{"role": "user", "content": f"what is {n}+{n}?"}])
                            as_json_text(n)
                            outer(n)
                        else:  # the trajectory itself fails
                            generate([9])
                            raise RuntimeError(f"agent crashed at step {n}")
                except RuntimeError:
                    pass


def captured(steps: int = 6) -> tuple[list[Trajectory], RunIdentity]:
    cap = CaptureExporter()
    h = otel_rl.init(project="bulk", experiment="e1", exporters=[cap], trace_backend="memory", batch_delay_s=0.02)
    workload(steps)
    assert h.flush(60)
    ident = RunIdentity(h.config.project, h.config.experiment, h.run_id)
    h.shutdown()
    trajs = cap.of_type(Trajectory)
    assert len(trajs) == 4 * steps
    return trajs, ident


def export(uri: str, trajs: list[Trajectory], ident: RunIdentity, batch: int = 4) -> MlflowExporter:
    cfg = resolve(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, trace_backend="mlflow")
    exp = MlflowExporter(cfg, tracking_uri=uri)
    exp.export_records([RunStart(ident, {"a": 1}, 0, time.time_ns())])
    for i in range(0, len(trajs), batch):
        exp.export_records(trajs[i:i + batch])
    return exp


def trace_rows(path: str, ids: list[str], rename: dict | None = None) -> dict[str, list[tuple]]:
    """Every row of every table that refers to one of `ids` (volatile columns left out; values in
    `rename` replaced, e.g. each store's own MLflow run id)."""
    rename = rename or {}
    con = sqlite3.connect(path)
    out: dict[str, list[tuple]] = {}
    marks = ",".join("?" * len(ids))
    for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
        cols = [r[1] for r in con.execute(f"PRAGMA table_info('{table}')")]
        idc = [c for c in cols if c in ("request_id", "trace_id", "source_id", "destination_id")]
        if not idc:
            continue
        keep = [c for c in cols if c not in VOLATILE.get(table, ())]
        where = " OR ".join(f"{c} IN ({marks})" for c in idc)
        rows = con.execute(f"SELECT {', '.join(keep)} FROM '{table}' WHERE {where}", ids * len(idc)).fetchall()
        if rows:
            out[table] = sorted((tuple(rename.get(v, v) for v in r) for r in rows), key=repr)
    con.close()
    return out


def linked_ids(path: Any, run: Any) -> list[str]:
    """The ids of the traces linked to `run` (the exporter's run handle) in the sqlite store at `path`,
    as MLflow's search_traces(run_id=...) finds them."""
    mlflow.set_tracking_uri(f"sqlite:///{path}")
    try:
        found = mlflow.search_traces(locations=[run.experiment_id], run_id=run.run_id, return_type="list",
                                     max_results=1000)
    finally:
        mlflow.set_tracking_uri(None)
    return [t.info.trace_id for t in found]


def ids_of(trajs: list[Trajectory]) -> list[str]:
    return [otel_rl_mlflow.mlflow_trace_id(t.trace_id) for t in trajs]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("batch", [4, 0], ids=["batches of 4", "one batch"])
def test_direct_writes_equal_mlflow_writes(tmp_path, monkeypatch, batch):
    trajs, ident = captured(steps=8)
    fast_db, ref_db = tmp_path / "fast.db", tmp_path / "ref.db"
    fast = export(f"sqlite:///{fast_db}", trajs, ident, batch=batch or len(trajs))
    writer = fast._bulk
    assert writer and writer.state == "on", getattr(writer, "mismatch", None)
    # every shape was written by MLflow once (and verified), the rest directly
    assert writer.mlflow_traces >= 4 and writer.fast_traces >= len(trajs) // 2, (writer.mlflow_traces,
                                                                              writer.fast_traces)
    assert writer.fast_traces + writer.mlflow_traces == len(trajs)
    if not batch:  # all at once: exactly one trace of each shape through MLflow, none twice
        assert writer.mlflow_traces == len(writer.verified), (writer.mlflow_traces, len(writer.verified))
    fast_run = next(iter(fast.runs.values())).run_id
    fast.shutdown()

    monkeypatch.setenv(direct_traces.ENV_BULK, "false")
    ref = export(f"sqlite:///{ref_db}", trajs, ident)
    assert ref._bulk is False
    ref_run = next(iter(ref.runs.values())).run_id
    ref.shutdown()

    ids = ids_of(trajs)
    got = trace_rows(str(fast_db), ids, {fast_run: "<run>"})
    want = trace_rows(str(ref_db), ids, {ref_run: "<run>"})
    assert set(got) == set(want) == {"trace_info", "trace_tags", "trace_request_metadata", "spans",
                                     "entity_associations"}
    for table in want:
        assert got[table] == want[table], table
    # what the workload exercises is really in there
    info = {r[0]: r for r in want["trace_info"]}
    assert len(info) == len(trajs)
    assert {r[4] for r in want["trace_info"]} == {"OK", "ERROR"}
    unwrapped = [r[9] for r in want["spans"] if r[4] == "as_json_text"]
    assert unwrapped and all('\\"nested\\"' in c and '\\\\"nested' not in c for c in unwrapped)


@otel_rl.op
def reply(n: int) -> dict:
    # an op that names no model itself, whose output sometimes does: MLflow then takes it as the span's model
    return {"model": "gpt-4o-mini", "text": f"r{n}"} if n % 2 else {"text": f"r{n}"}


def test_spans_stored_without_mlflow_translation_are_what_mlflow_stores(tmp_path, monkeypatch):
    """Spans of the exporter's own attributes skip MLflow's translation once it was seen to change
    nothing for their signature; values it reads all the same (a model named in an output) send a
    span through it again.  Both stores hold the same rows."""
    cap = CaptureExporter()
    h = otel_rl.init(project="bulk", experiment="e2", exporters=[cap], trace_backend="memory", batch_delay_s=0.02)
    for n in range(8):
        with otel_rl.step(n):
            with otel_rl.trajectory(sample_index=0):
                plan(f"q{n}")
                generate([1, 2, n])
                reply(n)
    assert h.flush(60)
    ident = RunIdentity(h.config.project, h.config.experiment, h.run_id)
    h.shutdown()
    trajs = cap.of_type(Trajectory)
    assert len(trajs) == 8
    fast_db, ref_db = tmp_path / "fast.db", tmp_path / "ref.db"
    fast = export(f"sqlite:///{fast_db}", trajs, ident, batch=2)
    writer = fast._bulk
    assert writer.state == "on" and writer.fast_traces >= 6, (writer.mismatch, writer.fast_traces)
    # root, plan, generate and the replies without a model: 4 spans of each directly written trajectory
    # but the first of each signature; the replies naming a model went through the translation
    assert writer.untranslated_spans >= 6 * 3, writer.untranslated_spans
    fast_run = next(iter(fast.runs.values())).run_id
    fast.shutdown()
    monkeypatch.setenv(direct_traces.ENV_BULK, "false")
    ref = export(f"sqlite:///{ref_db}", trajs, ident, batch=2)
    ref_run = next(iter(ref.runs.values())).run_id
    ref.shutdown()
    ids = ids_of(trajs)
    got = trace_rows(str(fast_db), ids, {fast_run: "<run>"})
    want = trace_rows(str(ref_db), ids, {ref_run: "<run>"})
    assert got == want
    con = sqlite3.connect(ref_db)
    models = con.execute("SELECT model_name FROM spans WHERE name = 'reply'").fetchall()
    con.close()
    assert sorted(m for (m,) in models if m) == ["gpt-4o-mini"] * 4


def test_rows_computed_ahead_are_the_rows_mlflow_writes(tmp_path, monkeypatch):
    """`prepare` (called while the exporter's queue gathers a delivery) builds the MLflow spans and the
    direct writer's rows ahead; the delivery writes exactly those, and the store holds what MLflow
    itself writes for the same trajectories.  Before a shape is verified nothing is done ahead; a
    trace prepared again after it was stored (a re-delivery) goes through MLflow, stored once."""
    trajs, ident = captured(steps=8)
    fast_db, ref_db = tmp_path / "fast.db", tmp_path / "ref.db"
    cfg = resolve(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, trace_backend="mlflow")
    exp = MlflowExporter(cfg, tracking_uri=f"sqlite:///{fast_db}")
    exp.export_records([RunStart(ident, {"a": 1}, 0, time.time_ns())])
    exp.prepare(trajs[:8])  # no trajectory written yet: nothing to work ahead with
    assert not exp._ahead
    first, rest = trajs[:8], trajs[8:]
    for i in range(0, len(first), 4):
        exp.export_records(first[i:i + 4])
    writer = exp._bulk
    assert writer and writer.state == "on", getattr(writer, "mismatch", None)
    exp.prepare(rest)
    ahead = set(writer._ahead)
    assert ahead and ahead <= set(ids_of(rest)) and len(exp._ahead) == len(rest)
    for i in range(0, len(rest), 4):
        exp.export_records(rest[i:i + 4])
    assert writer.prepared_traces == len(ahead) and not writer._ahead and not exp._ahead
    # again, after they were stored: MLflow merges them, nothing is written twice
    exp.prepare(first)
    for i in range(0, len(first), 4):
        exp.export_records(first[i:i + 4])
    assert writer.prepared_traces == len(ahead) and not writer._ahead
    fast_run = next(iter(exp.runs.values())).run_id
    exp.shutdown()

    monkeypatch.setenv(direct_traces.ENV_BULK, "false")
    ref = export(f"sqlite:///{ref_db}", trajs, ident)
    ref_run = next(iter(ref.runs.values())).run_id
    ref.shutdown()
    ids = ids_of(rest)  # (the re-delivered ones carry MLflow's merge: a later payload generation)
    got = trace_rows(str(fast_db), ids, {fast_run: "<run>"})
    want = trace_rows(str(ref_db), ids, {ref_run: "<run>"})
    assert set(got) == set(want)
    for table in want:
        assert got[table] == want[table], table
    assert len(want["trace_info"]) == len(rest)
    stored = trace_rows(str(fast_db), ids_of(first))
    assert len(stored["trace_info"]) == len(stored["entity_associations"]) == len(first)
    assert len(stored["spans"]) == sum(sum(1 for _ in t.root.walk()) for t in first)


def test_traces_read_back_with_mlflow(tmp_path):
    trajs, ident = captured(steps=6)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    exp = export(uri, trajs, ident, batch=6)
    assert exp._bulk.fast_traces > 0
    run_id = next(iter(exp.runs.values())).run_id
    experiment_id = next(iter(exp.runs.values())).experiment_id
    exp.shutdown()
    mlflow.set_tracking_uri(uri)
    try:
        by_id = {otel_rl_mlflow.mlflow_trace_id(t.trace_id): t for t in trajs}
        linked = mlflow.search_traces(locations=[experiment_id], run_id=run_id, return_type="list", max_results=1000)
        assert {t.info.trace_id for t in linked} == set(by_id)
        for step in range(6):
            found = mlflow.search_traces(locations=[experiment_id], filter_string=f"tags.step = '{step}'",
                                         return_type="list", max_results=100)
            assert {t.info.trace_id for t in found} == {k for k, t in by_id.items() if t.step == step}
            for tr in found:
                t = by_id[tr.info.trace_id]
                assert tr.info.tags["sample_index"] == str(t.sample_index)
                assert tr.info.state.value == ("ERROR" if t.root.status == "ERROR" else "OK")
                assert {s.span_id for s in tr.data.spans} == {f"{n.span_id:016x}" for n in t.root.walk()}
        failing = mlflow.search_traces(locations=[experiment_id], filter_string="tags.sample_index = '3'",
                                       return_type="list", max_results=100)
        assert len(failing) == 6 and all(tr.info.state.value == "ERROR" for tr in failing)
        tool = [s for tr in mlflow.search_traces(locations=[experiment_id],
                                                 filter_string="tags.sample_index = '1' AND tags.step = '5'",
                                                 return_type="list") for s in tr.data.spans
                if s.name == "execute_tool calculator"][0]
        assert tool.status.status_code.value == "ERROR" and tool.events[0].name == "exception"
        first = next(t for t in trajs if t.step == 1 and t.sample_index == 0)
        tr = mlflow.get_trace(otel_rl_mlflow.mlflow_trace_id(first.trace_id))
        assert tr.info.token_usage["input_tokens"] == 6 and tr.info.token_usage["output_tokens"] == 3
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.parametrize("batch", [4, 0], ids=["batches of 4", "one batch"])
def test_a_mismatch_turns_the_direct_writer_off(tmp_path, caplog, batch):
    trajs, ident = captured(steps=4)
    cfg = resolve(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, trace_backend="mlflow")
    path = tmp_path / "m.db"
    exp = MlflowExporter(cfg, tracking_uri=f"sqlite:///{path}")
    exp.export_records([RunStart(ident, {}, 0, time.time_ns())])
    client, tracing = exp._clients()
    writer = exp._bulk_writer(tracing)
    real = writer.h["translate_span_when_storing"]

    def drifted(span):  # what a newer MLflow might store that this writer does not know
        d = real(span)
        d["attributes"]["mlflow.newThing"] = '"x"'
        return d

    writer.h["translate_span_when_storing"] = drifted
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        step = batch or len(trajs)
        for i in range(0, len(trajs), step):
            exp.export_records(trajs[i:i + step])
    assert writer.state == "off" and writer.fast_traces == 0 and writer.mlflow_traces == len(trajs)
    assert "spans" in writer.mismatch
    assert any("does not write what MLflow" in r.getMessage() for r in caplog.records)
    exp.shutdown()
    rows = trace_rows(str(path), ids_of(trajs))
    assert len(rows["trace_info"]) == len(trajs)
    assert len(rows["entity_associations"]) == len(trajs)
    assert len(rows["spans"]) == sum(sum(1 for _ in t.root.walk()) for t in trajs)
    assert not any("newThing" in r[9] for r in rows["spans"])


def test_a_redelivered_batch_is_stored_once(tmp_path):
    trajs, ident = captured(steps=4)
    path = tmp_path / "m.db"
    exp = export(f"sqlite:///{path}", trajs, ident)
    fast_before = exp._bulk.fast_traces
    assert fast_before > 0
    # the same records again, as after an export process died before confirming them
    for i in range(0, len(trajs), 4):
        exp.export_records(list(trajs[i:i + 4]))
    assert exp._bulk.fast_traces == fast_before  # existing traces went through MLflow (it merges them)
    exp.shutdown()
    rows = trace_rows(str(path), ids_of(trajs))
    assert len(rows["trace_info"]) == len(trajs)
    assert len(rows["entity_associations"]) == len(trajs)
    assert len(rows["spans"]) == sum(sum(1 for _ in t.root.walk()) for t in trajs)
    assert len(rows["trace_tags"]) == len(set((r[0], r[2]) for r in rows["trace_tags"]))


def test_metrics_written_concurrently_to_the_same_store(tmp_path):
    trajs, ident = captured(steps=10)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(uri)
    other = client.create_run(client.create_experiment("other")).info.run_id
    stop = threading.Event()
    logged: list[int] = []
    errors: list[BaseException] = []

    def log_metrics() -> None:
        n = 0
        try:
            while not stop.is_set():
                client.log_metric(other, "loss", float(n), step=n)
                logged.append(n)
                n += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = threading.Thread(target=log_metrics)
    th.start()
    try:
        exp = export(uri, trajs, ident, batch=2)
        exp.export_records([StepMetrics(ident, 1, {"x": 1.0}, time.time_ns())])
    finally:
        stop.set()
        th.join(30)
    assert not errors
    assert exp._bulk.fast_traces > 0
    exp.shutdown()
    assert len(trace_rows(str(tmp_path / "m.db"), ids_of(trajs))["trace_info"]) == len(trajs)
    assert [m.step for m in client.get_metric_history(other, "loss")] == logged


def test_not_used_where_it_does_not_apply(tmp_path, monkeypatch):
    from mlflow.tracing.client import TracingClient

    sqlite_store = TracingClient(f"sqlite:///{tmp_path / 'a.db'}").store
    assert direct_traces.BulkTraceWriter.for_store(sqlite_store) is not None
    monkeypatch.setenv(direct_traces.ENV_BULK, "false")
    assert direct_traces.BulkTraceWriter.for_store(sqlite_store) is None
    monkeypatch.delenv(direct_traces.ENV_BULK)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    file_store = TracingClient(f"file://{tmp_path / 'mlruns'}").store
    assert direct_traces.BulkTraceWriter.for_store(file_store) is None
    monkeypatch.setenv("MLFLOW_SQL_TRACE_ROLLUPS_ENABLED", "true")
    assert direct_traces.BulkTraceWriter.for_store(sqlite_store) is None


def test_span_content_is_what_mlflow_parses(tmp_path):
    """A span's stored content loads back into MLflow's Span entity with the op's inputs and outputs."""
    trajs, ident = captured(steps=3)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    exp = export(uri, trajs, ident, batch=4)
    assert exp._bulk.fast_traces > 0
    exp.shutdown()
    t = next(t for t in trajs if t.step == 2 and t.sample_index == 0)  # written directly (shape verified at step 0)
    tr = MlflowClient(uri).get_trace(otel_rl_mlflow.mlflow_trace_id(t.trace_id))
    spans = {s.name: s for s in tr.data.spans}
    assert spans["plan"].inputs == {"question": "q2-0"}
    assert spans["chat policy-7b"].attributes["mlflow.chat.tokenUsage"]["input_tokens"] == 7
    assert spans["execute_tool calculator"].outputs == 4.0
    assert trace_api.format_trace_id(t.trace_id) in tr.info.trace_id


def test_large_deliveries_one_transaction_and_mlflow_calls_within_its_limits(tmp_path):
    # a gathered delivery (export_interval_s) holds more traces than MLflow takes in one call (100 trace
    # links): MLflow's calls (the shapes' probes) are split, the direct writer takes the rest at once
    trajs, ident = captured(steps=60)
    stores = {}
    first = [t for t in trajs if t.sample_index == 0][:2]  # one shape verified; 180 of the other shapes follow
    rest = [t for t in trajs if t not in first]
    for name, batches in (("one-delivery", [trajs]), ("verified-first", [first, rest])):
        path = tmp_path / f"{name}.db"
        cfg = resolve(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, trace_backend="mlflow")
        exp = MlflowExporter(cfg, tracking_uri=f"sqlite:///{path}")
        exp.export_records([RunStart(ident, {"a": 1}, 0, time.time_ns())])
        for b in batches:
            exp.export_records(b)
        writer = exp._bulk
        assert writer.state == "on" and writer.fast_traces + writer.mlflow_traces == len(trajs)
        run = next(iter(exp.runs.values()))
        exp.shutdown()
        linked = linked_ids(path, run)
        assert len(set(linked)) == len(linked) == len(trajs) == 240
        stores[name] = trace_rows(str(path), ids_of(trajs), {run.run_id: "<run>"})
    assert stores["verified-first"]["spans"] and stores["one-delivery"] == stores["verified-first"]


def test_quick_sanitize_stores_what_mlflow_sanitize_stores():
    # the writer's translation uses direct_traces.quick_sanitize where MLflow's uses sanitize_attributes
    import random

    from mlflow.tracing.otel.translation import sanitize_attributes

    rng = random.Random(7)
    atoms = ["x", 'a "quoted" word', "{bad", "[1, 2", "1", "-2.5e3", "true", "null", "数学 🔥", "\\", " ", "", "\t{}"]
    values: list = [1, 2.5, True, None, ["a", "b"], b'"\\"x\\""', b"{}", "\x0b\"x\"", " \n\"y\"", '"\u00a0{}"',
                    '"', '""', '"{', '"abc', '"a" "b"', '"\\u0022{}\\u0022"', '"\\u007b}"', '"\\t\\"x\\""', '" \\"1\\""',
                    '"\u2003[1]"', ' "x"', '\n"\\"{}\\""']
    for _ in range(400):
        base = rng.choice([rng.choice(atoms), {"k": rng.choice(atoms)}, [rng.choice(atoms), 3], 7, rng.choice(atoms)])
        text = json.dumps(base) if not isinstance(base, str) or rng.random() < 0.5 else base
        for _ in range(rng.randint(0, 3)):  # encoded again 0-3 times, with blanks around now and then
            text = json.dumps(text)
            if rng.random() < 0.2:
                text = rng.choice([" ", "\t", "\n", "\r"]) + text
        values.append(text)
    attrs = {f"k{i}": v for i, v in enumerate(values)}
    want = sanitize_attributes(attrs)
    got = direct_traces.quick_sanitize(attrs)
    assert [(k, type(v), v) for k, v in got.items()] == [(k, type(v), v) for k, v in want.items()]
    assert sum(1 for k in attrs if want[k] is not attrs[k]) > 20  # the corpus has values MLflow unwraps
    # and the writer's translation is MLflow's with that one change
    from mlflow.tracing.otel.translation import translate_span_when_storing

    quick = direct_traces.writer_translation(translate_span_when_storing)
    assert quick is not translate_span_when_storing and quick.__code__ is translate_span_when_storing.__code__
    assert quick.__globals__["sanitize_attributes"] is direct_traces.quick_sanitize
    assert translate_span_when_storing.__globals__["sanitize_attributes"] is sanitize_attributes
    # ... and the cost lookup that remembers the models without a price; MLflow's own is untouched
    from mlflow.tracing.utils import calculate_cost_by_model_and_token_usage as mlflow_cost

    assert hasattr(quick.__globals__["calculate_cost_by_model_and_token_usage"], "unpriced")
    assert translate_span_when_storing.__globals__["calculate_cost_by_model_and_token_usage"] is mlflow_cost


def test_the_writers_cost_lookup_prices_what_mlflow_prices_and_skips_only_models_without_a_price():
    from mlflow.tracing.utils import calculate_cost_by_model_and_token_usage as mlflow_cost

    calls = []

    def counted(*args):
        calls.append(args[0])
        return mlflow_cost(*args)

    cost = direct_traces.unpriced_models_remembered(counted)
    usages = [{"input_tokens": 0, "output_tokens": 0}, {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8},
              {"input_tokens": 1200, "output_tokens": 0}, {"output_tokens": 7}, {}, None]
    models = ["tiny-transformer", "gpt-4o-mini", "gpt-4o", "my-org/ckpt-1000", "", None]
    priced = set()
    for _ in range(2):
        for model in models:
            for usage in usages:
                want = mlflow_cost(model, usage, None)
                assert cost(model, usage, None) == want, (model, usage)
                if want:
                    priced.add(model)
    assert {"gpt-4o-mini", "gpt-4o"} <= priced  # MLflow's bundled prices: real costs compared
    assert cost.unpriced == {"tiny-transformer", "my-org/ckpt-1000"}
    # a model without a price is looked up until it has had tokens to price, then no more; priced ones always
    assert calls.count("tiny-transformer") == 2 and calls.count("gpt-4o-mini") == 2 * len(usages)


def test_a_retried_delivery_resumes_where_it_failed(tmp_path):
    # the first delivery is cut in MLflow-sized chunks (the writer is still probing); the second chunk
    # fails; by the retry the writer is on, and the retry must still resume with the same chunks
    trajs, ident = captured(steps=60)
    path = tmp_path / "retry.db"
    cfg = resolve(project=ident.project, experiment=ident.experiment, run_id=ident.run_id, trace_backend="mlflow")
    exp = MlflowExporter(cfg, tracking_uri=f"sqlite:///{path}")
    exp.export_records([RunStart(ident, {"a": 1}, 0, time.time_ns())])
    real = exp._log_traces
    calls = []

    def flaky(*args):
        calls.append(len(args[-1]))
        if len(calls) == 2:
            raise ConnectionError("store away")
        return real(*args)

    exp._log_traces = flaky
    with pytest.raises(ConnectionError):
        exp.export_records(trajs)
    assert exp._bulk.state == "on" and calls == [100, 100]
    exp.export_records(trajs)  # the queue's retry: the same batch
    assert calls[2:] == [100, 40]
    run = next(iter(exp.runs.values()))
    exp.shutdown()
    assert sorted(linked_ids(path, run)) == sorted(ids_of(trajs))


def test_attribute_texts_of_repeated_scalars_are_their_json():
    """Short scalar attribute values keep their JSON text (kinds, names, steps repeat from span to span);
    a value equal to another of another type (True and 1, 1 and 1.0) keeps its own; the memory is bounded."""
    from otel_rl_mlflow import _traces

    values = [True, 1, 1.0, "1", 0, False, "LLM", "数学", "x" * 65, (1, "a"), None, 2 ** 70, float("nan")]
    want = [json.dumps(list(v) if isinstance(v, tuple) else v, ensure_ascii=False) for v in values]
    for _ in range(2):  # computed, then remembered
        assert [_traces._attr(v) for v in values] == want
    for i in range(_traces._SCALARS_MAX + 10):
        assert _traces._attr(f"k{i}") == f'"k{i}"'
    assert len(_traces._SCALARS) <= _traces._SCALARS_MAX


def test_remembered_helpers_give_what_mlflows_give(tmp_path):
    """The writer's shortcuts to MLflow's pure helpers (a trace's artifact location built from one call per
    experiment, JSON texts and tags remembered) give what the helpers themselves give, for ids and values of
    every kind, and stay with MLflow's answer for what they do not cover."""
    from mlflow.store.tracking import sqlalchemy_store as m
    from mlflow.tracing.client import TracingClient
    from mlflow.utils.uri import append_to_uri_path

    store = TracingClient(f"sqlite:///{tmp_path / 'a.db'}").store
    writer = direct_traces.BulkTraceWriter.for_store(store)
    assert writer is not None
    roots = [str(tmp_path / "art dir"), f"file://{tmp_path}/x y", "s3://bucket/some/prefix", "mlflow-artifacts:/1",
             "dbfs:/databricks/mlflow", "http://host:5000/a?b=c"]
    ids = [otel_rl_mlflow.mlflow_trace_id(0xABC), otel_rl_mlflow.mlflow_trace_id(2**128 - 1),
           "tr-XYZ", "tr-" + "0" * 31, "plain-id", "tr-" + "a" * 32 + "/b"]
    for n, root in enumerate(roots):
        eid = store.create_experiment(f"e{n}", artifact_location=root)
        made = writer._trace_artifact_location(eid)
        for tid in ids:
            assert made(tid) == append_to_uri_path(root, "traces", tid, "artifacts"), (root, tid)
        assert writer._trace_artifact_location(eid) is made  # once per experiment

    values = ['"LLM"', '"TOOL"', '"tiny-transformer"', "3", "true", "null", '{"a": 1}', "[1, 2]", "not json", "",
              '"x"' * 200, None, 7]
    for _ in range(2):  # the second time from the memo
        for v in values:
            assert writer._parsed(v) == m._try_parse_json_string(v), v
    listed = [1, 2]
    assert writer._parsed(listed) is listed  # not a text: as MLflow, given back as it is

    for key, value in [("step", "3"), ("rl.sample_index", "0"), ("k", "v" * 300)]:
        for _ in range(2):
            assert writer._validate_tag(key, value) == m._validate_trace_tag(key, value)
    for _ in range(2):  # a failure is raised every time, as MLflow raises it
        with pytest.raises(Exception) as mine:
            writer._validate_tag("", "v")
        with pytest.raises(Exception) as theirs:
            m._validate_trace_tag("", "v")
        assert type(mine.value) is type(theirs.value)


def test_one_switch_turns_every_direct_writer_off(tmp_path, monkeypatch):
    from mlflow.tracing.client import TracingClient
    from mlflow.tracking import MlflowClient

    from otel_rl_mlflow import direct
    from otel_rl_mlflow.direct import metrics as direct_metrics
    from otel_rl_mlflow.direct.store import create_sqlite_store

    monkeypatch.setenv(direct.ENV_DIRECT, "false")
    assert create_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}") is False  # MLflow builds it itself
    assert not (tmp_path / "new.db").exists()
    uri = f"sqlite:///{tmp_path / 'a.db'}"
    traces_store = TracingClient(uri).store
    metrics_store = MlflowClient(uri)._tracking_client.store
    assert direct_traces.BulkTraceWriter.for_store(traces_store) is None
    assert direct_metrics.BulkMetricWriter.for_store(metrics_store) is None
    monkeypatch.setenv(direct.ENV_DIRECT, "true")  # on again: both apply to this store
    assert direct_traces.BulkTraceWriter.for_store(traces_store) is not None
    assert direct_metrics.BulkMetricWriter.for_store(metrics_store) is not None
