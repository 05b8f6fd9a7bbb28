"""The plug-in contract, enforced on the source: a tracker plug-in (exporters/<x>/) uses only otel-rl's
public surface, and the core (otel_rl/) never imports or patches a tracker library."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "otel_rl"
PLUGINS = sorted(p for p in (ROOT / "exporters").iterdir() if p.is_dir() and any(p.glob("otel_rl_*/__init__.py")))
#: the tracker libraries that have a plug-in here (and the modules they ship under other names)
TRACKER_LIBRARIES = {"wandb", "swanlab", "mlflow", "weave", "tensorboard", "tensorboardX", "tbparse", "trackio",
                     "clearml"}
#: a dotted module path (lower-case words), as ``importlib.import_module`` takes
MODULE_PATH = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*){2,}")
#: the classes a plug-in builds on: their private members are theirs alone
BASES = [CORE / "exporters" / "base.py", CORE / "exporters" / "tracker.py"]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _parse(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in `tree` (relative ones left out)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _dynamic_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of ``importlib.import_module("...")`` and ``__import__("...")`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            out.append((node.lineno, node.args[0].value))
    return out


def _self_members(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(members read as ``self.<name>``, members defined: assigned on self, methods, class attributes)."""
    read, defined = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [item.target] \
                    if isinstance(item, ast.AnnAssign) else []
                defined.update(t.id for t in targets if isinstance(t, ast.Name))
    return read, defined


def test_plugins_import_only_the_public_surface():
    assert len(PLUGINS) >= 7, PLUGINS
    offenders = []
    for plugin in PLUGINS:
        for path in plugin.rglob("*.py"):
            for line, module, names in _imports(_parse(path)):
                if module != "otel_rl" and not module.startswith("otel_rl."):
                    continue
                private = [p for p in module.split(".") if _private(p)] + [n for n in names if _private(n)]
                if private:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} {module} {names}")
    assert not offenders, f"plug-ins importing otel-rl's private names: {offenders}"


def test_plugins_read_no_private_member_of_the_base_classes():
    base_private = set()
    for path in BASES:
        _, defined = _self_members(_parse(path))
        base_private |= {n for n in defined if _private(n)}
    assert "_written" in base_private  # (the rule sees the base's private state)
    offenders = []
    for plugin in PLUGINS:
        trees = {path: _parse(path) for path in plugin.rglob("*.py")}
        own: set[str] = set()
        for tree in trees.values():
            own |= _self_members(tree)[1]
        for path, tree in trees.items():
            read, _ = _self_members(tree)
            for name in sorted((read & base_private) - own):
                offenders.append(f"{path.relative_to(ROOT)}: self.{name}")
    assert not offenders, f"plug-ins using a base class's private members: {offenders}"


def test_the_core_never_imports_a_tracker_library_or_a_plugin():
    offenders = []
    for path in CORE.rglob("*.py"):
        tree = _parse(path)
        found = [(line, module) for line, module, _ in _imports(tree)] + _dynamic_imports(tree)
        for line, module in found:
            top = module.split(".")[0]
            if top in TRACKER_LIBRARIES or top.startswith("otel_rl_"):
                offenders.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert not offenders, f"the core imports tracker code (it belongs in exporters/<x>/): {offenders}"


def test_the_core_reaches_into_no_tracker_module():
    """No tracker module object handled in the core (a name ``wandb`` holding it, an attribute set on one)
    and no dotted path into a tracker's modules (``"swanlab.sdk.internal..."``): a tracker's workarounds,
    monkeypatches included, live in its plug-in."""
    offenders = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Name) and node.id in TRACKER_LIBRARIES:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} the name {node.id!r}")
            elif isinstance(node, ast.arg) and node.arg in TRACKER_LIBRARIES:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} the parameter {node.arg!r}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
                if node.value.split(".")[0] in TRACKER_LIBRARIES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders
