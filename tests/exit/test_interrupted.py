"""Ctrl-C to a real trainer's process group while its rollouts run as asyncio tasks or in threads: the traced
trajectories still open are stored whole (root span, step and sample tags, status ERROR "interrupted"),
never as traces rooted at the LLM spans that happened to end; and the step it was in logs no timings."""

from __future__ import annotations

import signal

import pytest

from ._helpers import finish, metric_steps, mlflow_run, signal_group, start, wait_logged

pytestmark = pytest.mark.slow

OPEN = 4


@pytest.mark.parametrize("rollouts_in", ["tasks", "threads"])
def test_ctrl_c_stores_open_trajectories_whole_as_interrupted_and_logs_no_partial_step(tmp_path, rollouts_in):
    proc = start(tmp_path, EXPORTERS="mlflow", TRACE_BACKEND="mlflow", STEPS="2", END="rollouts", OPEN=str(OPEN),
                 OTEL_RL_SHUTDOWN_TIMEOUT_S="120", FLUSH="120", ROLLOUTS_IN=rollouts_in)
    wait_logged(proc, tmp_path)  # step 3's rollouts made their LLM call and wait
    signal_group(proc, signal.SIGINT)
    status = finish(proc, tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client, run = mlflow_run(uri)
    assert metric_steps(client, run, "timing_s/step") == [1, 2]  # none for the interrupted step 3
    assert metric_steps(client, run, "loss") == [1, 2]

    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        traces = mlflow.search_traces(locations=[run.info.experiment_id], return_type="list", max_results=100)
    finally:
        mlflow.set_tracking_uri(None)  # later tests take theirs from MLFLOW_TRACKING_URI
    got = sorted((t.info.tags.get("step"), t.info.tags.get("sample_index"), t.info.state.value) for t in traces)
    assert got == [("3", str(i), "ERROR") for i in range(OPEN)]
    for t in traces:
        roots = [s for s in t.data.spans if s.parent_id is None]
        assert [r.name for r in roots] == ["rl.trajectory"]
        assert roots[0].status.description == "interrupted"
        assert sorted(s.name for s in t.data.spans if s.parent_id is not None) == ["chat policy"]
    assert run.info.status == "KILLED"
    assert status == -signal.SIGINT, (tmp_path / "stderr").read_text()[-3000:]  # it still dies by SIGINT
