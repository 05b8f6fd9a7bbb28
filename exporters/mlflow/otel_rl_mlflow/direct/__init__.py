"""MLflow's sqlite store written directly: what the MLflow plug-in does beside MLflow's own client calls
when the tracking store is a local sqlite file.

- `store`: a new store's tables made at once (from a template of MLflow's own build);
- `traces`: trace rows in one transaction per delivery (`BulkTraceWriter`);
- `metrics`: metric rows in one transaction per delivery (`BulkMetricWriter`).

Each writes exactly the rows MLflow's own calls would (tests/trackers/test_mlflow_bulk*.py compare every
table) and falls back to MLflow's client for any store that is not a local sqlite file.
"""
