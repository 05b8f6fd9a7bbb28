"""The public surface is precisely typed: no `typing.Any` in a public signature, however deeply nested.

The surface is what `otel_rl.__all__` exports plus the modules a trainer or a tracker plug-in imports directly. For
every public function, method, property and class attribute annotation there, the annotation is resolved (as
`typing.get_type_hints` does; an annotation naming a type imported only for type checking is read as written) and
walked through its arguments: `dict[str, Any]`, `Callable[..., Any]` and `Any | None` fail as `Any` does.
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from collections.abc import Iterator

import pytest

import otel_rl

#: the public modules besides the package itself (their `__all__`, else their non-underscore names defined there)
PUBLIC_MODULES = [
    "otel_rl.compat.verl",
    "otel_rl.exporters.base",
    "otel_rl.exporters.tracker",
    "otel_rl.records",
    "otel_rl.testing",
    "otel_rl.integrations.ray",
    "otel_rl.integrations.transformers",
    "otel_rl.integrations.verl",
]

#: dunders that are part of how a public class is used
_PUBLIC_DUNDERS = {"__init__", "__call__", "__enter__", "__exit__", "__aenter__", "__aexit__", "__iter__"}


def _public_names(module: object) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    mod_name = getattr(module, "__name__", "")
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == mod_name and (callable(v) or inspect.isclass(v))
    ]


def _surface() -> Iterator[tuple[str, object]]:
    """(qualified name, object) of every public callable, class and module-level annotation holder."""
    seen: set[int] = set()
    modules: list[tuple[str, object]] = [("otel_rl", otel_rl)]
    modules += [(m, importlib.import_module(m)) for m in PUBLIC_MODULES]
    for mod_name, module in modules:
        for name in _public_names(module):
            obj = getattr(module, name)
            if id(obj) in seen or not (callable(obj) or inspect.isclass(obj)):
                continue
            seen.add(id(obj))
            yield f"{mod_name}.{name}", obj


def _members(cls: type) -> Iterator[tuple[str, object]]:
    """The public methods and properties of `cls`, its own and those it inherits from otel-rl classes."""
    done: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("otel_rl"):
            continue
        for name, v in vars(klass).items():
            if name in done or (name.startswith("_") and name not in _PUBLIC_DUNDERS):
                continue
            done.add(name)
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            if isinstance(v, property):
                if v.fget is not None:
                    yield name, v.fget
            elif inspect.isfunction(v):
                yield name, v


def _resolve(fn: object, owner_globals: dict[str, object]) -> dict[str, object]:
    """Annotations of `fn` as objects where they resolve, as their text where they do not."""
    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:
        pass
    raw = getattr(fn, "__annotations__", {}) or {}
    out: dict[str, object] = {}
    ns = dict(vars(typing))
    ns.update(owner_globals)
    for k, v in raw.items():
        if isinstance(v, str):
            try:
                out[k] = eval(v, ns)  # noqa: S307 - annotation text from otel-rl's own modules
            except Exception:
                out[k] = v
        else:
            out[k] = v
    return out


_ANY_WORD = re.compile(r"(?<![\w.])(typing\.)?Any(?!\w)")


def _has_any(tp: object, depth: int = 0) -> bool:
    if depth > 20:
        return False
    if tp is typing.Any:
        return True
    if isinstance(tp, str):
        return bool(_ANY_WORD.search(tp))
    if isinstance(tp, typing.ForwardRef):
        return bool(_ANY_WORD.search(tp.__forward_arg__))
    if isinstance(tp, typing.TypeVar):
        bound = tp.__bound__
        return bound is not None and _has_any(bound, depth + 1)
    if isinstance(tp, (list, tuple)):  # Callable's argument list
        return any(_has_any(a, depth + 1) for a in tp)
    return any(_has_any(a, depth + 1) for a in typing.get_args(tp))


def _offenders() -> list[str]:
    bad: list[str] = []

    def check(where: str, fn: object) -> None:
        hints = _resolve(fn, getattr(fn, "__globals__", {}))
        for param, tp in hints.items():
            if _has_any(tp):
                bad.append(f"{where} {param}: {tp}")

    for qual, obj in _surface():
        if inspect.isclass(obj):
            for klass in obj.__mro__:
                if klass.__module__.startswith("otel_rl") and not klass.__name__.startswith("_"):
                    mod = importlib.import_module(klass.__module__)
                    for attr, tp in _resolve_class_attrs(klass, vars(mod)).items():
                        if not attr.startswith("_") and _has_any(tp):
                            bad.append(f"{qual}.{attr}: {tp}")
            for name, fn in _members(obj):
                check(f"{qual}.{name}", fn)
        else:
            check(qual, inspect.unwrap(obj) if inspect.isfunction(obj) else obj)
    return sorted(set(bad))


def _resolve_class_attrs(klass: type, module_globals: dict[str, object]) -> dict[str, object]:
    raw = vars(klass).get("__annotations__", {})
    holder = type("_Holder", (), {"__annotations__": dict(raw), "__module__": klass.__module__})
    return _resolve(holder, module_globals)


def test_public_signatures_have_no_any():
    bad = _offenders()
    assert not bad, "typing.Any in public signatures:\n" + "\n".join(bad)


def test_any_detector_sees_nested_and_textual_any():
    """The walker finds Any however it is written, so the check above can fail."""
    assert _has_any(typing.Any)
    assert _has_any(dict[str, typing.Any])
    assert _has_any(list[typing.Any] | None)
    assert _has_any(typing.Callable[..., typing.Any])
    assert _has_any("Mapping[str, Any] | None")
    assert not _has_any(dict[str, object])
    assert not _has_any("CompanyName | None")
    assert not _has_any(typing.Callable[[int], str])


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_module_imports(module):
    """Each listed module exists, so a rename cannot silently drop it from the check."""
    assert _public_names(importlib.import_module(module))


@pytest.mark.slow
def test_decorated_functions_keep_their_signatures_for_mypy(tmp_path):
    """mypy checks a typed program using the decorators: each call that breaks a decorated function's
    signature or return type is reported, on exactly the lines marked, and nothing else is."""
    import pathlib
    import subprocess
    import sys

    program = pathlib.Path(__file__).parent / "typing" / "decorated_program.py"
    expected = {
        (i, m.group(1))
        for i, line in enumerate(program.read_text().splitlines(), 1)
        if (m := re.search(r"# expect: ([a-z-]+)", line))
    }
    assert len(expected) == 5
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary"]
        + ["--cache-dir", str(tmp_path), "--show-error-codes", str(program)],
        capture_output=True,
        text=True,
        cwd=pathlib.Path(__file__).parent.parent,
        timeout=600,
    )
    found = {(int(m.group(1)), m.group(2)) for m in re.finditer(r":(\d+): error: .*\[([a-z-]+)\]$", proc.stdout, re.M)}
    assert found == expected, proc.stdout + proc.stderr
