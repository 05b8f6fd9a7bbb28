"""The installed packages, as the trackers record them at each run start, read cheaply.

wandb (``requirements.txt`` of a run) and SwanLab (its ``files/requirements.txt``) list the installed
distributions when a run starts.  wandb reads every distribution's whole metadata file through
``importlib.metadata`` (the email parser over long descriptions: ~0.2 s of CPU time for 180 packages,
several times that in a busy process); SwanLab starts ``python -m pip list --format=freeze`` (a second
interpreter importing pip: ~0.5 s).  Here the same names and versions come from the metadata's header
lines only (~0.05 s), the full parser taking over for a file whose headers do not give both.  The
exporters hand these to their tracker (`install_wandb_working_set`, `install_swanlab_requirements`);
the text the tracker writes is unchanged, which the tests compare.

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
import shutil
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

#: SwanLab's module that gathers its requirements snapshot; its ``get()`` returns the text
SWANLAB_PROBE_MODULE = "swanlab.sdk.internal.probe_python.environment.requirements"
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


def install_wandb_working_set(wandb: Any) -> bool:
    """``wandb.util.working_set`` (what a run start records) read from the header lines; True when installed.

    The same ``InstalledDistribution(key, version)`` items in the same order as wandb's own.
    """
    util = getattr(wandb, "util", None)
    original = getattr(util, "working_set", None)
    item = getattr(util, "InstalledDistribution", None)
    if not callable(original) or item is None:
        return False
    if getattr(original, "_otel_rl_headers", False):
        return True

    def working_set() -> Iterator[Any]:
        for name, version in distributions():
            yield item(key=name, version=version)

    working_set._otel_rl_headers = True  # type: ignore[attr-defined]
    working_set.__doc__ = original.__doc__
    util.working_set = working_set
    return True


def _swanlab_would_use_pip() -> bool:
    """SwanLab asks ``pixi list``, then ``uv pip list``, then pip: pip's answer only without the other two."""
    return shutil.which("pixi") is None and shutil.which("uv") is None and importlib.util.find_spec("pip") is not None


def install_swanlab_requirements() -> bool:
    """SwanLab's requirements snapshot read in process where it would come from pip; True when installed.

    Where pixi or uv is on ``PATH``, where pip is missing, and whenever the reading fails, SwanLab gathers
    it its own way.
    """
    try:
        probe: Any = importlib.import_module(SWANLAB_PROBE_MODULE)
    except Exception:  # another SwanLab version: its own way
        return False
    original = getattr(probe, "get", None)
    if not callable(original):
        return False
    if getattr(original, "_otel_rl_in_process", False):
        return True

    def get() -> Any:
        if _swanlab_would_use_pip():
            try:
                return pip_freeze_list()
            except Exception:
                pass
        return original()

    get._otel_rl_in_process = True  # type: ignore[attr-defined]
    get.__doc__ = original.__doc__
    probe.get = get
    return True


class _Hider(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: an import of a hidden package (or of its modules) by the thread that hides it
    fails as if the package were not installed; every other thread imports as usual."""

    def __init__(self) -> None:
        self.hidden: dict[int, frozenset[str]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        names = self.hidden.get(threading.get_ident())
        if names and name.partition(".")[0] in names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by otel-rl while a tracker library "
                                      "imports)", name=name)
        return None


_hider = _Hider()
_hider_lock = threading.Lock()


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


__all__ = ["distributions", "hidden_imports", "install_swanlab_requirements", "install_wandb_working_set",
           "name_version", "pip_freeze_list"]
