"""The installed packages, as trackers record them at each run start, read cheaply (a helper for plug-ins).

Trackers list the installed distributions when a run starts, some through ``importlib.metadata``'s full
parser over every metadata file (long descriptions included), some by starting ``pip list`` in a second
interpreter.  `distributions` gives the same names and versions from the metadata's header lines only,
the full parser taking over for a file whose headers do not give both; `pip_freeze_list` gives them as
``pip list --format=freeze`` prints them.  Each tracker plug-in hands them to its library its own way.

`hidden_imports` lets one thread import a tracker's library as if an optional package were not
installed (MLflow without pandas and pygments, in the export process).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import re
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

#: what ``pip list`` leaves out
_PIP_SKIPS = frozenset({"python", "wsgiref", "argparse"})
_SEPARATORS = re.compile(r"[-_.]+")
_HEADER_LINES = 100


def name_version(dist: importlib.metadata.Distribution) -> tuple[Any, Any]:
    """A distribution's ``Name`` and ``Version``, as ``dist.metadata["Name"]`` and ``dist.version`` give them.

    Read from the header lines of its metadata file; when they do not hold both, from the full parser (which
    may then raise what it raises).
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    name = version = None
    for line in text.split("\n", _HEADER_LINES)[:_HEADER_LINES]:
        if not line.strip():
            break  # the headers end at the first empty line
        if name is None and line.startswith("Name:"):
            name = line[5:].strip()
        elif version is None and line.startswith("Version:"):
            version = line[8:].strip()
        if name and version:
            return name, version
    return dist.metadata["Name"], dist.version


def distributions() -> Iterator[tuple[Any, Any]]:
    """``(name, version)`` of every installed distribution, in ``importlib.metadata.distributions()``'s order
    (duplicates included); one whose metadata cannot be read is left out, as wandb leaves it out."""
    for dist in importlib.metadata.distributions():
        with contextlib.suppress(KeyError, UnicodeDecodeError, TypeError):
            yield name_version(dist)


def pip_freeze_list() -> str:
    """What ``python -m pip list --format=freeze`` prints for this interpreter's ``sys.path``.

    One ``Name==version`` line per distribution (the first found on ``sys.path`` for a name), sorted by the
    normalized name, pip's own exclusions left out.  This process's ``sys.path``: where it holds more than a
    fresh interpreter's (Ray, once imported, adds its vendored packages), those are listed too, which pip
    started as a child process would not see.
    """
    found: dict[str, str] = {}
    for name, version in distributions():
        if not name:
            continue
        key = _SEPARATORS.sub("-", name).lower()
        if key in found or key in _PIP_SKIPS:
            continue
        found[key] = f"{name}=={version}"
    return "".join(found[k] + "\n" for k in sorted(found))


_HIDDEN_NOTE = "hidden by otel-rl while a tracker library imports"


class _Hider(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: an import of a hidden package (or of its modules) by the thread that hides it
    fails as if the package were not installed; every other thread imports as usual."""

    def __init__(self) -> None:
        self.hidden: dict[int, frozenset[str]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        names = self.hidden.get(threading.get_ident())
        if names and name.partition(".")[0] in names:
            raise ModuleNotFoundError(f"No module named {name!r} ({_HIDDEN_NOTE})", name=name)
        return None


_hider = _Hider()
_hider_lock = threading.Lock()


def _quiet_about_hidden() -> None:
    """A library that loads optional plug-ins while the tracker's library imports reports the one a hidden
    package stops, as a warning (pydantic, loading logfire's plug-in, which needs pygments).  What is hidden
    is never used here, so those warnings, and only those (their message names the hiding), are not shown."""
    warnings.filterwarnings("ignore", message=rf"(?s).*{re.escape(_HIDDEN_NOTE)}")


@contextlib.contextmanager
def hidden_imports(names: Iterable[str]) -> Iterator[None]:
    """Within the block, this thread imports as if the packages `names` were not installed.

    For an optional library that a tracker's import pulls in and the exporter never uses: MLflow's import
    loads pandas (0.4-0.5 s of CPU time) for its dataset helpers, which MLflow's skinny package offers only
    when pandas is there.  A package already imported stays usable; other threads are not affected, and after
    the block this one imports it as usual (what was imported inside keeps having done without it).  Inside,
    ``importlib.util.find_spec`` of a hidden package raises `ModuleNotFoundError` (where a package that is
    not installed gives None): a library that probes so while importing fails, and its caller imports it
    again without hiding (`otel_rl_mlflow`).
    """
    names = frozenset(n for n in names if n not in sys.modules)
    if not names:
        yield
        return
    me = threading.get_ident()
    with _hider_lock:
        if _hider not in sys.meta_path:
            _quiet_about_hidden()
            sys.meta_path.insert(0, _hider)
        outer = _hider.hidden.get(me, frozenset())
        _hider.hidden[me] = outer | names
    try:
        yield
    finally:
        with _hider_lock:
            if outer:
                _hider.hidden[me] = outer
            else:
                _hider.hidden.pop(me, None)


__all__ = ["distributions", "hidden_imports", "name_version", "pip_freeze_list"]
