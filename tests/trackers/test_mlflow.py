"""The MLflow exporter against real MLflow stores: a sqlite file and a real `mlflow server`.

Every test runs an instrumented workload through `otel_rl.init(..., exporters=["mlflow"])`,
shuts the pipeline down and reads everything back with MLflow's own client APIs
(`get_metric_history`, `search_runs`, `mlflow.search_traces`, `load_table`), comparing every
value with what the core recorded (a `CaptureExporter` runs beside the MLflow exporter).
No mocks.  The server is started once for the module (it takes several seconds).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("mlflow")
otel_rl_mlflow = pytest.importorskip("otel_rl_mlflow")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl import semconv as sc  # noqa: E402
from otel_rl.exporters.tracker import flatten_config  # noqa: E402
from otel_rl.records import StepMetrics, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402

from _mlflow_server import VENV_BIN, MlflowServer  # noqa: E402  (tests/ is on sys.path)
MLFLOW_MAX = 1.7976931348623157e308  # what MLflow stores for +Inf
LONG_KEY = "actor/" + "very_long_metric_name_" * 14  # > 250 characters
EXPECTED_KEYS = {  # keys MLflow rejects -> what we log (verl's rule, the long-key rule)
    "val-core/acc@5": "val-core/acc_at_5",
    "val-aux//reward/mean": "val-aux/reward/mean",
    "rollout/🔥hot": "rollout/_hot",
    "/leading/slash": "leading/slash",
    LONG_KEY: LONG_KEY[: 250 - 9] + "-" + hashlib.sha1(LONG_KEY.encode()).hexdigest()[:8],
}
CONFIG = {
    "trainer": {"project_name": "ignored-here", "total_epochs": 3, "logger": ["console", "mlflow"],
                "nested": {"empty": {}, "path": "/tmp/x"}},
    "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16}},
    "data": {"files": ["a.parquet", "b.parquet"], "weird key@": True},
    "long": "v" * 7000,
}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    if not (VENV_BIN / "mlflow").exists():
        pytest.skip("the mlflow CLI is not installed")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    # one database for the module: creating one runs MLflow's migrations (seconds)
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-sqlite')}/mlflow.db"


@pytest.fixture(autouse=True)
def _mlflow_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.chdir(tmp_path)  # the sqlite store puts artifacts under ./mlruns
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown()


@pytest.fixture(params=["sqlite", "server"])
def store_uri(request, monkeypatch):
    uri = request.getfixturevalue("sqlite_uri") if request.param == "sqlite" else \
        request.getfixturevalue("mlflow_server").url
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _project(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------- workload


@otel_rl.op
def plan(question: str) -> dict:
    return {"question": question, "plan": ["think", "compute"]}


@otel_rl.generate(model="policy-7b")
def generate(prompt_ids: list, temperature: float = 1.0) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": [7, 8, 9], "text": "x = 4"}


@otel_rl.tool(name="calculator")
def calculator(expression: str, tool_call_id: str) -> float:
    if "/0" in expression:
        raise ZeroDivisionError(f"cannot evaluate {expression}")
    return 4.0


@otel_rl.op(kind="REWARD")
def score(answer: float) -> float:
    return 1.0 if answer == 4.0 else 0.0


def workload(steps: int = 3, samples: int = 2) -> None:
    for n in range(1, steps + 1):
        with otel_rl.step(n):
            with otel_rl.timer("gen"):
                for i in range(samples):
                    with otel_rl.trajectory(sample_index=i, rollout_n=n % 2) as t:
                        plan(f"q{n}-{i}")
                        generate(list(range(5 + i)), temperature=0.5)
                        try:
                            answer = calculator("8/0" if (n, i) == (2, 0) else "2+2", tool_call_id=f"call-{n}-{i}")
                        except ZeroDivisionError:
                            answer = float("nan")
                        t.set_reward(score(answer))
            otel_rl.log({
                "actor/pg_loss": 0.5 / n, "critic/score/mean": float(n), "perf/tokens": 1000 * n, "flag/done": n == 3,
                "val-core/acc@5": 0.25 * n, "val-aux//reward/mean": -1.0 * n, "指标/损失": 0.1 * n,
                "rollout/🔥hot": n, "/leading/slash": n, LONG_KEY: n, "nan/metric": math.nan,
                "inf/pos": math.inf if n != 2 else 1.0, "inf/neg": -math.inf if n == 2 else 0.0,
            }, step=n)
            otel_rl.log({"actor/pg_loss": 0.1 / n}, step=n)  # a second log() at the same step: both points kept
        if n >= 2:
            otel_rl.log_generations([(f"prompt {n}-{j}", f"answer {n}-{j}", j / 2) for j in range(3)]
                                    + [("no score", "", None)], step=n)


def run_instrumented(project: str, experiment: str = "grpo-1", run_id: str | None = None,
                     fn=workload, **kw) -> tuple[CaptureExporter, str]:
    cap = CaptureExporter()
    extra = {"run_id": run_id} if run_id else {}
    h = otel_rl.init(CONFIG, project=project, experiment=experiment, exporters=["mlflow", cap],
                     trace_backend="mlflow", batch_delay_s=0.05, **extra, **kw)
    cap.handle = h
    fn()
    assert h.flush(120)
    rid = h.run_id
    stats = h.stats()["exporters"]["mlflow"]
    h.shutdown()
    assert stats["dropped"] == 0 and stats["failed_attempts"] == 0, stats
    return cap, rid


# ----------------------------------------------------------------------------- read back


def mlflow_key(key: str) -> str:
    return EXPECTED_KEYS.get(key, key)


def expected_points(cap: CaptureExporter) -> dict[str, list[tuple[int, int, float]]]:
    out: dict[str, list[tuple[int, int, float]]] = {}
    for r in cap.of_type(StepMetrics):
        for k, v in r.values.items():
            f = float(v)
            f = MLFLOW_MAX if f == math.inf else -MLFLOW_MAX if f == -math.inf else f
            out.setdefault(mlflow_key(k), []).append((r.step, r.time_ns // 1_000_000, f))
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def get_run(client: MlflowClient, project: str):
    exp = client.get_experiment_by_name(project)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return exp, runs[0]


def check_metrics(client: MlflowClient, run, cap: CaptureExporter) -> None:
    expected = expected_points(cap)
    assert set(run.data.metrics) == set(expected)
    total = 0
    for key, points in expected.items():
        hist = client.get_metric_history(run.info.run_id, key)
        got = sorted(((m.step, m.timestamp, m.value) for m in hist), key=lambda p: (p[0], p[1], str(p[2])))
        want = sorted(points, key=lambda p: (p[0], p[1], str(p[2])))
        assert len(got) == len(want), (key, got, want)
        for g, w in zip(got, want):
            assert g[:2] == w[:2] and _same(g[2], w[2]), (key, g, w)
        total += len(got)
    assert total == sum(len(r.values) for r in cap.of_type(StepMetrics))


def check_params(run, config: dict) -> None:
    renamed = {"data/weird key@": "data/weird key_at_"}
    want = {renamed.get(k, k): v if isinstance(v, str) else str(v) for k, v in flatten_config(config).items()}
    got = dict(run.data.params)
    long_value = got.pop("long")
    assert long_value.startswith("v" * 5000) and long_value.endswith("chars]") and len(long_value) == 6000
    del want["long"]
    assert got == want
    assert got["data/weird key_at_"] == "True"
    assert got["data/files/list_len"] == "2" and got["data/files/1"] == "b.parquet"
    assert got["trainer/nested/empty"] == "{}"


def traces_of(experiment_id: str, **kw) -> list:
    return mlflow.search_traces(locations=[experiment_id], return_type="list", max_results=1000, **kw)


SPAN_TYPE_OF = {"plan": "CHAIN", "chat policy-7b": "LLM", "execute_tool calculator": "TOOL", "score": "EVALUATOR"}


def check_trace(trace, t: Trajectory) -> None:
    info = trace.info
    assert info.trace_id == otel_rl_mlflow.mlflow_trace_id(t.trace_id)
    for k, v in t.tags().items():
        assert info.tags[k] == v
    assert info.tags["mlflow.traceName"] == t.name
    check_rollout_preview(trace, t)
    assert info.state.value == ("ERROR" if t.root.status == "ERROR" else "OK")
    nodes = {f"{n.span_id:016x}": n for n in t.root.walk()}
    spans = {s.span_id: s for s in trace.data.spans}
    assert set(spans) == set(nodes)
    usage_in = usage_out = 0
    for sid, node in nodes.items():
        s = spans[sid]
        assert s.name == node.name
        assert s.start_time_ns == node.start_ns and s.end_time_ns == node.end_ns
        assert s.parent_id == (None if node is t.root else f"{node.parent_id:016x}")
        assert s.span_type == ("AGENT" if node is t.root else SPAN_TYPE_OF[node.name])
        assert s.status.status_code.value == ("ERROR" if node.status == "ERROR" else
                                              "OK" if node.status == "OK" else "UNSET")
        if node.inputs is not None:
            assert s.inputs == json.loads(node.inputs)
        if node.output is not None:
            assert s.outputs == json.loads(node.output)
        assert [e.name for e in s.events] == [e["name"] for e in node.events]
        for e, ne in zip(s.events, node.events):
            assert e.timestamp == ne["time_ns"]
            assert e.attributes[sc.EXCEPTION_TYPE] == ne["attributes"][sc.EXCEPTION_TYPE]
            assert e.attributes[sc.EXCEPTION_MESSAGE] == ne["attributes"][sc.EXCEPTION_MESSAGE]
            assert sc.EXCEPTION_STACKTRACE in e.attributes
        for k, v in node.attributes.items():
            got = s.attributes[k]
            assert got == (list(v) if isinstance(v, tuple) else v), (k, got, v)
        if sc.GEN_AI_USAGE_INPUT_TOKENS in node.attributes:
            tin, tout = node.attributes[sc.GEN_AI_USAGE_INPUT_TOKENS], node.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS]
            assert s.attributes["mlflow.chat.tokenUsage"] == {"input_tokens": tin, "output_tokens": tout,
                                                              "total_tokens": tin + tout}
            assert s.attributes["mlflow.llm.model"] == "policy-7b"
            usage_in, usage_out = usage_in + tin, usage_out + tout
    assert info.token_usage == {"input_tokens": usage_in, "output_tokens": usage_out,
                                "total_tokens": usage_in + usage_out}


def check_rollout_preview(trace, t: Trajectory) -> None:
    """The root span shows the rollout (the workload's prompt ids, reply text, reward and coordinates), and
    the trace list's Request / Response columns are made of it."""
    reward = 0.0 if (t.step, t.sample_index) == (2, 0) else 1.0  # the failed calculator call scores 0
    assert t.tags()["reward"] == str(reward)
    inputs = {"prompt": list(range(5 + t.sample_index)), "step": t.step, "sample_index": t.sample_index,
              "rollout_n": t.step % 2, "validate": False}
    outputs = {"response": "x = 4", "reward": reward}
    root = next(s for s in trace.data.spans if s.parent_id is None)
    assert root.inputs == inputs and root.outputs == outputs
    assert json.loads(trace.info.request_preview) == inputs
    assert json.loads(trace.info.response_preview) == outputs


def check_traces(run, experiment_id: str, cap: CaptureExporter) -> None:
    trajs = {otel_rl_mlflow.mlflow_trace_id(t.trace_id): t for t in cap.of_type(Trajectory)}
    assert len(trajs) == 6
    linked = traces_of(experiment_id, run_id=run.info.run_id)
    assert {tr.info.trace_id for tr in linked} == set(trajs)
    for step in (1, 2, 3):
        found = traces_of(experiment_id, filter_string=f"tags.step = '{step}'")
        assert {tr.info.trace_id for tr in found} == {k for k, t in trajs.items() if t.step == step}
        for tr in found:
            check_trace(tr, trajs[tr.info.trace_id])
    failed = traces_of(experiment_id, filter_string="tags.step = '2' AND tags.sample_index = '0'")
    assert len(failed) == 1
    tool_span = [s for s in failed[0].data.spans if s.name == "execute_tool calculator"][0]
    assert tool_span.status.status_code.value == "ERROR"
    assert tool_span.events[0].attributes[sc.EXCEPTION_TYPE] == "ZeroDivisionError"
    assert tool_span.events[0].attributes[sc.EXCEPTION_MESSAGE] == "cannot evaluate 8/0"


def check_tables(client: MlflowClient, run, experiment_id: str) -> None:
    for n in (2, 3):
        df = client.load_table(experiment_id, f"val_generations/step_{n}.json", run_ids=[run.info.run_id])
        rows = df.to_dict("records")
        assert [r["input"] for r in rows] == [f"prompt {n}-{j}" for j in range(3)] + ["no score"]
        assert [r["output"] for r in rows] == [f"answer {n}-{j}" for j in range(3)] + [""]
        assert [r["score"] for r in rows[:3]] == [0.0, 0.5, 1.0] and math.isnan(rows[3]["score"])
        assert set(r["step"] for r in rows) == {n}
    tables = json.loads(client.get_run(run.info.run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "val_generations/step_2.json", "type": "table"} in tables


# ----------------------------------------------------------------------------- tests


def test_workload_reads_back_exactly(store_uri, caplog):
    caplog.set_level("WARNING", logger="otel_rl")
    project = _project("gsm8k")
    cap, rid = run_instrumented(project)
    for key in EXPECTED_KEYS:  # logged at 3 steps, renamed with one warning
        assert sum(f"key {key!r} logged as" in r.getMessage() for r in caplog.records) == 1, key
    client = MlflowClient(store_uri)
    exp, run = get_run(client, project)
    assert run.info.run_name == "grpo-1"
    assert run.info.status == "FINISHED"
    assert run.data.tags[otel_rl_mlflow.RUN_ID_TAG] == rid
    # the run page's User and Source, as mlflow.start_run sets them in this process (the export process
    # that created the run is a child of it)
    assert run.data.tags["mlflow.user"] == getpass.getuser()
    assert run.data.tags["mlflow.source.type"] == "LOCAL"
    assert run.data.tags["mlflow.source.name"] == sys.argv[0]
    check_params(run, CONFIG)
    check_metrics(client, run, cap)
    inf = json.loads(run.data.tags[otel_rl_mlflow.INF_METRICS_TAG])
    assert inf == {"inf/pos": {"count": 2, "+inf_steps": [1, 3]}, "inf/neg": {"count": 1, "-inf_steps": [2]}}
    check_traces(run, exp.experiment_id, cap)
    check_tables(client, run, exp.experiment_id)


def test_same_run_id_reattaches_to_the_same_run(store_uri):
    project = _project("reattach")
    rid = uuid.uuid4().hex
    cap1, _ = run_instrumented(project, run_id=rid, fn=lambda: workload(steps=2))

    def more():
        for n in (3, 4):
            otel_rl.log({"actor/pg_loss": 1.0 / n}, step=n)
        otel_rl.log_generations([("late prompt", "late answer", 1.0)], step=2)  # appended to step 2's table

    cap2, _ = run_instrumented(project, run_id=rid, fn=more)
    client = MlflowClient(store_uri)
    exp, run = get_run(client, project)  # one run, not two
    assert run.data.tags[otel_rl_mlflow.RUN_ID_TAG] == rid and run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "actor/pg_loss")
    assert sorted((m.step, m.value) for m in hist) == sorted(
        [(1, 0.5), (1, 0.1), (2, 0.25), (2, 0.05), (3, 1 / 3), (4, 0.25)])
    rows = client.load_table(exp.experiment_id, "val_generations/step_2.json", run_ids=[run.info.run_id])
    assert list(rows["input"]) == [f"prompt 2-{j}" for j in range(3)] + ["no score", "late prompt"]
    assert len(traces_of(exp.experiment_id, run_id=run.info.run_id)) == 4


def test_mlflow_run_id_attaches_to_an_existing_run(sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    client = MlflowClient(sqlite_uri)
    exp_id = client.create_experiment(_project("mine"))
    mine = client.create_run(exp_id, run_name="made-by-user")
    monkeypatch.setenv("MLFLOW_RUN_ID", mine.info.run_id)
    cap, rid = run_instrumented(_project("other-project"), fn=lambda: workload(steps=1))
    run = client.get_run(mine.info.run_id)
    assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")) == [0.1, 0.5]
    assert run.data.tags[otel_rl_mlflow.RUN_ID_TAG] == rid
    assert len(traces_of(exp_id, run_id=run.info.run_id)) == 2


def test_two_runs_in_one_process_stay_apart(sqlite_uri, monkeypatch):
    """Records of two run identities through one exporter (as behind an OTLP bridge): two MLflow runs."""
    from otel_rl.config import resolve
    from otel_rl.records import RunIdentity, RunStart

    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    project = _project("bridge")
    exporter = otel_rl_mlflow.MlflowExporter(resolve(project=project))
    a, b = RunIdentity(project, "run-a", "id-a"), RunIdentity(project, "run-b", "id-b")
    now = time.time_ns()
    exporter.export_records([RunStart(a, {"lr": 1}, 0, now), RunStart(b, {"lr": 2}, 0, now),
                             StepMetrics(a, 1, {"loss": 1.0}, now), StepMetrics(b, 1, {"loss": 2.0}, now)])
    exporter.shutdown()
    client = MlflowClient(sqlite_uri)
    exp = client.get_experiment_by_name(project)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"run-a", "run-b"}
    assert runs["run-a"].data.metrics == {"loss": 1.0} and runs["run-a"].data.params == {"lr": "1"}
    assert runs["run-b"].data.metrics == {"loss": 2.0} and runs["run-b"].data.params == {"lr": "2"}


def test_a_redelivered_table_record_is_stored_once(sqlite_uri, monkeypatch):
    """A Collector's queue delivers at least once: the same generations record twice, in one batch and in a later
    one, leaves one copy of its rows in the step's table."""
    from otel_rl.config import resolve
    from otel_rl.records import Generations, RunIdentity, RunStart

    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    project = _project("redeliver")
    exporter = otel_rl_mlflow.MlflowExporter(resolve(project=project))
    ident, now = RunIdentity(project, "run", "id-redeliver"), time.time_ns()
    first = Generations(ident, 2, [("q", "a", 1.0), ("q2", "a2", 0.0)], now)
    other = Generations(ident, 2, [("q3", "a3", 0.5)], now + 1)
    exporter.export_records([RunStart(ident, {}, 0, now), first, first, other])
    exporter.export_records([first, other])
    exporter.shutdown()
    client = MlflowClient(sqlite_uri)
    exp = client.get_experiment_by_name(project)
    table = client.load_table(exp.experiment_id, "val_generations/step_2.json")
    assert list(zip(table["input"], table["output"])) == [("q", "a"), ("q2", "a2"), ("q3", "a3")]


def test_bad_input(sqlite_uri, monkeypatch, caplog):
    """10k keys in one step, unicode and over-long keys, 100 KB prompts, NaN/Inf."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    big_prompt = "这是一个很长的提示。" * 10_000  # 100k characters
    many = {f"many/key_{i:05d}": float(i) for i in range(10_000)}

    @otel_rl.generate(model="m")
    def gen(prompt: str) -> dict:
        return {"prompt_ids": [1] * 10, "response_ids": [2] * 3, "text": big_prompt}

    def fn():
        with otel_rl.step(1):
            with otel_rl.trajectory(sample_index=0, name="长轨迹 " + "n" * 5000):
                gen(big_prompt)
            otel_rl.log(many, step=1)
            otel_rl.log({"损失": math.nan, "x_at_y": 1.0, "x@y": math.inf}, step=1)

    caplog.set_level("WARNING", logger="otel_rl")
    project = _project("bad-input")
    cap, _ = run_instrumented(project, fn=fn)
    client = MlflowClient(sqlite_uri)
    exp, run = get_run(client, project)
    assert len(run.data.metrics) == 10_000 + 3  # + 损失, x_at_y and the renamed x@y
    assert run.data.metrics["many/key_09999"] == 9999.0 and run.data.metrics["many/key_00000"] == 0.0
    assert math.isnan(run.data.metrics["损失"])
    renamed = "x_at_y-" + hashlib.sha1(b"x@y").hexdigest()[:8]  # "x_at_y" is taken by a real key
    assert run.data.metrics[renamed] == MLFLOW_MAX and run.data.metrics["x_at_y"] == 1.0
    assert json.loads(run.data.tags[otel_rl_mlflow.INF_METRICS_TAG]) == {renamed: {"count": 1, "+inf_steps": [1]}}
    warnings = [r.getMessage() for r in caplog.records if "'x@y'" in r.getMessage()]
    assert len(warnings) == 1
    (tr,) = traces_of(exp.experiment_id, run_id=run.info.run_id)
    assert tr.info.tags["mlflow.traceName"].startswith("长轨迹 ") and len(tr.info.tags["mlflow.traceName"]) <= 4096
    llm = [s for s in tr.data.spans if s.span_type == "LLM"][0]
    assert llm.inputs == {"prompt": big_prompt}
    assert llm.outputs["text"] == big_prompt


def test_token_counts_read_by_their_type():
    """A token count that is no integer (only a hand-made span holds one: the bridge refuses it) is left
    out of the span's token usage; the other count is kept."""
    from otel_rl.records import SpanNode
    from otel_rl_mlflow._traces import ATTR_TOKEN_USAGE, SpanBuilder

    attrs = {sc.GEN_AI_USAGE_INPUT_TOKENS: "many", sc.GEN_AI_USAGE_OUTPUT_TOKENS: 5}
    node = SpanNode("llm", sc.KIND_LLM, 1, None, 0, 1, attrs, None, None, "OK", None, [])
    usage = json.loads(SpanBuilder._attributes(node, '"tr-1"')[ATTR_TOKEN_USAGE])
    assert usage == {"output_tokens": 5, "total_tokens": 5}


def test_truncated_op_output_is_kept_as_text(sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)

    @otel_rl.op
    def big() -> str:
        return "y" * 5000

    def fn():
        with otel_rl.trajectory(step=1, sample_index=0):
            big()

    project = _project("truncated")
    run_instrumented(project, fn=fn, max_value_chars=1000)
    client = MlflowClient(sqlite_uri)
    exp, run = get_run(client, project)
    (tr,) = traces_of(exp.experiment_id, run_id=run.info.run_id)
    span = [s for s in tr.data.spans if s.name.endswith("big")][0]
    assert isinstance(span.outputs, str) and span.outputs.endswith("chars]") and span.outputs.startswith('"yyy')
    assert span.attributes[sc.RL_TRUNCATED] is True


def test_traces_only_when_mlflow_is_the_trace_backend(sqlite_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    client = MlflowClient(sqlite_uri)
    for backend, n_traces in ((None, 0), ("mlflow", 2)):
        project = _project("backend")
        overrides = [f"trainer.project_name={project}", "trainer.experiment_name=verl-keys",
                     "trainer.logger=[console,mlflow]"]
        if backend:
            overrides.append(f"actor_rollout_ref.rollout.trace.backend={backend}")
        h = otel_rl.init(overrides, batch_delay_s=0.05, tracing=True)
        workload(steps=1)
        h.shutdown()
        exp, run = get_run(client, project)
        assert run.info.run_name == "verl-keys"
        assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")) == [0.1, 0.5]
        assert len(traces_of(exp.experiment_id)) == n_traces
        assert run.data.params["trainer/logger/1"] == "mlflow"


def test_unusable_tracking_uri_never_reaches_training_code(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus-scheme://nowhere")
    h = otel_rl.init(project=_project("bogus"), exporters=["mlflow"], trace_backend="mlflow", batch_delay_s=0.05)
    workload(steps=2)  # must not raise
    h.flush(1)
    stats = h.stats()["exporters"]["mlflow"]
    t0 = time.monotonic()
    h.shutdown(timeout_s=1)
    assert time.monotonic() - t0 < 10
    assert stats["failed_attempts"] >= 1 and stats["exported"] == 0


def test_file_store_falls_back_to_one_trace_per_call(tmp_path, monkeypatch):
    """Stores without batch span ingestion (the file store) get trace info + span data per trace."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    project = _project("filestore")
    cap, _ = run_instrumented(project, fn=lambda: workload(steps=1))
    client = MlflowClient(uri)
    exp, run = get_run(client, project)
    trajs = {otel_rl_mlflow.mlflow_trace_id(t.trace_id): t for t in cap.of_type(Trajectory)}
    traces = traces_of(exp.experiment_id, filter_string="tags.step = '1'")
    assert {t.info.trace_id for t in traces} == set(trajs)
    for tr in traces:
        check_trace(tr, trajs[tr.info.trace_id])
        assert tr.info.trace_metadata["mlflow.sourceRun"] == run.info.run_id


def test_span_exporter_adapter_with_sdk_provider(sqlite_uri, monkeypatch):
    """`MlflowSpanExporter` as a plain OpenTelemetry exporter: spans shaped by otel-rl's conventions."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    project = _project("adapter")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    monkeypatch.setenv("OTEL_RL_PROJECT", project)
    monkeypatch.setenv("OTEL_RL_EXPERIMENT", "sdk")
    provider = TracerProvider(resource=Resource.create({"service.name": "trainer"}))
    provider.add_span_processor(SimpleSpanProcessor(otel_rl_mlflow.MlflowSpanExporter()))
    _emit_otel_trajectory(provider.get_tracer("app"))
    provider.shutdown()
    _check_otel_trajectory(MlflowClient(sqlite_uri), project, "sdk")


def _emit_otel_trajectory(tracer) -> None:
    with tracer.start_as_current_span("rollout", attributes={sc.RL_SPAN_KIND: sc.KIND_AGENT, sc.RL_STEP: 5,
                                                             sc.RL_SAMPLE_INDEX: 1}):
        with tracer.start_as_current_span("chat", attributes={sc.RL_SPAN_KIND: sc.KIND_LLM,
                                                              sc.RL_OP_INPUTS: json.dumps({"prompt": "hi"}),
                                                              sc.GEN_AI_USAGE_INPUT_TOKENS: 3,
                                                              sc.GEN_AI_USAGE_OUTPUT_TOKENS: 2}):
            pass


def _check_otel_trajectory(client: MlflowClient, project: str, experiment: str) -> None:
    exp, run = get_run(client, project)
    assert run.info.run_name == experiment
    (tr,) = traces_of(exp.experiment_id, filter_string="tags.step = '5'")
    assert tr.info.tags[sc.TAG_SAMPLE_INDEX] == "1"
    assert [s.span_type for s in tr.data.spans] == ["AGENT", "LLM"]
    assert tr.data.spans[1].inputs == {"prompt": "hi"}
    assert tr.info.token_usage == {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}
    assert len(traces_of(exp.experiment_id, run_id=run.info.run_id)) == 1


def test_opentelemetry_instrument_subprocess(sqlite_uri, tmp_path, monkeypatch):
    """``OTEL_TRACES_EXPORTER=mlflow opentelemetry-instrument python app.py``."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    instrument = VENV_BIN / "opentelemetry-instrument"
    if not instrument.exists():
        pytest.skip("opentelemetry-distro is not installed (pip install 'otel-rl-mlflow[instrument]')")
    project = _project("instrument")
    app = tmp_path / "app.py"
    app.write_text(
        "import json\nfrom opentelemetry import trace\n"
        "from otel_rl import semconv as sc\n"
        "from tests_helper import emit\n"
        "emit(trace.get_tracer('app'))\n")
    (tmp_path / "tests_helper.py").write_text(
        "import json\nfrom otel_rl import semconv as sc\n"
        + _source_of(_emit_otel_trajectory).replace("_emit_otel_trajectory", "emit"))
    env = dict(os.environ, OTEL_TRACES_EXPORTER="mlflow", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none",
               OTEL_RESOURCE_ATTRIBUTES=f"rl.project.name={project},rl.experiment.name=instrumented,rl.run.id=r-1",
               MLFLOW_TRACKING_URI=sqlite_uri, PYTHONPATH=str(tmp_path),
               # logfire (installed for tests/otel_global) adds a pydantic plugin whose first load imports
               # concurrent.futures.process; MLflow builds its first pydantic model in the SDK's exit flush,
               # where that import cannot register its exit hook. Not otel-rl's: the plugin is left out here.
               PYDANTIC_DISABLE_PLUGINS="logfire-plugin")
    proc = subprocess.run([str(instrument), sys.executable, str(app)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "otel-rl" not in proc.stderr, proc.stderr[-3000:]
    client = MlflowClient(sqlite_uri)
    _check_otel_trajectory(client, project, "instrumented")
    assert get_run(client, project)[1].data.tags[otel_rl_mlflow.RUN_ID_TAG] == "r-1"


def _source_of(fn) -> str:
    import inspect

    return inspect.getsource(fn)


@pytest.mark.slow
def test_server_killed_mid_run_every_point_arrives_once(mlflow_server, monkeypatch):
    """Kill the server (SIGKILL) mid-run, keep training, restart it on the same port."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the pipeline retries; don't stack retries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    project = _project("outage")
    cap = CaptureExporter()
    h = otel_rl.init(project=project, experiment="outage", exporters=["mlflow", cap], trace_backend="mlflow",
                     batch_delay_s=0.05)
    keys = [f"k/{i}" for i in range(20)]

    def steps(a: int, b: int) -> None:
        for n in range(a, b):
            with otel_rl.step(n):
                with otel_rl.trajectory(sample_index=0):
                    generate([1, 2, 3])
                otel_rl.log({k: n + i / 100 for i, k in enumerate(keys)}, step=n)

    steps(1, 6)
    assert h.flush(60)
    mlflow_server.kill()
    t0 = time.monotonic()
    steps(6, 16)  # the server is gone: training goes on, never sees an error
    otel_rl.log_generations([("p", "o", 1.0)], step=15)
    assert time.monotonic() - t0 < 5
    h.flush(1)
    assert h.stats()["exporters"]["mlflow"]["failed_attempts"] >= 1
    mlflow_server.start()
    assert h.flush(120)
    stats = h.stats()["exporters"]["mlflow"]
    h.shutdown()
    assert stats["dropped"] == 0 and stats["queued"] == 0, stats
    client = MlflowClient(mlflow_server.url)
    exp, run = get_run(client, project)
    for i, k in enumerate(keys):
        hist = client.get_metric_history(run.info.run_id, k)
        assert sorted((m.step, m.value) for m in hist) == [(n, n + i / 100) for n in range(1, 16)], k
    assert len(traces_of(exp.experiment_id, run_id=run.info.run_id)) == 15
    table = client.load_table(exp.experiment_id, "val_generations/step_15.json", run_ids=[run.info.run_id])
    assert list(table["input"]) == ["p"]


def test_new_sqlite_store_is_created_in_one_go(tmp_path):
    """A new sqlite store gets MLflow's tables all at once (a scratch file, synced once, linked into place):
    MLflow opens it as its own, at the latest schema revision; an existing store is left alone."""
    import sqlite3

    from mlflow.store.db.utils import _get_latest_schema_revision

    from otel_rl_mlflow.direct.store import create_sqlite_store

    path = tmp_path / "new.db"
    uri = f"sqlite:///{path}"
    assert create_sqlite_store(uri) is True
    assert sorted(os.listdir(tmp_path)) == ["new.db"]  # no scratch file or journal left
    with sqlite3.connect(path) as con:
        (revision,) = con.execute("SELECT version_num FROM alembic_version").fetchone()
        (journal,) = con.execute("PRAGMA journal_mode").fetchone()
    assert revision == _get_latest_schema_revision()
    assert journal == "delete"  # sqlite's default: the scratch settings did not stay
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("one-go"))
    client.log_metric(run.info.run_id, "loss", 0.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 0.5)]

    # an existing store: untouched, its run still there
    before = path.stat().st_mtime_ns, path.stat().st_size
    assert create_sqlite_store(uri) is False
    assert (path.stat().st_mtime_ns, path.stat().st_size) == before
    assert MlflowClient(tracking_uri=uri).get_run(run.info.run_id).data.metrics == {"loss": 0.5}

    # not a sqlite file, or nowhere to put it: left to MLflow
    assert create_sqlite_store("http://127.0.0.1:5000") is False
    assert create_sqlite_store("sqlite:///:memory:") is False
    assert create_sqlite_store(f"sqlite:///{tmp_path}/no/such/dir/x.db") is False
    assert not (tmp_path / "no").exists()


def _store_content(path) -> tuple[list, dict]:
    """A sqlite file's schema (every table, index, trigger) and every row of every table.  The lines of a
    CREATE statement are compared as a set: MLflow's own migrations, which rebuild tables, write a table's
    constraints in an order that changes from one process to the next (string hashing)."""
    import sqlite3

    def clauses(sql):
        return sorted(line.strip().rstrip(",").strip() for line in (sql or "").split("\n"))

    with sqlite3.connect(path) as con:
        schema = sorted(((kind, name, table, clauses(sql)) for kind, name, table, sql
                         in con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")), key=repr)
        rows = {name: sorted(con.execute(f'SELECT * FROM "{name}"').fetchall(), key=repr)
                for (kind, name, _, _) in schema if kind == "table"}
    return schema, rows


def test_new_sqlite_stores_are_copied_from_a_kept_template(tmp_path, monkeypatch):
    """The first new store of an MLflow version is built by MLflow's migrations and kept as a template;
    later new stores are copies of it: the same tables, indexes and rows as MLflow's own build, opened
    and used by MLflow as its own."""
    import sqlalchemy
    import mlflow.store.db.utils as db_utils

    from otel_rl_mlflow.direct import store as ex

    templates = tmp_path / "templates"
    monkeypatch.setenv(ex.ENV_STORE_TEMPLATE_DIR, str(templates))
    real = db_utils._initialize_tables
    reference = tmp_path / "reference.db"  # what MLflow's own code makes of an empty file
    engine = sqlalchemy.create_engine(f"sqlite:///{reference}")
    real(engine)
    engine.dispose()

    assert ex.create_sqlite_store(f"sqlite:///{tmp_path}/first.db") is True
    [kept] = os.listdir(templates)  # one file, nothing half-written left beside it
    assert kept.startswith(f"store-{mlflow.__version__}-") and kept.endswith(".db")
    assert str(templates / kept) == ex.template_path()

    def no_migrations(engine):
        raise AssertionError("a new store was built although a template is kept")

    monkeypatch.setattr(db_utils, "_initialize_tables", no_migrations)
    second = tmp_path / "second.db"
    assert ex.create_sqlite_store(f"sqlite:///{second}") is True
    assert _store_content(second) == _store_content(tmp_path / "first.db") == _store_content(reference)
    assert sorted(os.listdir(tmp_path)) == ["first.db", "reference.db", "second.db", "templates"]

    client = MlflowClient(tracking_uri=f"sqlite:///{second}")  # MLflow checks the schema revision here
    run = client.create_run(client.create_experiment("from-template"))
    client.log_metric(run.info.run_id, "loss", 0.25, step=7)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(7, 0.25)]

    # another MLflow (or SQLAlchemy, alembic, sqlite, migration set): another template
    monkeypatch.setattr(mlflow, "__version__", mlflow.__version__ + ".post1")
    assert ex.template_path() != str(templates / kept)

    # a file in the template's place that is no sqlite store: not copied, replaced by a store built anew
    monkeypatch.setattr(mlflow, "__version__", mlflow.__version__[: -len(".post1")])
    (templates / kept).write_bytes(b"not a store")
    monkeypatch.setattr(db_utils, "_initialize_tables", real)
    third = tmp_path / "third.db"
    assert ex.create_sqlite_store(f"sqlite:///{third}") is True
    assert _store_content(third) == _store_content(reference) == _store_content(templates / kept)

    # templates off: nothing kept anywhere
    monkeypatch.setenv(ex.ENV_STORE_TEMPLATE_DIR, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert ex.template_path() is None
    assert ex.create_sqlite_store(f"sqlite:///{tmp_path}/fourth.db") is True
    assert not (tmp_path / "cache").exists()
    assert _store_content(tmp_path / "fourth.db") == _store_content(reference)


def test_new_sqlite_store_does_not_replace_one_made_meanwhile(tmp_path, monkeypatch):
    """Another process creates the store while ours is being built: theirs stays, ours is discarded."""
    import mlflow.store.db.utils as db_utils

    from otel_rl_mlflow.direct.store import ENV_STORE_TEMPLATE_DIR, create_sqlite_store

    monkeypatch.setenv(ENV_STORE_TEMPLATE_DIR, "")  # built here, not copied from a template
    path = tmp_path / "race.db"
    real = db_utils._initialize_tables

    def initialize_and_race(engine):
        real(engine)
        path.write_bytes(b"the other process's store")  # appears before ours is linked into place

    monkeypatch.setattr(db_utils, "_initialize_tables", initialize_and_race)
    assert create_sqlite_store(f"sqlite:///{path}") is False
    assert path.read_bytes() == b"the other process's store"
    assert sorted(os.listdir(tmp_path)) == ["race.db"]


_IMPORT_SCRIPT = """
import importlib.abc, importlib.util, sys, time
if sys.argv[2] == "probing":  # a future MLflow that probes for pandas while importing: the hidden import fails
    class Probe(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "mlflow.version":
                importlib.util.find_spec("pandas")
            return None
    sys.meta_path.insert(0, Probe())
from otel_rl.config import resolve
from otel_rl.records import RunIdentity, RunStart, StepMetrics
from otel_rl_mlflow import MlflowExporter
exp = MlflowExporter(resolve(env={}, exporters=[]), tracking_uri=sys.argv[1])
exp.training_pid = 1  # as the export process marks it (in_export_process)
ident = RunIdentity("import-test", "e", "importrun" + sys.argv[2])
exp.export_records([RunStart(ident, {"a": 1}, 0, time.time()), StepMetrics(ident, 1, {"x": 1.5}, time.time())])
exp.shutdown()
print("pandas imported", "pandas" in sys.modules)
print("pygments imported", "pygments" in sys.modules)
import mako.exceptions
print("mako highlights", mako.exceptions.pygments_html_formatter is not None)
"""


@pytest.mark.parametrize("how", ["plain", "probing"])
def test_export_process_imports_mlflow_without_pandas(tmp_path, how):
    """In the export process MLflow is imported, and its store opened, without pandas (its dataset helpers,
    ~0.5 s of CPU time) and pygments (mako's error-page highlighting, ~0.3 s); should that fail, MLflow is
    imported as it comes.  The run is written either way."""
    uri = f"sqlite:///{tmp_path}/imp.db"
    script = tmp_path / "imp.py"
    script.write_text(_IMPORT_SCRIPT)
    # no kept template: the new store is made by MLflow's migrations, inside the hiding too
    p = subprocess.run([sys.executable, str(script), uri, how], capture_output=True, text=True, timeout=180,
                       cwd=tmp_path, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true",
                                          "OTEL_RL_MLFLOW_TEMPLATE_DIR": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"pandas imported {how == 'probing'}" in p.stdout, p.stdout + p.stderr[-2000:]
    assert f"pygments imported {how == 'probing'}" in p.stdout, p.stdout + p.stderr[-2000:]
    assert f"mako highlights {how == 'probing'}" in p.stdout, p.stdout + p.stderr[-2000:]
    # a library that loads its plug-ins while MLflow imports (pydantic loads logfire's, which needs pygments)
    # does without the hidden package, and says nothing about it
    assert "hidden by otel-rl" not in p.stderr, p.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params == {"a": "1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "x")] == [(1, 1.5)]
