"""wandb's record of the installed packages, read from the metadata's header lines.

wandb's run start reads every distribution's whole metadata file (``wandb.util.working_set``); this
gives it the same items from `otel_rl.exporters.packages.distributions`.  The text wandb writes
(``requirements.txt``) is unchanged, which the tests compare.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from otel_rl.exporters.packages import distributions


def install_wandb_working_set(wandb: Any) -> bool:
    """``wandb.util.working_set`` (what a run start records) read from the header lines; True when installed.

    The same ``InstalledDistribution(key, version)`` items in the same order as wandb's own.
    """
    util: Any = getattr(wandb, "util", None)
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
