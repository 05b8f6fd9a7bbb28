"""Suite-wide rules."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # spools of undeliverable test data go to a throwaway cache, not the user's ~/.cache
    import tempfile

    if "OTEL_RL_TEST_KEEP_CACHE" not in os.environ:
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="otel-rl-test-cache-")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # On CI every part must be installed: a module skipped at import (a missing tracker
    # library or exporter distribution) is a failure there, not a quiet skip.
    if os.environ.get("CI") and report.outcome == "skipped" and report.nodeid.startswith("tests/"):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI (a dependency is missing): {report.longrepr}"


_MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID")
_MLFLOW_ENV_AT_START = {k: os.environ.get(k) for k in _MLFLOW_ENV}


def _reset_mlflow_globals() -> None:
    """MLflow keeps the tracking URI and the active experiment in module globals and copies them into
    os.environ (``set_tracking_uri``, ``set_experiment``): back to how the session started."""
    import sys

    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and hasattr(utils, "_tracking_uri"):
        utils._tracking_uri = None
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is not None and hasattr(fluent, "_active_experiment_id"):
        fluent._active_experiment_id = None
    for k, v in _MLFLOW_ENV_AT_START.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _restore_mlflow_globals():
    """A test (or a module-scoped fixture before it) that points MLflow's fluent API somewhere must not
    redirect the next test's data: after every test, MLflow's globals are as at the session's start."""
    yield
    _reset_mlflow_globals()
