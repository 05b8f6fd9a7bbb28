"""`OtelRLCallback` into trackers other than MLflow, the way a verl user with ``trainer.logger=["wandb"]`` and
``trace.backend=weave`` gets them: a GRPO run's metrics in an offline wandb run, read back from its run file,
and its completions as Weave calls, read back from Weave's write-ahead log (no W&B service: the WAL's
sender is off, as in tests/trackers/test_weave.py).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
wandb = pytest.importorskip("wandb")
weave = pytest.importorskip("weave")
pytest.importorskip("otel_rl_wandb")
pytest.importorskip("otel_rl_weave")

from otel_rl_wandb import STEP_METRIC, wandb_run_id  # noqa: E402
from otel_rl_wandb.reader import find_run_dirs, read_run  # noqa: E402
from otel_rl_weave.wal import read_calls  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl.integrations.transformers import OtelRLCallback, trace_rewards  # noqa: E402
from otel_rl.records import RunIdentity  # noqa: E402

from .test_transformers import _grpo, _numbers  # noqa: E402

CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens: nothing is sent (WAL sender off)


def _length(completions: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]


@pytest.fixture
def wandb_and_weave(tmp_path, monkeypatch):
    """Offline wandb in a fresh WANDB_DIR, and a WAL-backed global Weave client (entity 'ent', project 'proj')."""
    import weave.durability.wal_manager as wal_manager
    from weave.trace.context import weave_client_context
    from weave.trace.weave_client import WeaveClient
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    for k in list(os.environ):
        if k.startswith(("OTEL_", "WANDB_", "MLFLOW_")):
            monkeypatch.delenv(k, raising=False)
    wb = tmp_path / "wb"
    for sub in ("data", "cache", "config"):
        (wb / sub).mkdir(parents=True)
    for k, v in {
        "WANDB_MODE": "offline",
        "WANDB_DISABLE_WEAVE": "true",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(wb),
        "WANDB_DATA_DIR": str(wb / "data"),
        "WANDB_CACHE_DIR": str(wb / "cache"),
        "WANDB_CONFIG_DIR": str(wb / "config"),
        "HOME": str(tmp_path),
        "WEAVE_ENABLE_WAL": "true",
        "WEAVE_DISABLE_WAL_SENDER": "true",
        "WEAVE_PRINT_CALL_LINK": "false",
        "HF_HUB_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    root = tmp_path / ".weave" / "wal"
    monkeypatch.setattr(wal_manager, "WAL_ROOT", str(root))
    previous = weave_client_context.get_weave_client()
    client = WeaveClient(
        "ent", "proj", RemoteHTTPTraceServer(CLOSED_PORT_URL, should_batch=True), ensure_project_exists=False
    )
    weave_client_context.set_weave_client_global(client)
    try:
        yield str(wb), root
    finally:
        h = otel_rl.current()
        if h is not None:
            h.shutdown(10)
        client.finish(use_progress_bar=False)
        weave_client_context.set_weave_client_global(previous)
        wandb.teardown()


def test_grpo_metrics_reach_wandb_and_completions_reach_weave(wandb_and_weave, tmp_path):
    wandb_dir, wal = wandb_and_weave
    seen: list[tuple[int, list, list]] = []

    def length(completions, prompts, trainer_state, **kwargs):
        seen.append((trainer_state.global_step + 1, list(prompts), list(completions)))
        return _length(completions)

    cb = OtelRLCallback(
        project="trl-trackers",
        exporters=["wandb", "weave"],
        trace_backend="weave",
        export_process=False,
        batch_delay_s=0.05,
    )
    trainer = _grpo(tmp_path, trace_rewards([length]), cb)
    trainer.train()
    history = trainer.state.log_history
    h = otel_rl.current()
    run_id = h.run_id
    h.shutdown(30)

    # wandb: one run named after the trainer's run_name, the TrainingArguments as its config, and every
    # key and value of state.log_history at its step
    (run_dir,) = find_run_dirs(wandb_dir, run_id=wandb_run_id(RunIdentity("trl-trackers", "tiny-grpo", run_id)))
    data = read_run(run_dir)
    assert data.exit_seen and data.complete
    assert (data.project, data.display_name) == ("trl-trackers", "tiny-grpo")
    assert data.config["num_generations"] == 2 and data.config["max_steps"] == 2
    rows: dict[int, dict] = {}
    for r in data.history:
        rows.setdefault(r[STEP_METRIC], {}).update({k: v for k, v in r.items() if not k.startswith("_")})
    want: dict[int, dict] = {}
    for e in history:
        want.setdefault(e["step"], {}).update(_numbers(e))
    assert sorted(rows) == sorted(want)
    for step, values in want.items():
        got = {k: v for k, v in rows[step].items() if k != STEP_METRIC}
        assert got == values, step
    assert {"reward", "reward_std", "rewards/length/mean", "completions/mean_length", "train_runtime"} <= {
        k for r in rows.values() for k in r
    }

    # Weave: every completion one call tree, findable by step, with its prompt, completion and score
    calls = read_calls(wal)
    roots = [c for c in calls.values() if c["parent_id"] is None]
    assert len(roots) == 8 and {c["display_name"] for c in roots} == {"grpo.completion"}
    children: dict[str, dict[str, dict]] = {}
    for c in calls.values():
        if c["parent_id"] is not None:
            children.setdefault(c["parent_id"], {})[c["display_name"]] = c
    assert [s for s, *_ in seen] == [1, 2]
    for step, prompts, completions in seen:
        got = {}
        for root in (c for c in roots if c["attributes"]["step"] == step):
            kids = children[root["id"]]
            key = (root["attributes"]["sample_index"], root["attributes"]["rollout_n"])
            got[key] = (
                kids["completion"]["inputs"]["prompt"],
                kids["completion"]["output"]["completion"],
                kids["reward length"]["output"],
            )
        assert got == {
            divmod(i, 2): (p, c, s) for i, (p, c, s) in enumerate(zip(prompts, completions, _length(completions)))
        }
