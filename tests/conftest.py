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


@pytest.fixture(autouse=True)
def _restore_mlflow_tracking_uri():
    """A test that calls mlflow.set_tracking_uri() must not redirect the next test's data
    (MLflow keeps it in a module global and also writes it to os.environ)."""
    import sys

    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    before = getattr(utils, "_tracking_uri", None) if utils is not None else None
    env_before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and hasattr(utils, "_tracking_uri"):
        utils._tracking_uri = before
    if env_before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = env_before
