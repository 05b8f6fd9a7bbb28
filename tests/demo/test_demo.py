"""`otel-rl demo` end to end: a short real GRPO run through the CLI, read back from the MLflow
store it wrote (`MlflowClient`, `mlflow.search_traces`) and from its JSONL file.

Every `Handle.log` call of the run is recorded (a wrapper around the real method), so the checks
compare what the trainer logged with what each backend holds, value by value.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl import cli  # noqa: E402
from otel_rl.demo import cli as demo_cli  # noqa: E402
from otel_rl.demo.config import build_config  # noqa: E402
from otel_rl.demo.progress import Progress  # noqa: E402
from otel_rl.demo.trainer import GRPOTrainer  # noqa: E402
from otel_rl.sampling import choose  # noqa: E402

STEPS, BATCH, N, MAX_SAMPLES, VAL = 4, 6, 3, 2, 8
ARGS = ["--no-progress", "--seed", "3", f"--steps={STEPS}", "trainer.test_freq=2", f"data.train_batch_size={BATCH}",
        f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        f"data.val_batch_size={VAL}", "trainer.log_val_generations=5",
        "actor_rollout_ref.model.pretrain.steps=20",
        f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={MAX_SAMPLES}"]
TRAIN_KEYS = {
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean", "critic/advantages/mean",
    "critic/advantages/max", "critic/advantages/min", "actor/pg_loss", "actor/entropy", "actor/kl_loss",
    "actor/pg_clipfrac", "actor/grad_norm", "actor/lr", "response_length/mean", "response_length/max",
    "response_length/min", "prompt_length/mean", "num_turns/mean", "tool_call_counts/mean", "perf/throughput",
}
TIMING_KEYS = {f"timing_s/{k}" for k in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step")}
VAL_KEYS = {"val-core/arith/reward/mean@1", "val-aux/arith/acc/mean@1", "val-aux/arith/tool_call_counts/mean@1"}
DEMO_ENV = ("MLFLOW_TRACKING_URI", "OTEL_RL_SPOOL_DIR", "OTEL_RL_JSONL_PATH", "VERL_FILE_LOGGER_PATH",
            "VERL_FILE_LOGGER_ROOT", "WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "SWANLAB_MODE", "SWANLAB_API_KEY",
            "SWANLAB_LOG_DIR", "OTEL_RL_EXPORTERS", "OTEL_RL_MAX_SAMPLES", "OTEL_RL_TRACE_BACKEND", "OTEL_SDK_DISABLED",
            "OTEL_RL_EXPORT_PROCESS_CPUS")


def mlflow_key(key: str) -> str:
    return key.replace("@", "_at_")  # the MLflow exporter's (verl's) rule for a character MLflow rejects


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One short demo run through `otel-rl demo` (in process); every Handle.log call recorded."""
    mp = pytest.MonkeyPatch()
    for var in DEMO_ENV:
        mp.delenv(var, raising=False)
    out = tmp_path_factory.mktemp("demo")
    calls: list[tuple[int, dict]] = []
    real_log = otel_rl.Handle.log

    def recording_log(self, data, step=None):
        calls.append((step, dict(data)))
        return real_log(self, data, step)

    mp.setattr(otel_rl.Handle, "log", recording_log)
    stdout = io.StringIO()
    mp.setattr("sys.stdout", stdout)
    try:
        rc = cli.main(["demo", "--output-dir", str(out), *ARGS])
    finally:
        mp.undo()
    assert rc == 0
    assert "MLFLOW_TRACKING_URI" not in os.environ  # the demo's defaults do not leak out of the run
    uri = "sqlite:///" + str(out / "mlruns.db")
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("otel_rl_demo")
    (run,) = client.search_runs([exp.experiment_id])
    return {"out": out, "calls": calls, "stdout": stdout.getvalue(), "uri": uri, "client": client, "exp": exp,
            "run": run}


def test_every_step_has_verl_metrics_and_timers(demo_run):
    by_step: dict[int, set] = {}
    for step, data in demo_run["calls"]:
        by_step.setdefault(step, set()).update(data)
    assert sorted(by_step) == list(range(STEPS + 1))
    assert VAL_KEYS | {"timing_s/testing", "timing_s/pretrain", "pretrain/loss"} <= by_step[0]
    for s in range(1, STEPS + 1):
        assert TRAIN_KEYS | TIMING_KEYS <= by_step[s], s
    for s in (2, 4):  # test_freq=2, and the last step
        assert VAL_KEYS | {"timing_s/testing"} <= by_step[s]


def test_jsonl_has_one_line_per_log_call(demo_run):
    path = demo_run["out"] / "otel_rl_demo" / "grpo_arith_seed3.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(demo_run["calls"])
    for line, (step, data) in zip(lines, demo_run["calls"]):
        assert line["step"] == step
        assert line["data"] == pytest.approx(data)


def test_mlflow_run_has_every_metric_at_every_step(demo_run):
    client, run = demo_run["client"], demo_run["run"]
    assert run.info.run_name == "grpo_arith_seed3"
    assert run.data.params["trainer/experiment_name"] == "grpo_arith_seed3"
    assert run.data.params["actor_rollout_ref/rollout/n"] == str(N)
    want: dict[str, dict[int, float]] = {}
    for step, data in demo_run["calls"]:
        for k, v in data.items():
            want.setdefault(mlflow_key(k), {})[step] = float(v)
    assert set(run.data.metrics) == set(want)
    for key, points in want.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx(points), key


def test_traces_are_tagged_linked_and_sampled(demo_run):
    exp, run = demo_run["exp"], demo_run["run"]
    run_id_tag = run.data.tags["rl.run.id"]
    mlflow.set_tracking_uri(demo_run["uri"])
    try:
        traces = mlflow.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, return_type="list",
                                      max_results=1000)
        step3 = mlflow.search_traces(locations=[exp.experiment_id], filter_string="tags.step = '3'",
                                     return_type="list", max_results=1000)
    finally:
        mlflow.set_tracking_uri(None)
    assert traces and len(step3) == MAX_SAMPLES * N
    seen: dict[tuple[int, bool], dict[int, set]] = {}
    for t in traces:
        tags = t.info.tags
        step, idx, r = int(tags["step"]), int(tags["sample_index"]), int(tags["rollout_n"])
        validate = {"True": True, "False": False}[tags["validate"]]
        seen.setdefault((step, validate), {}).setdefault(idx, set()).add(r)
    for s in range(1, STEPS + 1):  # training: the chosen samples, each with all its rollouts
        chosen = choose(run_id_tag, s, range(BATCH), MAX_SAMPLES)
        assert seen[(s, False)] == {i: set(range(N)) for i in chosen}, s
    for s in (0, 2, 4):  # validation: n=1
        assert seen[(s, True)] == {i: {0} for i in choose(run_id_tag, s, range(VAL), MAX_SAMPLES)}
    assert set(seen) == {(s, False) for s in range(1, STEPS + 1)} | {(s, True) for s in (0, 2, 4)}


def test_trace_span_tree(demo_run):
    exp, run = demo_run["exp"], demo_run["run"]
    mlflow.set_tracking_uri(demo_run["uri"])
    try:
        traces = mlflow.search_traces(locations=[exp.experiment_id], run_id=run.info.run_id, return_type="list",
                                      max_results=1000)
    finally:
        mlflow.set_tracking_uri(None)
    kinds: dict[str, int] = {}
    for t in traces:
        spans = t.data.spans
        root = next(s for s in spans if s.parent_id is None)
        assert root.name == "agent_loop" and root.span_type == "AGENT"
        assert root.attributes["rl.reward"] in (0.0, 1.0)
        for s in spans:
            kinds[s.span_type] = kinds.get(s.span_type, 0) + 1
            if s.span_type == "LLM":
                assert s.name == "chat tiny-transformer"
                assert s.inputs["prompt_ids"] == s.outputs["prompt_ids"]
                assert s.outputs["prompt_text"].startswith("<s>")  # token2text
                assert s.attributes["gen_ai.usage.output_tokens"] == len(s.outputs["response_ids"])
            elif s.span_type == "TOOL":
                assert s.name == "execute_tool calculator"
                assert s.attributes["gen_ai.tool.call.id"].startswith("call_")
                a, op, b = s.inputs["expression"].partition("*") if "*" in s.inputs["expression"] \
                    else s.inputs["expression"].partition("+")
                assert s.outputs["result"] == (int(a) * int(b) if op == "*" else int(a) + int(b))
            elif s.span_type == "EVALUATOR":
                assert s.name == "compute_score" and s.outputs == root.attributes["rl.reward"]
        assert sum(s.span_type == "EVALUATOR" for s in spans) == 1
    assert kinds["AGENT"] == len(traces) and kinds["LLM"] >= len(traces)


def test_validation_generations_table(demo_run):
    client, exp, run = demo_run["client"], demo_run["exp"], demo_run["run"]
    mlflow.set_tracking_uri(demo_run["uri"])  # load_table searches runs with the fluent API
    try:
        df = client.load_table(exp.experiment_id, "val_generations/step_4.json", run_ids=[run.info.run_id])
    finally:
        mlflow.set_tracking_uri(None)
    assert len(df) == 5  # trainer.log_val_generations
    assert all(x.startswith("<s>") for x in df["input"])
    assert Path(exp.artifact_location.removeprefix("file://")).is_relative_to(demo_run["out"])


def test_summary(demo_run):
    text, uri = demo_run["stdout"], demo_run["uri"]
    assert f"mlflow ui --backend-store-uri {uri}" in text
    assert "tags.step = '3'" in text
    assert "validation reward (val-core/arith/reward/mean@1):" in text
    assert str(demo_run["out"] / "otel_rl_demo" / "grpo_arith_seed3.jsonl") in text


def test_telemetry_does_not_change_the_run(demo_run):
    """The same seed with every exporter off gives the same training (only timings differ)."""
    cfg = build_config([a for a in ARGS if "=" in a and not a.startswith("--")] +
                       [f"trainer.total_training_steps={STEPS}", "trainer.logger=[]",
                        "actor_rollout_ref.rollout.trace.backend=null"], seed=3)
    got: dict[int, dict] = {}
    with otel_rl.init(cfg) as h:
        assert h.exporters == []
        assert not h.tracing
        GRPOTrainer(cfg, on_step=lambda s, m: got.setdefault(s, dict(m))).fit()
    logged = {s: d for s, d in demo_run["calls"] if not any(k.startswith("timing_s/") for k in d)}
    for s, data in logged.items():
        same = {k: v for k, v in data.items() if not k.startswith("perf/")}
        assert {k: got[s][k] for k in same} == same, s


def test_prepare_config_and_environment(monkeypatch, tmp_path):
    for var in DEMO_ENV:
        monkeypatch.delenv(var, raising=False)
    parser = __import__("argparse").ArgumentParser()
    demo_cli.add_arguments(parser)
    args = parser.parse_args(["--output-dir", str(tmp_path), "--seed", "7", "--wandb", "--swanlab",
                              "--prometheus-port", "0", "--otlp-endpoint", "http://127.0.0.1:4318",
                              "trainer.logger='[\"console\",\"file\"]'", "actor_rollout_ref.rollout.n=2"])
    cfg, env, out = demo_cli.prepare(args)
    assert cfg["trainer"]["logger"] == ["console", "file", "wandb", "swanlab", "otlp", "prometheus"]
    assert cfg["trainer"]["experiment_name"] == "grpo_arith_seed7" and cfg["trainer"]["seed"] == 7
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 2
    assert cfg["otel_rl"] == {"otlp_endpoint": "http://127.0.0.1:4318", "prometheus_port": 0,
                              "jsonl_path": str(tmp_path / "otel_rl_demo" / "grpo_arith_seed7.jsonl"),
                              "spool_dir": str(tmp_path / "spool"),
                              "export_process_cpus": "last"}  # one torch thread: the export process beside it
    assert env == {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlruns.db",  # trace.backend=mlflow
                   "OTEL_RL_MLFLOW_ARTIFACT_LOCATION": str(tmp_path / "mlartifacts"),
                   "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                   "SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": str(tmp_path / "swanlog")}
    resolved = otel_rl.config.resolve(cfg)
    assert resolved.max_samples == 4 and resolved.trace_backend == "mlflow" and resolved.token2text
    assert resolved.export_process_cpus == "last"
    more_threads = parser.parse_args(["--output-dir", str(tmp_path), "trainer.torch_threads=2"])
    assert "export_process_cpus" not in demo_cli.prepare(more_threads)[0].get("otel_rl", {})
    # what the user set wins
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere.db")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    monkeypatch.setenv("SWANLAB_MODE", "local")
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "/x.jsonl")
    monkeypatch.setenv("OTEL_RL_SPOOL_DIR", "/spool")
    monkeypatch.setenv("OTEL_RL_EXPORT_PROCESS_CPUS", "off")
    cfg, env, _ = demo_cli.prepare(parser.parse_args(["--output-dir", str(tmp_path), "--wandb", "--swanlab"]))
    assert env == {"WANDB_DIR": str(tmp_path), "SWANLAB_LOG_DIR": str(tmp_path / "swanlog")}
    assert "otel_rl" not in cfg


def test_progress_line_without_a_terminal():
    stream = io.StringIO()
    p = Progress(20, stream=stream, use_tqdm=False)  # the built-in line (tqdm may or may not be installed)
    for s in range(21):
        p.update(s, {"critic/score/mean": s / 20, "tool_call_counts/mean": 0.5,
                     **({"val-core/arith/reward/mean@1": 0.25} if s % 10 == 0 else {})})
    p.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("otel-rl demo [########################] 20/20")
    assert "reward 1.000" in lines[-1] and "val 0.250" in lines[-1]


@pytest.mark.slow
def test_policy_learns_to_use_the_calculator():
    """A slightly longer run (no telemetry): validation reward and tool use go up."""
    cfg = build_config(["trainer.total_training_steps=40", "trainer.test_freq=20", "trainer.logger=[]",
                        "actor_rollout_ref.rollout.trace.backend=null"], seed=0)
    steps: dict[int, dict] = {}
    with otel_rl.init(cfg):
        trainer = GRPOTrainer(cfg, on_step=lambda s, m: steps.setdefault(s, m))
        history = trainer.fit()
    (s0, start), (s1, end) = history[0], history[-1]
    assert (s0, s1) == (0, 40)
    assert start <= 0.1 and end >= start + 0.5, history
    assert steps[40]["tool_call_counts/mean"] > 0.8 > steps[1]["tool_call_counts/mean"]


@pytest.mark.slow
def test_wandb_and_swanlab_offline_by_default(tmp_path):
    """--wandb --swanlab without keys: offline runs under the output directory, read back."""
    import subprocess
    import sys

    wandb_reader = pytest.importorskip("otel_rl_wandb.reader")
    swanlab_offline = pytest.importorskip("otel_rl_swanlab.offline")
    env = {k: v for k, v in os.environ.items() if k not in DEMO_ENV}
    proc = subprocess.run([sys.executable, "-m", "otel_rl.cli", "demo", "--quick", "--no-progress", "--wandb",
                           "--swanlab", "--output-dir", str(tmp_path), "trainer.logger=[file]",
                           "actor_rollout_ref.rollout.trace.backend=null"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wandb (offline)" in proc.stdout and "swanlab (offline)" in proc.stdout
    (run_dir,) = wandb_reader.find_run_dirs(str(tmp_path))
    rows = wandb_reader.read_run(run_dir).rows_by("train/global_step")
    assert set(range(1, 7)) <= set(rows) and all("critic/score/mean" in rows[s] for s in range(1, 7))
    (sw,) = swanlab_offline.read_runs(tmp_path / "swanlog")
    assert set(range(1, 7)) <= set(sw.scalars)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_keeps_stdout_above_it(monkeypatch):
    out, err = _Terminal(), _Terminal()
    monkeypatch.setattr("sys.stdout", out)
    p = Progress(4, stream=err, use_tqdm=False)
    import sys

    assert sys.stdout is not out  # stdout goes through the bar while it is shown
    p.update(1, {"critic/score/mean": 0.5})
    print("step:1 - actor/pg_loss:0.1")  # what the console exporter writes, from any thread
    p.update(2, {"critic/score/mean": 0.75})
    p.close()
    assert sys.stdout is out
    assert out.getvalue() == "step:1 - actor/pg_loss:0.1\n"
    bar1 = "otel-rl demo [######..................] 1/4  reward 0.500"
    bar2 = "otel-rl demo [############............] 2/4  reward 0.750"
    # drawn; cleared before the stdout line (written whole: print writes the text and the newline
    # separately); drawn again after it; replaced by step 2's; ended by a newline
    parts = err.getvalue().split("\r\x1b[K")
    assert len(parts) == 3 and parts[0].startswith(bar1) and parts[1].startswith(bar1)
    assert parts[2].startswith(bar2) and parts[2].endswith("\n")


VARYING = ("timing_s/", "perf/")  # wall-clock figures: the same run gives other values each time


@pytest.mark.slow
def test_the_program_leaves_quickly_and_loses_nothing(demo_run, tmp_path):
    """`otel-rl demo` as a program (`python -m otel_rl.cli`, what the console script runs) ends without
    the interpreter's teardown (`cli.quick_exit`): what it wrote is what the same run in process wrote
    (the JSONL file line by line, the MLflow run's metrics and its traces), its run is finished and its
    summary printed whole."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in DEMO_ENV}
    proc = subprocess.run([sys.executable, "-m", "otel_rl.cli", "demo", "--output-dir", str(tmp_path), *ARGS],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == demo_run["stdout"].splitlines()[-1].replace(
        str(demo_run["out"]), str(tmp_path))

    def lines(out: Path) -> list[tuple[int, dict]]:
        rows = [json.loads(x) for x in (out / "otel_rl_demo" / "grpo_arith_seed3.jsonl").read_text().splitlines()]
        return [(r["step"], {k: (None if k.startswith(VARYING) else v) for k, v in r["data"].items()}) for r in rows]

    assert lines(tmp_path) == lines(demo_run["out"])
    client = MlflowClient(tracking_uri="sqlite:///" + str(tmp_path / "mlruns.db"))
    (run,) = client.search_runs([client.get_experiment_by_name("otel_rl_demo").experiment_id])
    assert run.info.status == "FINISHED"
    assert set(run.data.metrics) == set(demo_run["run"].data.metrics)
    for key in run.data.metrics:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        want = {m.step: m.value for m in demo_run["client"].get_metric_history(demo_run["run"].info.run_id, key)}
        assert set(got) == set(want), key
        if not key.startswith(VARYING):
            assert got == pytest.approx(want), key
    n_traces = []
    for uri, r in (("sqlite:///" + str(tmp_path / "mlruns.db"), run), (demo_run["uri"], demo_run["run"])):
        mlflow.set_tracking_uri(uri)
        try:
            n_traces.append(len(mlflow.search_traces(locations=[r.info.experiment_id], run_id=r.info.run_id,
                                                     return_type="list", max_results=1000)))
        finally:
            mlflow.set_tracking_uri(None)
    assert n_traces[0] == n_traces[1] > 0


def test_summary_times_grpo_steps_apart_from_the_supervised_warmup(demo_run):
    import re

    line = next(ln for ln in demo_run["stdout"].splitlines() if "GRPO steps in" in ln)
    m = re.search(r"(\d+) GRPO steps in ([0-9.]+) s .*supervised warm-up of ([0-9.]+) s", line)
    assert m, line
    steps, grpo_s, warmup_s = int(m.group(1)), float(m.group(2)), float(m.group(3))
    step_s = sum(v.get("timing_s/step", 0.0) for s, v in demo_run["calls"] if isinstance(s, int) and s >= 1)
    assert steps == STEPS and warmup_s > 0
    # the GRPO time covers the steps' own timers and not the warm-up that came before them
    assert step_s - 0.05 <= grpo_s < step_s + warmup_s, (grpo_s, step_s, warmup_s)


def test_demo_override_typo_fails_with_the_closest_key(capsys):
    assert cli.main(["demo", "--no-progress", "trainer.total_trainig_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.total_trainig_steps" in err and "'trainer.total_training_steps'" in err and "+trainer" in err
    assert cli.main(["demo", "--no-progress", "data.train_batch_siz=4"]) == 2
    assert "'data.train_batch_size'" in capsys.readouterr().err


def test_demo_without_torch_names_the_extra(tmp_path):
    import subprocess
    import sys

    # torch made unimportable the way Python marks a module that is not there (sys.modules entry None)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from otel_rl.cli import main\n"
            f"raise SystemExit(main(['demo', '--quick', '--no-progress', '--output-dir', {str(tmp_path)!r}, "
            "'trainer.logger=[console]']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "pip install 'otel-rl[demo]'" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_dead_mlflow_uri_summary_points_at_spool_and_replay(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in DEMO_ENV and not k.startswith(("OTEL_", "MLFLOW_"))}
    env.update({"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "2", "NO_PROXY": "127.0.0.1", "MLFLOW_DISABLE_TELEMETRY": "true"})
    res = subprocess.run([sys.executable, "-m", "otel_rl.cli", "demo", "--quick", "--no-progress", "--output-dir",
                          str(tmp_path), "trainer.total_training_steps=2", "trainer.logger=[mlflow]"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    spool = str(tmp_path / "spool")
    assert f"MLflow: http://127.0.0.1:{port} could not be reached" in out, out[-2000:]
    assert f"wait in the spool {spool}" in out
    assert f"otel-rl replay {spool}" in out
    assert "ui --backend-store-uri" not in out
    assert any(p.is_file() and p.stat().st_size > 0 for p in (tmp_path / "spool").rglob("*"))
