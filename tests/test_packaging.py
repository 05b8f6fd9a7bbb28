"""Packaging and repository hygiene: SPDX license strings, ignored build output, --version."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_pyproject_uses_an_spdx_license_string():
    files = [ROOT / "pyproject.toml", *sorted(ROOT.glob("exporters/*/pyproject.toml"))]
    for f in files:
        data = tomllib.loads(f.read_text())
        assert isinstance(data["project"]["license"], str), f  # a table is deprecated by setuptools
        assert any(r.startswith("setuptools>=77") for r in data["build-system"]["requires"]), f


def test_build_output_is_git_ignored():
    for path in ("build/lib/x.py", "dist/x.whl", "otel_rl/bridge/_otlp.cpython-311-x86_64-linux-gnu.so"):
        res = subprocess.run(["git", "check-ignore", "-v", path], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 0, (path, res.stdout, res.stderr)


def test_version_flag():
    from otel_rl import __version__

    for args in (["--version"], ["version"]):
        res = subprocess.run([sys.executable, "-m", "otel_rl.cli", *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() in (f"otel-rl {__version__}", __version__), res.stdout


def test_exporters_marks_unusable_ones_with_the_extra():
    code = ("import sys; sys.modules['prometheus_client'] = None; sys.modules['opentelemetry.exporter.otlp'] = None\n"
            "from otel_rl.cli import main; main(['exporters'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = res.stdout.splitlines()
    assert any(ln.startswith("prometheus  (not usable") and "pip install 'otel-rl[prometheus]'" in ln for ln in lines)
    assert any(ln.startswith("otlp  (not usable") and "pip install 'otel-rl[otlp]'" in ln for ln in lines)
    assert "console" in lines


@pytest.mark.parametrize("name, module", [("otlp", "opentelemetry.exporter.otlp"),
                                          ("prometheus", "prometheus_client"),
                                          ("prometheus", "opentelemetry.exporter.prometheus")])
def test_init_of_an_exporter_whose_package_is_missing_names_the_extra(name, module):
    """init() with a built-in exporter whose package is not installed (Python's mark for a missing module:
    None in sys.modules) fails with the extra to install, not a module path that is no package."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "import otel_rl\n"
            f"try:\n    otel_rl.init(exporters=[{name!r}])\n"
            "except otel_rl.UnknownExporterError as exc:\n    print(exc)\n"
            "    print('current', otel_rl.current())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"run `pip install 'otel-rl[{name}]'`" in res.stdout, res.stdout
    assert module in res.stdout and "current None" in res.stdout


def test_every_install_hint_names_an_extra_that_exists():
    """The extras otel-rl tells users to install (error messages, `otel-rl exporters`, the CLI's hints)
    are all in pyproject.toml, and each of those messages uses the form that pip takes as it is."""
    import re

    from otel_rl import cli
    from otel_rl.exporters import registry

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    source = "\n".join(p.read_text() for p in sorted((ROOT / "otel_rl").rglob("*.py")))
    named = set(re.findall(r"otel-rl\[([a-z0-9_-]+)\]", source)) | set(cli.EXTRAS.values())
    named |= {re.fullmatch(r"pip install 'otel-rl\[([a-z0-9_-]+)\]'", fix).group(1)  # type: ignore[union-attr]
              for fix in registry.KNOWN_MISSING.values()}
    assert {"otlp", "prometheus", "bridge", "demo", "mlflow"} <= named
    assert named <= extras, named - extras
    assert set(registry.BUILTIN_NEEDS) | set(registry.REQUIRES) <= set(registry.KNOWN_MISSING)


def test_verl_recipe_in_docs_installs_omegaconf():
    """The install commands of docs/verl.md's test recipe name omegaconf, which `verl.utils.tracking`
    imports (verl is installed there with --no-deps, so nothing else brings it)."""
    text = (ROOT / "docs/verl.md").read_text()
    installs = [ln.split() for ln in text.splitlines() if ln.strip().startswith(".venv/bin/pip install")]
    assert any("--no-deps" in words and "verl==0.9.1" in words for words in installs), installs
    assert any("omegaconf" in words for words in installs), installs


def test_bridge_without_grpc_names_the_extra():
    code = ("import sys; sys.modules['grpc'] = None\n"
            "from otel_rl.cli import main\n"
            "sys.exit(main(['bridge', '--http-address', '127.0.0.1:0', '--grpc-address', '127.0.0.1:0',"
            " '--prometheus-port', '0', '--exporters', 'console']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, input="")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "pip install 'otel-rl[bridge]'" in res.stderr, res.stderr
