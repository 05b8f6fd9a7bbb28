"""The WandB exporter against real offline wandb runs, read back from their run files.

No mocks: every test runs wandb in offline mode in a temporary ``WANDB_DIR`` and reads
the ``run-*.wandb`` transaction log (and the table files) back with
`otel_rl_wandb.reader.read_run`, waiting for the run's exit record.

verl facts the exporter follows (verl ``utils/tracking.py``, ``ValidationGenerationsLogger``):
``wandb.init(project=project_name, name=experiment_name, config=config, settings=
wandb.Settings(https_proxy=trainer.wandb_proxy))``; generations as a ``wandb.Table`` with
columns ``step, input_1, output_1, score_1, ...`` holding one row per validation step,
re-logged with all rows under ``val/generations``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")
otel_rl_wandb = pytest.importorskip("otel_rl_wandb", reason="install with: pip install --no-deps -e exporters/wandb")

from opentelemetry import trace as trace_api  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl import semconv as sc  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.redact import scrub_secrets  # noqa: E402
from otel_rl.exporters import registry  # noqa: E402
from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402
import otel_rl_wandb.exporter  # noqa: E402
from otel_rl_wandb import STEP_METRIC, WandbExporter, wandb_run_id  # noqa: E402
from otel_rl_wandb.reader import find_run_dirs, read_run  # noqa: E402

SM = STEP_METRIC
NAN, INF = float("nan"), float("inf")

# ----------------------------------------------------------------------------- fixtures / helpers


def _wandb_env(root: str) -> dict[str, str]:
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DISABLE_WEAVE": "true",  # weave is importable here: without this, init asks for a key
        "WANDB_SILENT": "true",
        "WANDB_DIR": root,
        "WANDB_DATA_DIR": os.path.join(root, "data"),
        "WANDB_CACHE_DIR": os.path.join(root, "cache"),
        "WANDB_CONFIG_DIR": os.path.join(root, "config"),
    }
    for k in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        os.makedirs(env[k], exist_ok=True)
    return env


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    """Offline wandb in a fresh directory; no OTEL_*/WANDB_* settings leaking in."""
    for k in list(os.environ):
        if k.startswith(("OTEL_", "WANDB_")):
            monkeypatch.delenv(k, raising=False)
    root = str(tmp_path / "wb")
    os.makedirs(root)
    for k, v in _wandb_env(root).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    wandb.teardown()  # wandb caches its settings (WANDB_DIR) process-wide at the first init
    yield root
    h = otel_rl.current()
    if h is not None:
        h.shutdown(10)
    wandb.teardown()


def _one_run(root: str, run_id: str, **kw):
    dirs = find_run_dirs(root, run_id=run_id)
    assert len(dirs) == 1, dirs
    data = read_run(dirs[0], **kw)
    assert data.exit_seen, "the run's exit record was not written"
    assert data.complete
    return data


def _same(got, want) -> bool:
    """Exact equality as JSON keeps it: ints stay ints, NaN/±Inf themselves.

    wandb writes a float with an integral value as an integer literal (6.0 -> ``6``).
    """
    if type(want) is bool:
        return got is want
    if type(want) is int:
        return type(got) is int and got == want
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return type(got) in (int, float) and type(got) is not bool and got == want


def _assert_rows(data, expected: dict[int, dict]):
    """The metric rows (not the table rows), merged per training step, equal `expected`."""
    got: dict[int, dict] = {}
    for r in _metric_rows(data):
        got.setdefault(r[SM], {}).update({k: v for k, v in r.items() if k not in ("_step", "_runtime", "_timestamp")})
    assert sorted(got) == sorted(expected)
    for step, want in expected.items():
        row = dict(got[step])
        assert row.pop(SM) == step
        assert set(row) == set(want), (step, set(row) ^ set(want))
        bad = {k: (row[k], v) for k, v in want.items() if not _same(row[k], v)}
        assert not bad, (step, bad)


def _metric_rows(data):
    return [r for r in data.history if sc.VAL_GENERATIONS_KEY not in r]


VERL_CONFIG = {
    "data": {"train_batch_size": 8, "max_prompt_length": 512, "train_files": ["~/data/gsm8k/train.parquet"],
             "shuffle": True, "seed": None},
    "actor_rollout_ref": {
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "enable_gradient_checkpointing": True},
        "actor": {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}, "ppo_mini_batch_size": 4,
                  "ppo_max_token_len_per_gpu": 16384, "clip_ratio": 0.2},
        "rollout": {"name": "vllm", "n": 5, "temperature": 1.0,
                    "trace": {"backend": None, "token2text": False}},
    },
    "algorithm": {"adv_estimator": "grpo", "kl_ctrl": {"kl_coef": 0.001}},
    "trainer": {"project_name": "verl_examples", "experiment_name": "gsm8k", "logger": ["console", "wandb"],
                "total_epochs": 15, "n_gpus_per_node": 8, "wandb_proxy": None, "wandb_api_key": "wk-SECRET-1",
                "val_before_train": True},
    "hf_token": "hf_SECRET_2",
    "reward_model": {"sandbox_fusion": {"url": None, "headers": "Authorization: Bearer SECRET3"}},
    "中文": {"说明": "配置"},
}

LONG_KEY = "actor/" + "very_long_metric_name_" * 230  # ~5 kB


def _step_values(n: int) -> tuple[dict, dict]:
    """Two log() calls of one step; the second overrides one key of the first."""
    first = {"actor/pg_loss": 0.1 * n + 0.012345678901234567, "critic/score/mean": n / 7, "actor/ppo_kl": -n / 3,
             "response_length/max": 100 * n, "perf/total_num_tokens": 2**53 + n, "big/int": 2**62 + n,
             "is/nan": NAN, "is/inf": INF, "is/-inf": -INF, "training/flag": n % 2 == 0}
    second = {"actor/pg_loss": -0.25 * n - 0.001, "奖励/平均": 1.5 * n + 0.25, "émoji 🚀/ü": n + 0.5,
              7: 0.75 * n, LONG_KEY: n * 1.25, "": 3.5}
    return first, second


def _expected(n: int) -> dict:
    first, second = _step_values(n)
    out = dict(first)
    out.update({str(k) if k != "" else otel_rl_wandb.EMPTY_KEY: v for k, v in second.items()})
    return out


# ----------------------------------------------------------------------------- the instrumented workload


def test_workload_config_steps_out_of_order_and_spans_still_flow(wandb_dir):
    provider_before = trace_api.get_tracer_provider()
    h = otel_rl.init(VERL_CONFIG, project="otel-rl-test", experiment="grpo-1", exporters=["wandb", "memory"],
                     batch_delay_s=0.05)
    cap = next(e for e in h.exporters if isinstance(e, CaptureExporter))
    wb = next(e for e in h.exporters if isinstance(e, WandbExporter))

    @otel_rl.op
    def reward(x):
        return x * 2

    expected: dict[int, dict] = {}
    order = [5, 3, 4, 1]  # deliberately out of order, each step in its own delivery batch
    for n in order:
        with otel_rl.step(n):
            with otel_rl.trajectory(sample_index=0, rollout_n=0):
                reward(n)
            first, second = _step_values(n)
            otel_rl.log(first, step=n)
            otel_rl.log(second, step=n)
        expected[n] = _expected(n)
        assert h.flush(30)
        assert wb.runs, "the wandb run is open after the first delivery"
    otel_rl.log({"late/worker": 42}, step=5)  # a late worker's value for an earlier step
    expected[5]["late/worker"] = 42
    bulk = {f"bulk/k{i:05d}": i * 0.25 + 0.125 for i in range(10_000)}
    otel_rl.log(bulk, step=6)
    expected[6] = dict(bulk)
    h.shutdown()

    # otel-rl's private provider kept working after wandb.init: the capture got every
    # trajectory, also those of steps traced after the wandb run was opened
    from otel_rl._handle import _forwarding

    assert trace_api.get_tracer_provider() in (provider_before, _forwarding)  # wandb did not replace it
    assert sorted(t.step for t in cap.trajectories()) == sorted(order)
    assert wandb.run is None  # the user's global wandb.run / wandb.log are left alone
    assert h.stats()["exporters"]["wandb"]["failed_attempts"] == 0
    assert h.stats()["exporters"]["wandb"]["dropped"] == 0

    data = _one_run(wandb_dir, h.run_id)
    assert data.run_id == h.run_id == wandb_run_id(RunIdentity("otel-rl-test", "grpo-1", h.run_id))
    assert (data.project, data.display_name) == ("otel-rl-test", "grpo-1")
    # config: the verl config as given, secrets scrubbed
    assert data.config == scrub_secrets(VERL_CONFIG)
    text = json.dumps(data.config, ensure_ascii=False)
    assert "SECRET" not in text and data.config["trainer"]["wandb_api_key"] == "***"
    # one row per delivered step, in arrival order; the two log() calls of a step merged
    arrival = [r[SM] for r in _metric_rows(data)]
    assert [s for i, s in enumerate(arrival) if i == 0 or arrival[i - 1] != s] == [5, 3, 4, 1, 5, 6]
    _assert_rows(data, expected)
    # and exactly what the core recorded
    _assert_rows(data, {s: {(otel_rl_wandb.EMPTY_KEY if k == "" else k): v for k, v in row.items()}
                        for s, row in cap.metrics_by_step().items()})
    # the summary shows the values of the highest step, not of the last row delivered
    assert _same(data.summary["actor/pg_loss"], expected[5]["actor/pg_loss"])
    assert data.summary["late/worker"] == 42 and data.summary[SM] == 6
    # every key is plotted against the training step
    assert {"name": "", "glob_name": "*", "step_metric": SM} in data.metrics


def test_generations_table_accumulates_in_verl_layout(wandb_dir):
    h = otel_rl.init(project="otel-rl-test", experiment="val", exporters=["wandb"], batch_delay_s=0.05)
    otel_rl.log({"val-core/acc": 0.25}, step=2)
    otel_rl.log_generations([("问题 1", "答案 1", 1.0), ("q2", "a2\nline 2", 0.0)], step=2)
    assert h.flush(30)
    otel_rl.log_generations([("q1'", "a1'", 0.5), ("q2'", "a2'", float("nan")), ("q3'", "a3'", 1)], step=4)
    otel_rl.log({"val-core/acc": 0.5}, step=4)
    h.shutdown()

    data = _one_run(wandb_dir, h.run_id)
    versions = data.tables[sc.VAL_GENERATIONS_KEY]
    assert len(versions) == 2
    assert versions[0]["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert versions[0]["data"] == [[2, "问题 1", "答案 1", 1, "q2", "a2\nline 2", 0]]
    last = data.table(sc.VAL_GENERATIONS_KEY)
    assert last["columns"] == ["step"] + [f"{c}_{i}" for i in (1, 2, 3) for c in ("input", "output", "score")]
    assert last["data"][0] == [2, "问题 1", "答案 1", 1, "q2", "a2\nline 2", 0, None, None, None]
    row = last["data"][1]
    assert row[:5] == [4, "q1'", "a1'", 0.5, "q2'"] and row[5] == "a2'" and math.isnan(row[6])
    assert row[7:] == ["q3'", "a3'", 1]
    # the table rows carry the training step of their validation
    table_rows = [r for r in data.history if sc.VAL_GENERATIONS_KEY in r]
    assert [r[SM] for r in table_rows] == [2, 4]
    _assert_rows(data, {2: {"val-core/acc": 0.25}, 4: {"val-core/acc": 0.5}})


# ----------------------------------------------------------------------------- failure and retry


class FailingWandbExporter(WandbExporter):
    """Injects failures: the first wandb.init, and the log() calls numbered in `fail_calls`."""

    fail_calls = {2, 5, 7}

    def __init__(self, config):
        super().__init__(config)
        self.opens = 0
        self.calls = 0
        self.injected = 0

    def open_run(self, run, start):
        self.opens += 1
        if self.opens == 1:
            self.injected += 1
            raise ConnectionError("injected: wandb.init failed")
        return super().open_run(run, start)

    def log(self, handle, data):
        self.calls += 1
        if self.calls in self.fail_calls:
            self.injected += 1
            raise RuntimeError(f"injected: run.log call {self.calls} failed")
        super().log(handle, data)


def test_failures_are_retried_without_duplicates_or_loss(wandb_dir):
    exp = FailingWandbExporter(resolve())
    h = otel_rl.init(VERL_CONFIG, project="otel-rl-test", experiment="retry", exporters=[exp], batch_delay_s=0.05)
    trained = []
    for n in range(1, 5):  # one batch: rows 1-4 then the table
        otel_rl.log({"actor/pg_loss": n / 10, "n": n}, step=n)
        trained.append(n)
    otel_rl.log_generations([("q", "a", 1.0)], step=4)
    assert trained == [1, 2, 3, 4]  # the training thread never saw a failure
    assert h.flush(60)
    stats = h.stats()["exporters"][exp.name]
    h.shutdown()

    assert exp.injected == 4 and stats["failed_attempts"] == 4 and stats["retried"] == 4
    assert stats["dropped"] == 0 and stats["queued"] == 0
    data = _one_run(wandb_dir, h.run_id)
    assert data.config == scrub_secrets(VERL_CONFIG)
    rows = _metric_rows(data)
    assert [r[SM] for r in rows] == [1, 2, 3, 4]  # each step exactly once, none lost
    _assert_rows(data, {n: {"actor/pg_loss": n / 10, "n": n} for n in range(1, 5)})
    assert len(data.tables[sc.VAL_GENERATIONS_KEY]) == 1
    assert data.table(sc.VAL_GENERATIONS_KEY)["data"] == [[4, "q", "a", 1]]


# ----------------------------------------------------------------------------- several runs, processes


def test_several_runs_coexist_in_one_exporter(wandb_dir):
    """The OTLP-bridge case: one exporter, records of two runs interleaved."""
    exp = registry.create("wandb", resolve())
    a, b = RunIdentity("proj-a", "exp-a", "runa0001"), RunIdentity("proj-b", "exp-b", "Run B/with:odd chars")
    exp.export_records([RunStart(a, {"who": "a"}, 0, 1), RunStart(b, {"who": "b"}, 0, 1),
                        StepMetrics(a, 1, {"x": 1.5}, 2), StepMetrics(b, 1, {"x": -1.5}, 2)])
    assert len(exp.runs) == 2
    exp.export_records([StepMetrics(b, 2, {"x": -2.5}, 3), StepMetrics(a, 2, {"x": 2.5}, 3),
                        Generations(a, 2, [("i", "o", 0.5)], 3), StepMetrics(a, 2, {"y": 7}, 4)])
    exp.shutdown()

    da = _one_run(wandb_dir, "runa0001")
    db = _one_run(wandb_dir, wandb_run_id(b))
    assert wandb_run_id(b) != b.run_id and wandb_run_id(b) == wandb_run_id(RunIdentity("x", "y", b.run_id))
    assert (da.project, da.config, db.project, db.config) == ("proj-a", {"who": "a"}, "proj-b", {"who": "b"})
    _assert_rows(da, {1: {"x": 1.5}, 2: {"x": 2.5, "y": 7}})
    _assert_rows(db, {1: {"x": -1.5}, 2: {"x": -2.5}})
    assert da.table(sc.VAL_GENERATIONS_KEY)["data"] == [[2, "i", "o", 0.5]]
    assert sc.VAL_GENERATIONS_KEY not in db.tables


def test_run_finished_by_user_code_is_resumed(wandb_dir):
    h = otel_rl.init(project="otel-rl-test", experiment="reinit", exporters=["wandb"], batch_delay_s=0.05)
    otel_rl.log({"x": 1.5}, step=1)
    assert h.flush(30)
    # user code starting its own run the old way finishes every live run, ours included
    user_run = wandb.init(project="user-project", id="userrun01", reinit="finish_previous")
    otel_rl.log({"x": 2.5}, step=2)
    otel_rl.log_generations([("q", "a", 1.0)], step=2)
    assert h.flush(30)
    user_run.log({"mine": 1})
    user_run.finish()
    h.shutdown()
    assert h.stats()["exporters"]["wandb"]["failed_attempts"] == 0
    first, second = (read_run(d) for d in find_run_dirs(wandb_dir, run_id=h.run_id))
    assert first.exit_seen and second.exit_seen
    assert [r[SM] for r in _metric_rows(first)] == [1]
    assert [r[SM] for r in _metric_rows(second)] == [2]
    assert second.table(sc.VAL_GENERATIONS_KEY)["data"] == [[2, "q", "a", 1]]
    assert [r.get("mine") for r in _one_run(wandb_dir, "userrun01").history] == [1]


_WORKER = textwrap.dedent("""
    import sys
    import otel_rl
    otel_rl.init(project="otel-rl-test", experiment="resume", exporters=["wandb"], batch_delay_s=0.05)
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    otel_rl.log({"x": lo + 0.5, "pid_step": lo}, step=lo)
    otel_rl.flush()  # the wandb run is open: wandb's exit hook is registered now, after otel-rl's
    for s in range(lo + 1, hi):
        otel_rl.log({"x": s + 0.5, "pid_step": s}, step=s)
    # no shutdown(): atexit runs last-registered first, so wandb would tear its service down
    # before otel-rl's hook delivers these steps; the exporter's own hook must run before it
""")


def test_processes_and_restarts_resume_the_same_run(wandb_dir, tmp_path):
    env = dict(os.environ, OTEL_RL_RUN_ID="resume0run0id01")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    for lo, hi in ((1, 4), (3, 6)):  # the restart goes back to step 3 (its last checkpoint)
        p = subprocess.run([sys.executable, str(script), str(lo), str(hi)], env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    dirs = find_run_dirs(wandb_dir, run_id="resume0run0id01")
    assert len(dirs) == 2  # offline: one directory per process, one wandb run id (wandb sync merges them)
    first, second = (read_run(d) for d in dirs)
    assert first.exit_seen and second.exit_seen
    assert first.run_id == second.run_id == "resume0run0id01"
    assert [r[SM] for r in _metric_rows(first)] == [1, 2, 3]
    assert [r[SM] for r in _metric_rows(second)] == [3, 4, 5]
    _assert_rows(second, {s: {"x": s + 0.5, "pid_step": s} for s in (3, 4, 5)})


# ----------------------------------------------------------------------------- OTel SDK path, settings, reader


def test_span_exporter_entry_point_rebuilds_the_rows(wandb_dir, monkeypatch):
    cap = CaptureExporter()
    h = otel_rl.init(project="otel-rl-test", experiment="bridge", exporters=[cap], batch_delay_s=0.05)
    otel_rl.log({"a": 1.25, "n": 3, "nan": NAN}, step=3)
    otel_rl.log({"a": 0.5}, step=1)
    h.shutdown()
    spans = list(cap.spans)

    eps = {e.name: e for e in metadata.entry_points(group="opentelemetry_traces_exporter")}
    cls = eps["wandb"].load()
    assert cls is otel_rl_wandb.WandbSpanExporter
    assert {e.name: e.value for e in metadata.entry_points(group="otel_rl.exporters")}["wandb"] == \
        "otel_rl_wandb:WandbExporter"
    monkeypatch.setenv("OTEL_RL_PROJECT", "ignored-the-spans-carry-their-run")
    span_exporter = cls()
    from opentelemetry.sdk.trace.export import SpanExportResult

    assert span_exporter.export(spans) is SpanExportResult.SUCCESS
    span_exporter.shutdown()
    data = _one_run(wandb_dir, h.run_id)
    assert data.project == "otel-rl-test"
    _assert_rows(data, {3: {"a": 1.25, "n": 3, "nan": NAN}, 1: {"a": 0.5}})


def test_init_arguments_proxy_entity_and_ids(wandb_dir, monkeypatch):
    monkeypatch.setenv("WANDB_ENTITY", "my-team")
    proxy = "http://user:pw@proxy.internal:3128"
    cfg = resolve({"trainer": {"project_name": "p", "wandb_proxy": proxy}}, run_id="abc123")
    exp = WandbExporter(cfg)
    ident = RunIdentity("p", "e", "abc123")
    kw = exp.init_kwargs(ident, RunStart(ident, scrub_secrets(cfg.verl_config), 0, 0))
    assert kw["settings"].https_proxy.rstrip("/") == proxy
    assert kw["config"]["trainer"]["wandb_proxy"] == "http://***@proxy.internal:3128"  # the userinfo redacted
    assert (kw["project"], kw["name"], kw["entity"], kw["id"], kw["resume"], kw["reinit"]) == \
        ("p", "e", "my-team", "abc123", "allow", "create_new")
    monkeypatch.setenv("WANDB_RUN_ID", "users-own-id")
    assert exp.init_kwargs(ident, None)["id"] == "users-own-id"  # this process's own run
    assert exp.init_kwargs(RunIdentity("p", "e", "other"), None)["id"] == "other"
    assert "settings" not in WandbExporter(resolve()).init_kwargs(ident, None)


def test_reader_on_a_partly_written_file(wandb_dir, tmp_path):
    exp = registry.create("wandb", resolve())
    ident = RunIdentity("otel-rl-test", "partial", "partial01")
    exp.export_records([RunStart(ident, {"k": 1}, 0, 1)] +
                       [StepMetrics(ident, s, {f"m/{i}": float(i) for i in range(2000)}, 2) for s in range(1, 4)])
    exp.shutdown()
    full = _one_run(wandb_dir, "partial01")
    assert len(_metric_rows(full)) == 3
    src = open(full.path, "rb").read()
    cut = tmp_path / "cut" / os.path.basename(full.path)
    cut.parent.mkdir()
    cut.write_bytes(src[: len(src) * 2 // 3])
    part = read_run(str(cut), wait_for_exit_s=0.2)
    assert not part.exit_seen and not part.complete
    assert part.config == {"k": 1} and len(_metric_rows(part)) < 3
    shutil.rmtree(cut.parent)


def test_find_run_dirs_matches_the_run_id_and_wandbs_collision_suffix(tmp_path):
    root = tmp_path / "wandb"
    names = ["offline-run-20260101_000001-abc-1", "offline-run-20260101_000001-abc", "run-20260101_000000-abc",
             "offline-run-20260101_000001-abcd", "offline-run-20260101_000002-xabc", "offline-run-20260101_000003-abc"]
    for n in names:
        (root / n).mkdir(parents=True)
        (root / n / "run-x.wandb").write_bytes(b"")
    (root / "offline-run-20260101_000004-abc").mkdir()  # no run file (wandb.init failed): not a run
    got = [os.path.basename(d) for d in find_run_dirs(str(tmp_path), run_id="abc")]
    assert got == ["run-20260101_000000-abc", "offline-run-20260101_000001-abc", "offline-run-20260101_000001-abc-1",
                   "offline-run-20260101_000003-abc"]
    assert len(find_run_dirs(str(root))) == len(names)


_WEAVE_IMPORTED = textwrap.dedent("""
    import os
    import weave  # imported, as the weave exporter does: wandb.init would start weave (asking for a key)
    import otel_rl
    h = otel_rl.init(project="otel-rl-test", experiment="weave", exporters=["wandb"], batch_delay_s=0.05)
    otel_rl.log({"x": 1.5}, step=1)
    h.shutdown()
    assert "WANDB_DISABLE_WEAVE" not in os.environ  # the user's environment is left as it was
    print("stats", h.stats()["exporters"]["wandb"]["failed_attempts"])
""")


def test_wandb_init_does_not_start_weave(wandb_dir, tmp_path):
    if importlib.util.find_spec("weave") is None:
        pytest.skip("weave not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_DISABLE_WEAVE", "WANDB_API_KEY")}
    env["OTEL_RL_RUN_ID"] = "noweave01"
    script = tmp_path / "weave_imported.py"
    script.write_text(_WEAVE_IMPORTED)
    p = subprocess.run([sys.executable, str(script)], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "stats 0" in p.stdout
    assert "API key" not in p.stdout + p.stderr
    _assert_rows(_one_run(wandb_dir, "noweave01"), {1: {"x": 1.5}})


_LAUNCH = textwrap.dedent("""
    import sys
    stage = sys.argv[1] == "stage"
    published = []
    if stage:  # a launch job declaring its inputs before the run starts, as wandb documents it
        from wandb.sdk.launch import manage_wandb_config
        from wandb.sdk.launch.inputs import internal
        original = internal._publish_job_input
        internal._publish_job_input = lambda inp, run: (published.append(list(inp.include)), original(inp, run))
        manage_wandb_config(include=["lr"])
    from otel_rl.config import resolve
    from otel_rl.exporters import registry
    from otel_rl.records import Generations, RunIdentity, RunStart, StepMetrics
    exp = registry.create("wandb", resolve())
    ident = RunIdentity("otel-rl-test", "launch", sys.argv[2])
    exp.export_records([RunStart(ident, {"lr": 0.1}, 0, 1), StepMetrics(ident, 1, {"x": 1.5}, 2),
                        Generations(ident, 1, [("q", "a", 1.0)], 3)])
    exp.shutdown()
    print("launch imported", "wandb.sdk.launch" in sys.modules, "published", published)
    print("pandas imported", "pandas" in sys.modules)  # the table was logged without it
    import pandas, wandb
    print("dataframe seen", wandb.util.is_pandas_data_frame(pandas.DataFrame({"a": [1]})),
          wandb.util.is_pandas_data_frame([[1]]))
    import json
    from importlib import metadata
    print("HEADERS", getattr(wandb.util.working_set, "_otel_rl_headers", False))
    print("WANDBS_OWN", json.dumps([f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()]))
""")


@pytest.mark.parametrize("stage", [False, True], ids=["nothing-staged", "inputs-staged"])
def test_run_start_imports_wandbs_launch_package_only_when_inputs_were_staged(wandb_dir, tmp_path, stage):
    """wandb.init applies staged launch inputs by importing wandb's launch package (0.3-0.5 s of CPU time);
    the exporter skips that only while nothing can have been staged, and the run is the same."""
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH)
    run_id = "launch1" if stage else "nolaunch1"
    p = subprocess.run([sys.executable, str(script), "stage" if stage else "-", run_id], env=dict(os.environ),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    if stage:  # the inputs staged before the run reached it, as without otel-rl
        assert "launch imported True published [['lr']]" in p.stdout, p.stdout
    else:
        assert "launch imported False published []" in p.stdout, p.stdout
    data = _one_run(wandb_dir, run_id)
    assert data.config == {"lr": 0.1}
    _assert_rows(data, {1: {"x": 1.5}})
    # the packages the run start recorded (read from the metadata headers): what wandb's own reading gives
    (run_dir,) = find_run_dirs(wandb_dir, run_id=run_id)
    written = open(os.path.join(run_dir, "files", "requirements.txt"), encoding="utf-8").read().splitlines()
    wandbs_own = json.loads(p.stdout.split("WANDBS_OWN ", 1)[1])  # wandb's reading, in that process
    assert "HEADERS True" in p.stdout
    assert "pandas imported False" in p.stdout and "dataframe seen True False" in p.stdout
    assert data.table(sc.VAL_GENERATIONS_KEY)["data"] == [[1, "q", "a", 1]]
    assert sorted(written) == sorted(wandbs_own) and len(written) > 10


_STATS_SCRIPT = textwrap.dedent("""
    import time
    import otel_rl
    ballast = b"x" * (600 << 20)  # this training process's memory: 600 MB more than the export process has
    h = otel_rl.init(project="otel-rl-test", experiment="stats", exporters=["wandb"], batch_delay_s=0.05,
                     export_process="true")
    for n in range(1, 9):
        otel_rl.log({"x": float(n)}, step=n)
        time.sleep(0.2)
    assert h.flush(120)  # the wandb run is open
    time.sleep(3.5)  # wandb samples its system metrics every second here
    h.shutdown()
    print("remote", [type(e).__name__ for e in h.exporters])
""")


def test_system_metrics_are_the_training_processs_from_the_export_process(wandb_dir, tmp_path):
    """wandb's system metrics (process memory, CPU, threads) describe the process that calls wandb.init;
    from the export process they are set to describe the training process, as when wandb runs in it."""
    script = tmp_path / "stats.py"
    script.write_text(_STATS_SCRIPT)
    env = dict(os.environ, OTEL_RL_RUN_ID="stats01", WANDB_X_STATS_SAMPLING_INTERVAL="1")
    p = subprocess.run([sys.executable, str(script)], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RemoteExporter" in p.stdout  # wandb ran in the export process
    data = _one_run(wandb_dir, "stats01")
    _assert_rows(data, {n: {"x": float(n)} for n in range(1, 9)})
    from otel_rl_wandb.reader import iter_records, run_file
    from wandb.proto import wandb_internal_pb2 as pb

    rss = []
    with open(run_file(find_run_dirs(wandb_dir, run_id="stats01")[0]), "rb") as f:
        for raw in iter_records(f.read()):
            if raw is None:
                continue
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "stats":
                rss += [float(i.value_json) for i in rec.stats.item if i.key == "proc.memory.rssMB"]
    assert rss, "no system metrics recorded"
    assert max(rss) > 600, rss  # the training process's memory, ballast included


# ----------------------------------------------------------------------------- console


def test_the_training_processs_console_goes_to_the_run_in_whole_lines(wandb_dir):
    """The run's terminal is shared with this process's own output (here: wandb's own capture callback, as
    for what this process prints).  The training process's text goes there in whole lines: this process's
    line printed while a progress bar of the trainer's is unfinished stays a line of its own, the bar's
    last state one of its own, and an unfinished last line reaches the log when the run ends."""
    cfg = resolve({"trainer": {"project_name": "p", "experiment_name": "e"}}, run_id="console02")
    exp = WandbExporter(cfg)
    ident = RunIdentity("p", "e", "console02")
    exp.export_records([StepMetrics(ident, 1, {"x": 1.0}, 1)])
    handle = exp.runs[ident]
    exp.write_console([("stderr", "  0%|     |\r 40%|##   |"), ("stdout", "step:1 - x:1.0\nstep:2 - ")])
    handle.run._console_raw_callback("stderr", "a warning of the export process\n")  # its own output
    exp.write_console([("stderr", "\r100%|#####|\n"), ("stdout", "x:2.0\n"), ("stdout", "left unfinished")])
    exp.shutdown()
    (run_dir,) = find_run_dirs(wandb_dir, run_id="console02")
    lines = [line.rstrip("\r") for line in (Path(run_dir) / "files" / "output.log").read_text().splitlines()]
    ours = ["step:1 - x:1.0", "100%|#####|", "step:2 - x:2.0", "left unfinished"]
    assert "a warning of the export process" in lines, lines
    assert [line for line in lines if line in ours] == ours, lines
    # nothing mixed: no other line holds a piece of the bar or of the warning
    assert [line for line in lines if "%|" in line or "warning" in line] == [
        "a warning of the export process", "100%|#####|"], lines


def test_a_console_line_that_does_not_end_is_held_only_up_to_a_bound(wandb_dir, monkeypatch):
    """A progress bar redrawn with carriage returns for the whole run never ends its line: what is held of
    it stays bounded (passed on as it is beyond CONSOLE_HELD_MAX), and nothing of it is lost."""
    monkeypatch.setattr(otel_rl_wandb.exporter, "CONSOLE_HELD_MAX", 1000)
    cfg = resolve({"trainer": {"project_name": "p", "experiment_name": "e"}}, run_id="console03")
    exp = WandbExporter(cfg)
    ident = RunIdentity("p", "e", "console03")
    exp.export_records([StepMetrics(ident, 1, {"x": 1.0}, 1)])
    handle = exp.runs[ident]
    sizes = []
    for i in range(300):
        exp.write_console([("stderr", f"\rstep {i:4d} of 300 |{'#' * (i // 30):<10}|")])
        sizes.append(sum(len(p) for p in handle.console_rest.get("stderr", [0, ""])[1:]))
    assert max(sizes) <= 1000 + 30 and min(sizes[50:]) < 100  # held text bounded, passed on along the way
    exp.write_console([("stderr", "\rdone\n"), ("stdout", "after the bar\n")])
    exp.shutdown()
    (run_dir,) = find_run_dirs(wandb_dir, run_id="console03")
    lines = [line.rstrip("\r") for line in (Path(run_dir) / "files" / "output.log").read_text().splitlines()]
    assert "after the bar" in lines, lines
    assert any(line.startswith("done") for line in lines), lines
