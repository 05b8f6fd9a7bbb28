"""How otel-rl's traces and runs read in MLflow: a trajectory's root carries the rollout (prompt, response,
reward, coordinates), MLflow's request / response previews (the trace list's Input and Output columns) are
made of it, and a run has the User and Source tags `mlflow.start_run` gives.  Real sqlite stores, read back
with MlflowClient."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

from mlflow import MlflowClient  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl_mlflow._context import main_file  # noqa: E402
from t2t_tokenizers import CountingTokenizer  # noqa: E402  (tests/ is on sys.path)

from _mlflow_server import server_env  # noqa: E402

SYSTEM = "You are a careful calculator. " * 20  # a long system prompt: the user message is what is shown


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    yield uri
    h = otel_rl.current()
    if h is not None:
        h.shutdown()


@otel_rl.generate(model="chat-model")
def chat(messages: list) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": "2 + 2 = 4"}}]}


@otel_rl.generate(model="tiny")
def generate_ids(prompt_ids: list, tokenizer=None) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": [3, 4]}


def _traces(uri: str, project: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(project)
    return client.search_traces(locations=[exp.experiment_id], max_results=100)


def test_chat_trajectory_shows_its_user_message_response_and_reward(store):
    project = f"chat-{uuid.uuid4().hex[:6]}"
    h = otel_rl.init({}, project=project, experiment="e", exporters=["mlflow"], trace_backend="mlflow",
                     export_process="false", batch_delay_s=0.05)
    with otel_rl.step(7):
        with otel_rl.trajectory(sample_index=3, rollout_n=1) as t:
            chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "Let me think."}, {"role": "user", "content": "Go on."}])
            t.set_reward(0.75)
        with otel_rl.trajectory(sample_index=4, validate=True):  # no LLM call, no reward: only coordinates
            pass
    assert h.flush(60)
    h.shutdown()
    by_index = {tr.info.tags["sample_index"]: tr for tr in _traces(store, project)}
    info = by_index["3"].info
    assert json.loads(info.request_preview) == {"prompt": "What is 2 + 2?", "step": 7, "sample_index": 3,
                                                "rollout_n": 1, "validate": False}
    assert json.loads(info.response_preview) == {"response": "2 + 2 = 4", "reward": 0.75}
    assert {k: info.tags[k] for k in ("step", "sample_index", "rollout_n", "validate", "reward")} == {
        "step": "7", "sample_index": "3", "rollout_n": "1", "validate": "False", "reward": "0.75"}
    bare = by_index["4"].info
    assert json.loads(bare.request_preview) == {"step": 7, "sample_index": 4, "validate": True}
    assert bare.response_preview in (None, "") and "reward" not in bare.tags


@otel_rl.op(kind="REWARD")
def judge(answer: str) -> float:
    return 0.5


@otel_rl.generate(model="text-model")
def complete(prompt: str) -> str:
    return "a" * 3000


def test_long_texts_are_cut_and_the_reward_op_gives_the_reward(store):
    """A prompt argument and a plain-text reply longer than 1000 characters are cut on the root (whole on
    the LLM span); without `set_reward` the REWARD op's number is the reward."""
    project = f"long-{uuid.uuid4().hex[:6]}"
    h = otel_rl.init({}, project=project, experiment="e", exporters=["mlflow"], trace_backend="mlflow",
                     export_process="false", batch_delay_s=0.05)
    with otel_rl.trajectory(step=2, sample_index=0):
        judge(complete("p" * 5000))
    assert h.flush(60)
    h.shutdown()
    (tr,) = _traces(store, project)
    root = next(s for s in tr.data.spans if s.parent_id is None)
    llm = next(s for s in tr.data.spans if s.span_type == "LLM")
    assert root.inputs["prompt"] == "p" * 997 + "..." and llm.inputs == {"prompt": "p" * 5000}
    assert root.outputs == {"response": "a" * 997 + "...", "reward": 0.5} and llm.outputs == "a" * 3000
    assert tr.info.tags["reward"] == "0.5"
    assert tr.info.request_preview.startswith('{"prompt": "ppp') and len(tr.info.request_preview) <= 1000


def test_token2text_prompt_and_response_are_the_decoded_texts(store):
    project = f"t2t-{uuid.uuid4().hex[:6]}"
    h = otel_rl.init({}, project=project, experiment="e", exporters=["mlflow"], trace_backend="mlflow",
                     export_process="false", token2text=True, tokenizer=CountingTokenizer(), batch_delay_s=0.05)
    with otel_rl.step(1):
        with otel_rl.trajectory(sample_index=0) as t:
            generate_ids([0, 1, 2])
            generate_ids([0, 1, 2, 3, 4])  # the second turn's reply is the final response
            t.set_reward(1)
    assert h.flush(60)
    h.shutdown()
    (tr,) = _traces(store, project)
    assert json.loads(tr.info.request_preview)["prompt"] == "abc"  # the first call's prompt, decoded
    assert json.loads(tr.info.response_preview) == {"response": "de", "reward": 1.0}


def test_run_source_and_user_are_the_training_scripts_from_the_export_process(tmp_path):
    """The run is created in the export process (`python -c ...`): its Source is still the training
    script, as `mlflow.start_run` in that script would set it."""
    script = tmp_path / "train_grpo.py"
    script.write_text(textwrap.dedent("""
        import otel_rl
        h = otel_rl.init({}, project="src", experiment="e", exporters=["mlflow"], export_process="true")
        assert h._export_process is not None
        h.log({"loss": 1.0}, step=1)
        h.shutdown()
    """))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = server_env()
    env.update(MLFLOW_TRACKING_URI=uri, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("src").experiment_id])
    assert run.data.tags["mlflow.source.name"] == str(script)
    assert run.data.tags["mlflow.source.type"] == "LOCAL"
    assert run.data.tags["mlflow.user"] == getpass.getuser()


@pytest.mark.parametrize("args, expected", [
    (["python", "train.py", "--lr", "1"], "train.py"),
    (["python", "-u", "-W", "ignore", "-X", "dev", "/abs/train.py"], "/abs/train.py"),
    (["python", "-c", "import x"], "-c"),
    (["python", "-Wignore", "-m", "json.tool"], str(Path(json.__file__).with_name("tool.py"))),
    (["python", "-m", "no_such_module_here"], "no_such_module_here"),
    (["python"], "<console>"),
])
def test_main_file_is_what_python_puts_in_argv0(args, expected):
    assert main_file(args) == expected
