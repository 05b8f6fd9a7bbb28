"""SIGTERM (what Slurm, Kubernetes, Ray and `docker stop` send) to a real trainer's process group right
after its last `log()`: every logged step reaches the console, the JSONL file and the MLflow store, the
process still ends by the signal, and a SIGTERM handler of the program's own keeps its say."""

from __future__ import annotations

import json
import signal

import pytest

from ._helpers import finish, metric_steps, mlflow_run, signal_group, start, wait_logged

pytestmark = pytest.mark.slow

STEPS = 200


@pytest.mark.parametrize("export_process", ["true", "false"])
def test_sigterm_right_after_the_last_log_loses_no_console_jsonl_or_mlflow_line(tmp_path, export_process):
    # a generous budget: this proves the flush, not the time MLflow takes to start on a busy machine
    proc = start(tmp_path, EXPORTERS="console,jsonl,mlflow", STEPS=str(STEPS), END="wait",
                 OTEL_RL_EXPORT_PROCESS=export_process, OTEL_RL_SHUTDOWN_TIMEOUT_S="90")
    wait_logged(proc, tmp_path)
    signal_group(proc, signal.SIGTERM)
    assert finish(proc, tmp_path) == -signal.SIGTERM  # it still ends by the signal, as without otel-rl
    console = [line for line in (tmp_path / "stdout").read_text().splitlines() if " - loss:" in line]
    assert len(console) == STEPS
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r["data"]) == list(range(1, STEPS + 1))
    client, run = mlflow_run(f"sqlite:///{tmp_path}/mlflow.db")
    assert metric_steps(client, run, "loss") == list(range(1, STEPS + 1))


def test_sigterm_goes_to_the_programs_own_handler_which_decides(tmp_path):
    """A handler installed before init() runs; it returns (a graceful stop of its own), so the program goes
    on, logs once more and exits 0: nothing shut down under it, nothing lost."""
    proc = start(tmp_path, EXPORTERS="console,jsonl", STEPS="20", END="wait", USER_HANDLER="1")
    wait_logged(proc, tmp_path)
    signal_group(proc, signal.SIGTERM)
    assert finish(proc, tmp_path) == 0, (tmp_path / "stderr").read_text()[-3000:]
    assert (tmp_path / "user_handler").read_text() == str(int(signal.SIGTERM))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r["data"]) == list(range(1, 21))
    assert [r["data"] for r in rows if "stopped" in r["data"]] == [{"stopped": 1}]


def test_sigterm_to_a_program_whose_own_handler_exits_delivers_through_the_exit(tmp_path):
    """A handler installed before init() that calls sys.exit(143) ends the program; the usual exit path
    delivers every logged step to the console, the JSONL file and MLflow, and the exit code is the
    handler's."""
    proc = start(tmp_path, EXPORTERS="console,jsonl,mlflow", STEPS=str(STEPS), END="wait", USER_HANDLER="exit",
                 OTEL_RL_SHUTDOWN_TIMEOUT_S="90")
    wait_logged(proc, tmp_path)
    signal_group(proc, signal.SIGTERM)
    assert finish(proc, tmp_path) == 128 + signal.SIGTERM, (tmp_path / "stderr").read_text()[-3000:]
    assert (tmp_path / "user_handler").read_text() == str(int(signal.SIGTERM))
    console = [line for line in (tmp_path / "stdout").read_text().splitlines() if " - loss:" in line]
    assert len(console) == STEPS
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r["data"]) == list(range(1, STEPS + 1))
    client, run = mlflow_run(f"sqlite:///{tmp_path}/mlflow.db")
    assert metric_steps(client, run, "loss") == list(range(1, STEPS + 1))
