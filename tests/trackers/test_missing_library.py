"""A tracker library that is not installed fails at init() with the pip command, for every tracker."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("tracker", ["mlflow", "wandb", "swanlab", "weave", "tensorboard", "trackio", "clearml"])
def test_missing_tracker_library_fails_at_init_with_pip_command(tracker, tmp_path):
    # a fresh interpreter in which importing the tracker library fails, as when it is not installed
    code = textwrap.dedent(f"""
        import sys
        sys.modules[{tracker!r}] = None
        import otel_rl
        try:
            otel_rl.init(exporters=["console", {tracker!r}])
        except otel_rl.UnknownExporterError as exc:
            print("ERROR:", exc)
            print("CURRENT:", otel_rl.current())
        else:
            print("NO ERROR")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert f"pip install 'otel-rl[{tracker}]'" in out.stdout, out.stdout + out.stderr
    assert "CURRENT: None" in out.stdout  # nothing was started
