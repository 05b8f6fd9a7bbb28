"""MLflow's sqlite store written directly: what the MLflow plug-in does beside MLflow's own client calls
when the tracking store is a local sqlite file.

- `store`: a new store's tables made at once (from a template of MLflow's own build);
- `traces`: trace rows in one transaction per delivery (`BulkTraceWriter`), computed by `rows` with MLflow's
  span translation as `translation` runs it;
- `metrics`: metric rows in one transaction per delivery (`BulkMetricWriter`);
- `sqlite`: the writers' own connection to the store file.

Each writes exactly the rows MLflow's own calls would (tests/trackers/test_mlflow_bulk*.py compare every
table) and falls back to MLflow's client for any store that is not a local sqlite file.

One switch turns them all off: ``OTEL_RL_MLFLOW_DIRECT_WRITES=false`` (MLflow's own calls then write
everything); below it, ``OTEL_RL_MLFLOW_BULK_TRACES`` and ``OTEL_RL_MLFLOW_BULK_METRICS`` turn off one
writer each, and an empty ``OTEL_RL_MLFLOW_TEMPLATE_DIR`` the store template.
"""

from __future__ import annotations

import os

#: the one switch of the direct writers (default on)
ENV_DIRECT = "OTEL_RL_MLFLOW_DIRECT_WRITES"


def switched_on(env: str | None = None) -> bool:
    """Whether the direct writers are on (`ENV_DIRECT`) and, with `env`, that writer's own switch too."""
    names = (ENV_DIRECT,) if env is None else (ENV_DIRECT, env)
    return all(os.environ.get(n, "true").strip().lower() not in ("0", "false", "no", "off") for n in names)
