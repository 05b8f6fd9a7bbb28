"""`shutdown()` while the MLflow server is down (killed) or hung (stopped): it returns within the shutdown
budget (`shutdown_timeout_s`, 10 s by default) with what it could not deliver in the spool, whether the
tracker library runs in the export process or in the trainer's own; and `otel-rl replay` delivers all of it
once the server is back, ending the run FINISHED as the trainer did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ._helpers import ROOT, export_pid, finish, gone, metric_steps, mlflow_run, start, trainer_env, wait_logged

pytestmark = pytest.mark.slow

STEPS = 20
BUDGET_S = 10.0  # the default shutdown_timeout_s


@pytest.mark.parametrize("export_process", ["true", "false"])
@pytest.mark.parametrize("server_state", ["down", "hung"])
def test_shutdown_with_mlflow_down_or_hung_returns_within_the_budget_and_spools(tmp_path, server_state,
                                                                                export_process):
    sys.path.insert(0, str(ROOT / "tests"))
    from _mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "server")
    server.root.mkdir()
    server.start()
    try:
        out = tmp_path / "t"
        proc = start(out, EXPORTERS="mlflow", MLFLOW_TRACKING_URI=server.url, STEPS=str(STEPS), END="shutdown",
                     FLUSH="120", MLFLOW_HTTP_REQUEST_TIMEOUT="20", OTEL_RL_EXPORT_PROCESS=export_process)
        wait_logged(proc, out)  # steps 1..STEPS are in MLflow
        if server_state == "down":
            server.kill()
        else:
            os.killpg(server.proc.pid, signal.SIGSTOP)
        (out / "go").write_text("")
        assert finish(proc, out) == 0, (out / "stderr").read_text()[-3000:]
        lines = (out / "stderr").read_text().splitlines()
        took = float(next(x for x in lines if x.startswith("shutdown_s ")).split()[1])
        assert took <= BUDGET_S + 1.0, lines[-20:]
        child = export_pid(out)

        if server_state == "down":
            server.start()
        else:
            os.killpg(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not gone(child) and time.monotonic() < deadline:  # it ends on its own, after the budget
            time.sleep(0.2)
        replay = subprocess.run([sys.executable, "-m", "otel_rl.cli", "replay", str(out / "spool"), "--timeout", "120"],
                                env=trainer_env(out, MLFLOW_TRACKING_URI=server.url), cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        client, run = mlflow_run(server.url)
        assert metric_steps(client, run, "loss") == list(range(1, 2 * STEPS + 1))
        assert run.info.status == "FINISHED"
    finally:
        if server.proc is not None:
            try:
                os.killpg(server.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.kill()
