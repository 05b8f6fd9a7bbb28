"""`otel_rl.integrations.transformers` with the real libraries: transformers.Trainer and TRL's GRPOTrainer.

A tiny randomly initialised Llama and a character tokenizer are built in the test (tiny_lm.py), training
runs a few steps on CPU with no hub, and everything is read back from a real MLflow sqlite store (runs,
metric histories, traces) and from the JSONL file, against the trainer's own ``state.log_history``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import uuid

# no hub, no tracker's own network calls: set before the libraries read them at import
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_ERROR_REPORTING", "false")

import pytest

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("otel_rl_mlflow")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl import semconv as sc  # noqa: E402
from otel_rl.integrations.transformers import OtelRLCallback, trace_rewards  # noqa: E402
from otel_rl.records import Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402

from . import tiny_lm  # noqa: E402


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    # one database for the module: creating one runs MLflow's migrations (seconds)
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-sqlite')}/mlflow.db"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path, sqlite_uri):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for k in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "OTEL_RL_EXPERIMENT", "OTEL_RL_PROJECT", "OTEL_RL_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown()


def _numbers(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "step" and isinstance(v, (int, float))}


def _mlflow_run(project: str):
    client = MlflowClient()
    exp = client.get_experiment_by_name(project)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    return client, exp, run


def _check_history_in_mlflow(client: MlflowClient, run, history: list[dict]) -> int:
    """Every key and value of every log_history record is in MLflow at the record's step."""
    checked = 0
    cache: dict[str, list] = {}
    for entry in history:
        for key, value in _numbers(entry).items():
            points = cache.setdefault(key, client.get_metric_history(run.info.run_id, key))
            at_step = [m.value for m in points if m.step == entry["step"]]
            assert any(v == float(value) or (math.isnan(v) and math.isnan(value)) for v in at_step), (
                key,
                entry["step"],
                value,
                at_step,
            )
            checked += 1
    # and nothing else: MLflow holds exactly the keys the trainer logged
    assert set(run.data.metrics) == {k for e in history for k in _numbers(e)}
    return checked


def _check_history_in_jsonl(path, history: list[dict]) -> None:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    want = [{"step": e["step"], "data": _numbers(e)} for e in history]
    assert lines == want


def test_trainer_logs_every_log_history_value_at_its_step_to_mlflow_and_jsonl(tmp_path):
    tok = tiny_lm.tokenizer()
    project = f"hf-{uuid.uuid4().hex[:8]}"
    jsonl = tmp_path / "metrics.jsonl"
    cap = CaptureExporter()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        run_name="tiny-sft",
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        learning_rate=1e-3,
        disable_tqdm=True,
    )
    cb = OtelRLCallback(
        project=project,
        exporters=["mlflow", "file", cap],
        jsonl_path=str(jsonl),
        export_process=False,
        batch_delay_s=0.05,
    )
    trainer = transformers.Trainer(
        model=tiny_lm.model(tok),
        args=args,
        train_dataset=tiny_lm.lm_dataset(tok, 16),
        eval_dataset=tiny_lm.lm_dataset(tok, 8),
        callbacks=[cb],
    )
    trainer.train()
    history = trainer.state.log_history
    h = otel_rl.current()
    assert h is not None and not h.closed  # left running after training (a later evaluate() joins the run)
    assert h.config.experiment == "tiny-sft" and h.config.project == project
    cap.collect()
    steps = cap.spans_named(sc.SPAN_STEP)
    evaluations = cap.spans_named("evaluate")
    h.shutdown()

    # the history holds train records, an evaluation and the closing summary
    keys = {k for e in history for k in e}
    assert {"loss", "learning_rate", "grad_norm", "eval_loss", "train_runtime", "train_loss"} <= keys
    client, exp, run = _mlflow_run(project)
    assert run.info.run_name == "tiny-sft"
    assert _check_history_in_mlflow(client, run, history) == sum(len(_numbers(e)) for e in history)
    _check_history_in_jsonl(jsonl, history)
    # the run config is the TrainingArguments (and the model's config)
    assert run.data.params["learning_rate"] == "0.001" and run.data.params["max_steps"] == "3"
    # one rl.step span per optimizer step, numbered like the metrics, each covering its step's work
    assert sorted(s.attributes[sc.RL_STEP] for s in steps) == [1, 2, 3]
    assert all(s.end_time > s.start_time for s in steps)
    # each evaluation: a span at its step lasting what the trainer measured
    evals = [e for e in history if "eval_runtime" in e]
    assert [e["step"] for e in evals][:1] == [2]
    assert [(s.attributes[sc.RL_STEP], round((s.end_time - s.start_time) / 1e9, 3)) for s in evaluations] == [
        (e["step"], round(e["eval_runtime"], 3)) for e in evals
    ]


def test_callback_uses_a_pipeline_the_program_started_and_only_rank_zero_logs(tmp_path):
    tok = tiny_lm.tokenizer()
    cap = CaptureExporter()
    h = otel_rl.init(project="mine", experiment="kept", exporters=[cap], batch_delay_s=0.05)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    cb = OtelRLCallback(project="ignored", exporters=["console"])
    trainer = transformers.Trainer(
        model=tiny_lm.model(tok), args=args, train_dataset=tiny_lm.lm_dataset(tok, 8), callbacks=[cb]
    )
    trainer.train()
    assert otel_rl.current() is h and h.config.experiment == "kept"
    logged = [(m.step, m.values) for m in cap.collect().step_metrics()]
    assert logged == [(e["step"], _numbers(e)) for e in trainer.state.log_history]

    # another process of the job (not world process zero) traces its steps but logs no metrics
    cap.clear()
    trainer.state.is_world_process_zero = False
    cb.on_log(args, trainer.state, trainer.control, logs={"loss": 1.0})
    cb.on_step_begin(args, trainer.state, trainer.control)
    cb.on_step_end(args, trainer.state, trainer.control)
    cap.collect()
    assert cap.step_metrics() == []
    assert [s.attributes[sc.RL_STEP] for s in cap.spans_named(sc.SPAN_STEP)] == [trainer.state.global_step + 1]


def test_sft_trainer_metrics_are_its_log_history(tmp_path):
    from datasets import Dataset

    tok = tiny_lm.tokenizer()
    cap = CaptureExporter()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        max_length=16,
    )
    trainer = trl.SFTTrainer(
        model=tiny_lm.model(tok),
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_dict({"text": [p + "1" for p in tiny_lm.prompts(8)]}),
        callbacks=[OtelRLCallback(exporters=[cap], batch_delay_s=0.05)],
    )
    trainer.train()
    logged = [(m.step, m.values) for m in cap.collect().step_metrics()]
    assert logged == [(e["step"], _numbers(e)) for e in trainer.state.log_history]
    assert {"loss", "mean_token_accuracy", "num_tokens"} <= set(logged[0][1])
    assert otel_rl.current().config.experiment == "sft"  # the output directory's name


def test_run_name_gives_way_to_the_environment_and_to_the_callbacks_own_arguments(tmp_path, monkeypatch):
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), run_name="from-args", use_cpu=True)
    cap = CaptureExporter()
    monkeypatch.setenv("OTEL_RL_EXPERIMENT", "from-env")
    monkeypatch.setenv("OTEL_RL_RUN_ID", "env-run-id")
    OtelRLCallback(exporters=[cap]).on_train_begin(args, state, control)
    h = otel_rl.current()
    assert (h.config.experiment, h.run_id) == ("from-env", "env-run-id")
    assert cap.collect().run_starts()[0].config["run_name"] == "from-args"  # the run config: the arguments
    otel_rl.shutdown()
    cap = CaptureExporter()
    OtelRLCallback(exporters=[cap], experiment="given", config={"lr": 1}).on_train_begin(args, state, control)
    h = otel_rl.current()
    assert h.config.experiment == "given" and cap.collect().run_starts()[0].config == {"lr": 1}
    otel_rl.shutdown()


def test_report_to_naming_a_tracker_otel_rl_also_writes_warns_once(tmp_path, caplog):
    cb = OtelRLCallback(exporters=["file"], jsonl_path=str(tmp_path / "m.jsonl"))
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    quiet = transformers.TrainingArguments(output_dir=str(tmp_path / "a"), report_to="none", use_cpu=True)
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        cb.on_train_begin(quiet, state, control)
    assert "logged twice" not in caplog.text
    otel_rl.shutdown()
    loud = transformers.TrainingArguments(output_dir=str(tmp_path / "c"), report_to="none", use_cpu=True)
    loud.report_to = ["mlflow", "tensorboard"]
    cb = OtelRLCallback(exporters=["mlflow"], export_process=False)
    with caplog.at_level(logging.WARNING, logger="otel_rl"):
        cb.on_train_begin(loud, state, control)
        cb.on_train_begin(loud, state, control)
    assert caplog.text.count("logged twice") == 1 and "report_to=['mlflow', 'tensorboard']" in caplog.text
    assert "both write to mlflow" in caplog.text


# ----------------------------------------------------------------------------- GRPO


def count_a(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


async def length_bonus(completions, **kwargs):  # async: TRL runs it on its own event loop thread
    return [len(c) / 10 for c in completions]


def _grpo(tmp_path, reward_funcs, cb, steps=2, eval_prompts=None, **extra):
    from datasets import Dataset

    tok = tiny_lm.tokenizer()
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        run_name="tiny-grpo",
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        log_completions=True,
        seed=0,
        **extra,
    )
    return trl.GRPOTrainer(
        model=tiny_lm.model(tok),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": tiny_lm.prompts(16)}),
        eval_dataset=None if eval_prompts is None else Dataset.from_dict({"prompt": eval_prompts}),
        processing_class=tok,
        callbacks=[cb],
    )


def test_grpo_metrics_and_completions_reach_mlflow_as_runs_and_traces_by_step(tmp_path):
    project = f"grpo-{uuid.uuid4().hex[:8]}"
    cap = CaptureExporter()
    seen: list[tuple[int, list, list, list]] = []

    def recorded(completions, prompts, trainer_state, **kwargs):
        seen.append((trainer_state.global_step + 1, list(prompts), list(completions), count_a(completions)))
        return count_a(completions)

    recorded.__name__ = "count_a"
    funcs = trace_rewards([recorded, length_bonus])
    assert [f.__name__ for f in funcs] == ["count_a", "length_bonus"]
    assert inspect.iscoroutinefunction(funcs[1]) and not inspect.iscoroutinefunction(funcs[0])
    jsonl = tmp_path / "metrics.jsonl"
    cb = OtelRLCallback(
        project=project,
        exporters=["mlflow", "file", cap],
        trace_backend="mlflow",
        jsonl_path=str(jsonl),
        export_process=False,
        batch_delay_s=0.05,
    )
    trainer = _grpo(tmp_path, funcs, cb)
    trainer.train()
    history = trainer.state.log_history
    cap.collect()
    otel_rl.shutdown()

    client, exp, run = _mlflow_run(project)
    _check_history_in_mlflow(client, run, history)
    _check_history_in_jsonl(jsonl, history)
    assert {
        "reward",
        "reward_std",
        "rewards/count_a/mean",
        "rewards/length_bonus/mean",
        "completions/mean_length",
        "kl" if "kl" in history[0] else "entropy",
    } <= set(run.data.metrics)

    # every completion of every step: one trace, findable by step, with each reward function's score
    assert [s for s, *_ in seen] == [1, 2]
    for step, prompts, completions, scores in seen:
        traces = mlflow.search_traces(
            locations=[exp.experiment_id], filter_string=f"tags.step = '{step}'", return_type="list", max_results=100
        )
        assert len(traces) == len(completions) == 4
        got = {}
        for tr in traces:
            spans = {s.name: s for s in tr.data.spans}
            root = spans["grpo.completion"]
            comp = spans["completion"]
            assert comp.inputs["prompt"] == prompts[int(tr.info.tags[sc.TAG_SAMPLE_INDEX]) * 2]
            r1 = spans["reward count_a"].outputs
            r2 = spans["reward length_bonus"].outputs
            assert root.attributes[sc.RL_REWARD] == pytest.approx(r1 + r2)
            got[(tr.info.tags[sc.TAG_SAMPLE_INDEX], tr.info.tags[sc.TAG_ROLLOUT_N])] = (comp.outputs["completion"], r1)
        want = {(str(i // 2), str(i % 2)): (c, s) for i, (c, s) in enumerate(zip(completions, scores))}
        assert got == want
    linked = mlflow.search_traces(
        locations=[exp.experiment_id], run_id=run.info.run_id, return_type="list", max_results=100
    )
    assert len(linked) == 8  # every trace is linked to the run
    # TRL's own metric for the same rewards agrees with the traced scores
    for (_, _, _, scores), entry in zip(seen, [e for e in history if "reward" in e]):
        assert entry["rewards/count_a/mean"] == pytest.approx(sum(scores) / len(scores))
    # trajectories link to their step span
    trajs = cap.of_type(Trajectory)
    steps = {s.attributes[sc.RL_STEP]: s.context.span_id for s in cap.spans_named(sc.SPAN_STEP)}
    assert {t.step for t in trajs} == {1, 2}
    roots = cap.spans_named("grpo.completion")
    assert len(roots) == 8
    assert all([link.context.span_id for link in r.links] == [steps[r.attributes[sc.RL_STEP]]] for r in roots)


def test_grpo_max_samples_traces_the_same_groups_in_every_run_and_keeps_a_failing_reward(tmp_path):
    def chosen_in_a_run(sub):
        cap = CaptureExporter()
        cb = OtelRLCallback(run_id="fixed-run", exporters=[cap], max_samples=1, batch_delay_s=0.05)
        _grpo(tmp_path / sub, trace_rewards([count_a]), cb).train()
        cap.collect()
        otel_rl.shutdown()
        return sorted((t.step, t.sample_index, t.rollout_n) for t in cap.of_type(Trajectory))

    first = chosen_in_a_run("a")
    assert len(first) == 4 and len({(s, g) for s, g, _ in first}) == 2  # one group of two per step
    assert chosen_in_a_run("b") == first

    calls = []

    def flaky(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("judge unavailable")
        return [0.5] * len(completions)

    cap = CaptureExporter()
    cb = OtelRLCallback(exporters=[cap], max_samples=1, batch_delay_s=0.05)
    trainer = _grpo(tmp_path / "c", trace_rewards([count_a, flaky]), cb, steps=3)
    with pytest.raises(ZeroDivisionError, match="judge unavailable") as info:
        trainer.train()
    assert info.traceback[-1].name == "flaky"  # TRL sees the reward function's own exception
    cap.collect()
    otel_rl.shutdown()
    failed = [t for t in cap.of_type(Trajectory) if t.step == 2]
    assert len(failed) == 4  # the whole batch is kept, sampled or not
    for t in failed:
        assert t.root.status == "ERROR"
        (bad,) = [n for n in t.root.walk() if n.name == "reward flaky"]
        assert bad.status == "ERROR" and bad.events[0]["attributes"][sc.EXCEPTION_TYPE] == "ZeroDivisionError"


# ----------------------------------------------------------------------------- several processes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_grpo_one_run_metrics_from_rank_zero_and_every_ranks_completions(tmp_path, sqlite_uri):
    """A real two-process job (torch.distributed over gloo, CPU): one shared run, metrics from the main
    process only (read back from MLflow and each process's JSONL), steps traced in both, and every
    completion of both processes one trace, numbered as in the whole generation batch."""
    import subprocess
    import sys

    MlflowClient().search_experiments()  # the store's tables exist before two processes open it
    project = f"ddp-{uuid.uuid4().hex[:8]}"
    worker = os.path.join(os.path.dirname(__file__), "ddp_grpo_worker.py")
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, worker, str(tmp_path), project],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=600)[0])
        finally:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["process_index"], r0["world_process_zero"]) == (0, True)
    assert (r1["process_index"], r1["world_process_zero"]) == (1, False)

    # one run: rank 0's run id in both processes, one MLflow run holding exactly the main process's history
    assert r0["run_id"] == r1["run_id"]
    client, exp, run = _mlflow_run(project)
    assert run.info.run_name == "ddp-grpo"
    history = r0["log_history"]
    _check_history_in_mlflow(client, run, history)
    _check_history_in_jsonl(tmp_path / "metrics-rank0.jsonl", history)
    assert r0["metrics_logged"] == [[e["step"], _numbers(e)] for e in history]
    # the other process logs no metric at all
    assert r1["metrics_logged"] == []
    rank1_jsonl = tmp_path / "metrics-rank1.jsonl"
    assert not rank1_jsonl.exists() or rank1_jsonl.read_text() == ""
    # ... and traces its steps, with its rank
    assert sorted(r0["step_spans"]) == [[1, 0], [2, 0]]
    assert sorted(r1["step_spans"]) == [[1, 1], [2, 1]]

    # every completion of both processes: one trace of the run, numbered in the whole batch of its step
    assert all(t[0] == r0["run_id"] for t in r0["trajectories"] + r1["trajectories"])
    steps = sorted({s["step"] for s in r0["scored"]})
    assert steps == [1, 2] and steps == sorted({s["step"] for s in r1["scored"]})
    for step in steps:
        (b0,) = [s for s in r0["scored"] if s["step"] == step]
        (b1,) = [s for s in r1["scored"] if s["step"] == step]
        completions, scores = b0["completions"] + b1["completions"], b0["scores"] + b1["scores"]
        prompts = b0["prompts"] + b1["prompts"]
        assert len(completions) == 6 and prompts[2] == prompts[3]  # a prompt's group spans the two processes
        traces = mlflow.search_traces(
            locations=[exp.experiment_id], filter_string=f"tags.step = '{step}'", return_type="list", max_results=100
        )
        got = {}
        for tr in traces:
            spans = {s.name: s for s in tr.data.spans}
            key = (int(tr.info.tags[sc.TAG_SAMPLE_INDEX]), int(tr.info.tags[sc.TAG_ROLLOUT_N]))
            assert key not in got, f"two traces of step {step} numbered {key}"
            got[key] = (
                spans["completion"].inputs["prompt"],
                spans["completion"].outputs["completion"],
                spans["reward count_a"].outputs,
            )
        assert got == {divmod(i, 2): (p, c, s) for i, (p, c, s) in enumerate(zip(prompts, completions, scores))}
    linked = mlflow.search_traces(
        locations=[exp.experiment_id], run_id=run.info.run_id, return_type="list", max_results=100
    )
    assert len(linked) == 12


def test_grpo_evaluation_completions_are_validation_traces_numbered_over_its_batches(tmp_path):
    seen: list[tuple[int, list, list]] = []

    def count_a(completions, prompts, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, list(prompts), list(completions)))
        return [float(len(c)) for c in completions]

    cap = CaptureExporter()
    cb = OtelRLCallback(exporters=[cap], batch_delay_s=0.05)
    # 6 prompts, 2 completions each, 4 completions a batch: 3 batches at one step
    eval_prompts = [f"{i}+{i}=" for i in range(6)]
    trainer = _grpo(
        tmp_path,
        trace_rewards([count_a]),
        cb,
        steps=1,
        eval_prompts=eval_prompts,
        num_generations_eval=2,
        per_device_eval_batch_size=4,
    )
    trainer.train()
    cap.collect()
    cap.clear()  # the training step's
    seen.clear()
    metrics = trainer.evaluate()
    cap.collect()
    otel_rl.shutdown()
    assert "eval_reward" in metrics
    assert len(seen) == 3 and {s for s, *_ in seen} == {1}
    prompts = [p for _, ps, _ in seen for p in ps]
    completions = [c for *_, cs in seen for c in cs]
    assert sorted(prompts[::2]) == eval_prompts and prompts[::2] == prompts[1::2]  # each prompt twice in a row
    got = {}
    for t in cap.of_type(Trajectory):
        assert t.validate and t.step == 1
        key = (t.sample_index, t.rollout_n)
        assert key not in got, f"two validation traces numbered {key}"
        (comp,) = [n for n in t.root.walk() if n.name == "completion"]
        got[key] = (json.loads(comp.inputs)["prompt"], json.loads(comp.output)["completion"])
    assert got == {divmod(i, 2): pc for i, pc in enumerate(zip(prompts, completions))}
    assert [s.attributes[sc.RL_STEP] for s in cap.spans_named("evaluate")] == [1]
