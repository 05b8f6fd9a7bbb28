"""Suite-wide rules."""

from __future__ import annotations

import os

import pytest


def pytest_collectreport(report: pytest.CollectReport) -> None:
    # On CI every part must be installed: a module skipped at import (a missing tracker
    # library or exporter distribution) is a failure there, not a quiet skip.
    if os.environ.get("CI") and report.outcome == "skipped" and report.nodeid.startswith("tests/"):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI (a dependency is missing): {report.longrepr}"
