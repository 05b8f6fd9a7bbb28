"""The tags MLflow's fluent ``mlflow.start_run`` gives a new run about where it comes from.

``mlflow.user``, ``mlflow.source.name`` and ``mlflow.source.type`` are what MLflow's own
``DefaultRunContext`` makes of the process that starts the run: the user, ``sys.argv[0]`` (the
training script) and ``LOCAL``.  The run page shows them as its User and Source.  The exporter
creates runs where it runs, and in the export process (a child of the training process, started as
``python -c ...``) ``sys.argv[0]`` is ``-c``: there the source is the training process's own
``sys.argv[0]``, read from its command line (``/proc/<parent>/cmdline``; ``python -m module`` gives
the module's file, as Python does).  Behind the bridge the process is the bridge.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

#: set in the environment of the export process (otel_rl.export_process.protocol.IN_EXPORT_PROCESS)
IN_EXPORT_PROCESS = "OTEL_RL_IN_EXPORT_PROCESS"
#: python options that take a value as the next argument (`python -W error script.py`)
_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def run_context_tags() -> dict[str, str]:
    """MLflow's default run-context tags for the training process; {} when MLflow cannot make them."""
    try:
        from mlflow.tracking.context.default_context import DefaultRunContext
        from mlflow.utils.mlflow_tags import MLFLOW_SOURCE_NAME

        tags = dict(DefaultRunContext().tags())
    except Exception:
        return {}
    if os.environ.get(IN_EXPORT_PROCESS) == "1":
        main = main_file_of(os.getppid())
        if main:
            tags[MLFLOW_SOURCE_NAME] = main
    return tags


def main_file_of(pid: int) -> str | None:
    """`sys.argv[0]` of the Python process `pid`, from its command line; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode("utf-8", "surrogateescape") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    return main_file(args)


def main_file(args: list[str]) -> str | None:
    """What Python puts in `sys.argv[0]` for the command line `args` (interpreter first)."""
    i = 1
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            if a == "--" and i + 1 < len(args):
                return args[i + 1]
            i += 2 if a in _OPTIONS_WITH_VALUE else 1
            continue
        if a.startswith("-c"):
            return "-c"
        if a.startswith("-m"):
            name = args[i + 1] if a == "-m" and i + 1 < len(args) else a[2:]
            return _module_file(name) if name else None
        if a == "-":
            return "-"
        if a.startswith("-"):
            i += 2 if a in _OPTIONS_WITH_VALUE else 1
            continue
        return a
    return "<console>"


def _module_file(name: str) -> str:
    try:
        spec: Any = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:  # a package: its __main__ runs
            spec = importlib.util.find_spec(name + ".__main__")
        if spec is not None and spec.origin:
            return spec.origin
    except Exception:  # its parent package fails to import here
        pass
    return name
