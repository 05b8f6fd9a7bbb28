"""One MLflow run's state as the exporter keeps it, the tracking store it lives in, and how MLflow's
errors are told apart (wrong data, raised as ValueError, or a store to retry)."""

from __future__ import annotations

import contextlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ._keys import MAX_TAG_VALUE_CHARS

#: verl's default when MLFLOW_TRACKING_URI is not set
DEFAULT_TRACKING_URI = "sqlite:////tmp/mlruns.db"
#: run tag listing the metric points that were +-Inf (MLflow stores them as +-1.797e308)
INF_METRICS_TAG = "otel_rl.inf_metrics"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS
INF_STEPS_KEPT = 1000  # per key, for the tag
# MLflow error codes that mean "this request is wrong" (retrying cannot help)
DATA_ERROR_CODES = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE"}


def resolve_tracking_uri(explicit: str | None = None) -> str:
    """MLflow's own order, then verl's default: ``tracking_uri`` argument > ``mlflow.set_tracking_uri()``
    in this process > ``MLFLOW_TRACKING_URI`` > ``sqlite:////tmp/mlruns.db``."""
    if explicit:
        return explicit
    try:
        from mlflow.tracking._tracking_service import utils as _u

        if _u._tracking_uri:  # set in this process with mlflow.set_tracking_uri()
            return str(_u._tracking_uri)
    except Exception:  # pragma: no cover - private attribute moved
        pass
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def clear_server_version_cache() -> None:
    try:
        from mlflow.store.tracking.rest_store import RestStore

        RestStore._get_server_version.cache_clear()
    except Exception:  # pragma: no cover - private API moved
        pass


@contextlib.contextmanager
def data_errors() -> Iterator[None]:
    """MLflow said the data of a write is wrong (it will be every time): raise ValueError so the
    core drops that batch after a few attempts instead of retrying it for ever.  Connection and
    server errors pass through unchanged (retried)."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, "error_code", None) in DATA_ERROR_CODES and not isinstance(exc, ValueError):
            raise ValueError(f"MLflow rejected the data: {exc}") from exc
        raise


class MlflowRun:
    """State of one MLflow run (one otel-rl run identity)."""

    def __init__(self, run_id: str, experiment_id: str, params: dict[str, str], tags: dict[str, str], new: bool):
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.params = params  # MLflow param key -> value, as stored
        self.tags = tags
        self.new = new
        self.inf: dict[str, dict[int, str]] = {}  # metric key -> {step: "+inf"/"-inf"}
        self.inf_tag_sent = tags.get(INF_METRICS_TAG)
        self.gen_rows: OrderedDict[int, list[list[Any]]] = OrderedDict()  # recent steps' table rows
        self.gen_done: set[tuple[int, int, int]] = set()
        self.gen_listing: set[str] | None = None
        try:
            self.tables: list[dict[str, str]] = json.loads(tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
        except ValueError:
            self.tables = []
        self.closed = False

    def inf_tag_value(self) -> str | None:
        if not self.inf:
            return None
        full = {}
        for key, steps in sorted(self.inf.items()):
            pos = sorted(s for s, v in steps.items() if v == "+inf")
            neg = sorted(s for s, v in steps.items() if v == "-inf")
            entry: dict[str, Any] = {"count": len(steps) if len(steps) < INF_STEPS_KEPT else f"{INF_STEPS_KEPT}+"}
            if pos:
                entry["+inf_steps"] = pos[:20]
            if neg:
                entry["-inf_steps"] = neg[:20]
            full[key] = entry
        text = json.dumps(full, ensure_ascii=False, sort_keys=True)
        if len(text) <= MAX_TAG_VALUE_CHARS:
            return text
        counts = {k: v["count"] for k, v in full.items()}
        text = json.dumps(counts, ensure_ascii=False, sort_keys=True)
        if len(text) <= MAX_TAG_VALUE_CHARS:
            return text
        kept: dict[str, Any] = {}
        for k, v in counts.items():
            kept[k] = v
            if len(json.dumps(kept, ensure_ascii=False)) > MAX_TAG_VALUE_CHARS - 40:
                del kept[k]
                break
        kept["..."] = f"{len(counts) - len(kept)} more keys"
        return json.dumps(kept, ensure_ascii=False)
