"""The docs site: the strict build of `.ci/run` passes on docs/ and fails on a broken link or reference."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO, VENV_BIN

pytestmark = pytest.mark.slow


def ci_build_command(out: Path) -> list[str]:
    """The docs build line of .ci/run, as CI runs it, writing to `out`."""
    line = next(x for x in (REPO / ".ci" / "run").read_text().splitlines() if "mkdocs build" in x)
    words = shlex.split(line)
    assert words[0] == "NO_MKDOCS_2_WARNING=1" and "--strict" in words, line
    words = [str(VENV_BIN / "python") if w == ".venv/bin/python" else w for w in words[1:]]
    words[words.index("-d") + 1] = str(out)
    return words


def site_copy(tmp_path: Path) -> Path:
    """mkdocs.yml, README.md, the hooks and docs/ copied; the packages the API reference reads linked."""
    root = tmp_path / "site-src"
    root.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(REPO / name, root / name)
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "mkdocs_hooks.py", root / "scripts" / "mkdocs_hooks.py")
    shutil.copytree(REPO / "docs", root / "docs")
    for name in ("otel_rl", "exporters"):
        os.symlink(REPO / name, root / name)
    return root


def build(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(ci_build_command(out), cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_site_builds_strict_with_material_search_and_the_api_reference(tmp_path):
    out = tmp_path / "site"
    p = build(REPO, out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "mkdocs-material" in (out / "index.html").read_text()
    index = (out / "search" / "search_index.json").read_text()
    assert "otel-rl doctor" in index and "Cookbook" in index
    api = (out / "api" / "index.html").read_text()
    for name in ("otel_rl.doctor.run_checks", "otel_rl.report.write_report", "otel_rl.prune.decide"):
        assert f'id="{name}"' in api, name
    home = (out / "index.html").read_text()
    assert "otel-rl demo" in home and "bootstrap.sh" in home  # the README is the front page
    for page in ("troubleshooting", "cookbook"):
        assert (out / page / "index.html").is_file()


@pytest.mark.parametrize(
    ("page", "old", "new"),
    [
        ("troubleshooting.md", "(delivery.md)", "(no-such-page.md)"),
        ("cookbook.md", "(troubleshooting.md)", "(troubleshooting.md#no-such-anchor)"),
        ("api.md", "::: otel_rl.prune", "::: otel_rl.no_such_module"),
    ],
)
def test_a_broken_link_or_reference_fails_the_ci_build(tmp_path, page, old, new):
    root = site_copy(tmp_path)
    path = root / "docs" / page
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    p = build(root, tmp_path / "site")
    assert p.returncode != 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"no-such|no_such", p.stdout + p.stderr)
