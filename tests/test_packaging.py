"""Packaging and repository hygiene: SPDX license strings, ignored build output, --version."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_pyproject_uses_an_spdx_license_string():
    files = [ROOT / "pyproject.toml", *sorted(ROOT.glob("exporters/*/pyproject.toml"))]
    for f in files:
        data = tomllib.loads(f.read_text())
        assert isinstance(data["project"]["license"], str), f  # a table is deprecated by setuptools
        assert any(r.startswith("setuptools>=77") for r in data["build-system"]["requires"]), f


def test_build_output_is_git_ignored():
    for path in ("build/lib/x.py", "dist/x.whl"):
        res = subprocess.run(["git", "check-ignore", "-v", path], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 0, (path, res.stdout, res.stderr)


def test_version_flag():
    res = subprocess.run([sys.executable, "-m", "otel_rl.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip().startswith("otel-rl ")


def test_exporters_marks_unusable_ones_with_the_extra():
    code = ("import sys; sys.modules['prometheus_client'] = None; sys.modules['opentelemetry.exporter.otlp'] = None\n"
            "from otel_rl.cli import main; main(['exporters'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = res.stdout.splitlines()
    assert any(ln.startswith("prometheus  (not usable") and "pip install 'otel-rl[prometheus]'" in ln for ln in lines)
    assert any(ln.startswith("otlp  (not usable") and "pip install 'otel-rl[otlp]'" in ln for ln in lines)
    assert "console" in lines


def test_verl_recipe_in_docs_installs_omegaconf():
    text = (ROOT / "docs/verl.md").read_text()
    assert "omegaconf" in text.split("## ")[-1] or "omegaconf" in text


def test_bridge_without_grpc_names_the_extra():
    code = ("import sys; sys.modules['grpc'] = None\n"
            "from otel_rl.cli import main\n"
            "sys.exit(main(['bridge', '--http-address', '127.0.0.1:0', '--grpc-address', '127.0.0.1:0',"
            " '--prometheus-port', '0', '--exporters', 'console']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, input="")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "pip install 'otel-rl[bridge]'" in res.stderr, res.stderr
