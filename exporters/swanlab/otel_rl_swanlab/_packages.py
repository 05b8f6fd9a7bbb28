"""SwanLab's requirements snapshot, read in process instead of by a ``pip list`` child process.

SwanLab starts ``python -m pip list --format=freeze`` at each run start (a second interpreter importing
pip); where it would, this gives it `otel_rl.exporters.packages.pip_freeze_list` (the same text).
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from typing import Any

from otel_rl.exporters.packages import pip_freeze_list

#: SwanLab's module that gathers its requirements snapshot; its ``get()`` returns the text
SWANLAB_PROBE_MODULE = "swanlab.sdk.internal.probe_python.environment.requirements"


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
