"""bench_foreground.py --replay: the rollout run again with the model's decoding replayed gives the same
trajectories (the script refuses to report otherwise) and a figure for each half, on a short demo run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str) -> str:
    env = {**os.environ, "HOME": str(tmp_path), "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path),
           "WANDB_CACHE_DIR": str(tmp_path), "WANDB_DATA_DIR": str(tmp_path), "WANDB_DISABLE_WEAVE": "true"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_foreground.py"), "--steps", "2",
                           "--replay", "2", *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _figures(out: str) -> tuple[float, float, float]:
    m = re.search(r"gen replayed \(agent loops \+ otel-rl, no model\), ms\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2)), float(m.group(3))


@pytest.mark.slow
def test_replayed_rollouts_are_the_same_trajectories_and_cost_more_traced(tmp_path):
    out = _run(tmp_path)
    assert "replayed 2 times each way" in out and "same trajectories: yes" in out
    on, off, diff = _figures(out)
    assert off > 0 and on > off  # the traced half does the instrumentation's work on top
    assert diff == pytest.approx(on - off, abs=0.002)


@pytest.mark.slow
def test_replay_check_runs_both_halves_off(tmp_path):
    out = _run(tmp_path, "--check")
    assert "check: both halves off" in out and "same trajectories: yes" in out
    on, off, _ = _figures(out)
    assert on > 0 and off > 0
