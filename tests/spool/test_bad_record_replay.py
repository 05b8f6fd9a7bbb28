"""A spool that holds a record the tracker cannot store is not stuck on it.

The spool is the one a trainer leaves behind when MLflow was down: its frame holds 48 good steps and,
among them, a point at step 2**63 (as an older otel-rl spooled it; `log()` now refuses it).  Both ways
of delivering it, `otel-rl replay` and a later healthy run using the same spool directory, store the 48
good points in a real sqlite MLflow store, reject the bad one with one warning naming it, and leave no
spool behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")

from otel_rl.config import resolve  # noqa: E402
from otel_rl.records import RunIdentity, RunStart, StepMetrics  # noqa: E402
from otel_rl.spool import Spool, SpoolOptions, exporter_meta  # noqa: E402
from otel_rl.spool.codec import encode_batch  # noqa: E402

from .spool_helpers import ROOT, clean_env, run_replay  # noqa: E402

RUN = RunIdentity("spooled", "e", "run-spooled")
BAD_STEP = 2**63


def _leave_spool(path: Path) -> None:
    from otel_rl_mlflow import MlflowExporter

    config = resolve(env={}, exporters=["mlflow"], project=RUN.project, experiment=RUN.experiment,
                     run_id=RUN.run_id)
    exporter = MlflowExporter(config)
    exporter.name = "mlflow"
    t = time.time_ns()
    good = [StepMetrics(RUN, s, {"loss": s / 4}, t + s) for s in range(48)]
    records = [RunStart(RUN, {"lr": 0.1}, 0, t)] + good[:10] + [StepMetrics(RUN, BAD_STEP, {"loss": 2.0}, t)] + good[10:]
    sp = Spool(SpoolOptions(path=str(path), meta=exporter_meta(config, exporter)))
    sp.open(create=True)
    sp.append(encode_batch([], records), len(records))
    sp.close(remove_if_empty=False)


def _env(tmp: Path, db: str) -> dict[str, str]:
    paths = [str(ROOT / "exporters" / x) for x in ("mlflow", "wandb", "swanlab", "weave")]
    env = clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp / db}", OTEL_RL_MLFLOW_TEMPLATE_DIR="")
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], *paths])
    return env


def _points(tmp: Path, db: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / db}")
    (run,) = client.search_runs([client.get_experiment_by_name(RUN.project).experiment_id])
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))


_LATER_RUN = r"""
import sys, otel_rl
h = otel_rl.init(exporters=["mlflow"], project="spooled", experiment="e", run_id="run-spooled",
                 spool_dir=sys.argv[1], export_process="off")
otel_rl.log({"loss": 12.0}, step=48)
print("flushed", h.flush(60))
h.shutdown(20)
"""


@pytest.mark.slow
def test_replay_and_a_later_run_deliver_the_good_points_around_a_bad_spooled_one(tmp_path):
    spool_a = tmp_path / "a" / "mlflow"
    _leave_spool(spool_a)
    spool_b = tmp_path / "b" / "mlflow"
    shutil.copytree(spool_a, spool_b)
    want = [(s, s / 4) for s in range(48)]

    code, out = run_replay([str(spool_a.parent)], _env(tmp_path, "a.db"), tmp_path, timeout_s=120)
    assert code == 0, out
    assert _points(tmp_path, "a.db") == want
    assert out.count("refused") == 1 and f"'loss' at step {BAD_STEP}" in out
    assert not spool_a.exists()  # delivered, so removed

    res = subprocess.run([sys.executable, "-c", _LATER_RUN, str(spool_b.parent)], env=_env(tmp_path, "b.db"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "flushed True" in res.stdout, res.stderr
    assert _points(tmp_path, "b.db") == want + [(48, 12.0)]
    assert res.stderr.count("refused") == 1 and f"'loss' at step {BAD_STEP}" in res.stderr
    assert not spool_b.exists()
