"""docs/semconv.md and otel_rl/semconv.py agree; no other module, in the core or in a tracker plug-in, spells
the names."""

from __future__ import annotations

import ast
import pathlib
import re

from otel_rl import semconv

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "semconv.md").read_text(encoding="utf-8")
CONFIG_DOC = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")


def _constants() -> dict[str, str]:
    return {k: v for k, v in vars(semconv).items() if k.isupper() and isinstance(v, str)}


def test_every_constant_is_documented():
    missing = []
    for name, value in _constants().items():
        if name.startswith("ENV_"):
            doc = CONFIG_DOC
        else:
            doc = DOC
        if f"`{value}" not in doc:
            missing.append(f"{name}={value!r}")
    assert not missing, f"not in the docs: {missing}"


def test_every_documented_name_exists():
    values = set(_constants().values()) | set(semconv.SPAN_KINDS)
    first_cells = re.findall(r"^\| `([^`]+)` \|", DOC, flags=re.M)
    assert len(first_cells) > 50
    unknown = [c for c in first_cells if c not in values and "<" not in c]
    assert not unknown, f"documented but not in semconv.py: {unknown}"


def _is_ours(value: str) -> bool:
    return value.startswith(("rl.", "gen_ai.", "otel_rl.exporter")) and value not in {"rl."}


def test_no_other_module_spells_the_names():
    ours = {v for v in _constants().values() if _is_ours(v)}
    offenders = []
    for path in [*(ROOT / "otel_rl").rglob("*.py"), *(ROOT / "exporters").rglob("*.py")]:
        if path == ROOT / "otel_rl" / "semconv.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
                    docstrings.add(id(node.body[0].value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if node.value in ours:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders
