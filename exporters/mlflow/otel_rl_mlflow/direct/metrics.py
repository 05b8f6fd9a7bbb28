"""Metrics into a sqlite tracking store: MLflow's rows, one transaction and one ``executemany`` per batch.

MLflow's ``log_batch`` goes through its ORM: a session, the run read back, one ORM object per metric
point, a SELECT of the run's latest values, one UPDATE per key, the commit.  For a step of ~60
verl-style metrics that is several milliseconds of CPU in the export process, every step: the
largest part of its work after the traces.  `BulkMetricWriter` writes the same rows with plain
SQL: the points into ``metrics``, the newer values into ``latest_metrics``, in one transaction.

What it writes follows ``SqlAlchemyStore.log_batch`` for metrics (MLflow's own validation and value
sanitising are called; NaN is stored as 0 with ``is_nan``, +-Inf as +-1.797e308; a key's latest value
is replaced by a point that is newer by (step, timestamp, value), the first one winning a tie).  It
checks itself against MLflow before it is trusted, on the store it writes to: the first batch
it gets is written by MLflow, and the rows MLflow wrote are read back and compared with the rows this
writer computes for that batch (``metrics`` and ``latest_metrics`` whole; the other tables of the run
must not have changed).  Equal: later batches take the fast path.  Different: the fast path is off
for the rest of the process (one warning) and MLflow writes everything.

MLflow writes, as before: a batch with tags or logged-model metrics, a batch with a point that MLflow's
validation rejects (it raises MLflow's error), a batch for a run that is not active, a batch with
points that are already stored (a re-delivery: MLflow skips those), anything while the writer is
off; and every store that is not a local sqlite file, or with ``OTEL_RL_MLFLOW_BULK_METRICS=false``.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any

from . import switched_on
from .sqlite import SqliteWriter, mlflow_version, sqlite_store_path

_log = logging.getLogger("otel_rl")

ENV_BULK_METRICS = "OTEL_RL_MLFLOW_BULK_METRICS"
_METRIC_COLUMNS = ("key", "value", "timestamp", "step", "is_nan", "run_uuid")
_LATEST_COLUMNS = ("key", "value", "timestamp", "step", "is_nan", "run_uuid")


def enabled_by_env() -> bool:
    return switched_on(ENV_BULK_METRICS)


def _sanitize(value: float) -> tuple[int, float]:
    """(is_nan, stored value), as ``SqlAlchemyStore.sanitize_metric_value`` stores them."""
    if math.isnan(value):
        return 1, 0.0
    if math.isinf(value):
        return 0, 1.7976931348623157e308 if value > 0 else -1.7976931348623157e308
    return 0, value


class BulkMetricWriter(SqliteWriter):
    """Writes metric points of a sqlite tracking store's runs directly (see the module doc)."""

    def __init__(self, db_path: str, validate: Callable[..., None]):
        super().__init__(db_path)
        self._validate = validate
        self.state = "probing"  # -> "on" after a verified batch; "off" after a mismatch
        self.mismatch: str | None = None
        self.fast_batches = 0  # written here
        self.mlflow_batches = 0  # written by MLflow
        self._run_tables: list[str] | None = None

    @classmethod
    def for_store(cls, store: Any) -> BulkMetricWriter | None:
        """A writer for `store`, or None when the fast path does not apply to it."""
        if not enabled_by_env():
            return None
        try:
            from mlflow.utils.validation import _validate_metric

            db = sqlite_store_path(store)
        except Exception as exc:  # an MLflow without these parts: MLflow writes the metrics
            _log.debug("otel-rl: MLflow bulk metric writes not available: %s", exc)
            return None
        return cls(db, _validate_metric) if db else None

    # -- the entry point -------------------------------------------------------------------
    def log(self, run_id: str, metrics: Sequence[Any], mlflow_write: Callable[[list[Any]], None]) -> None:
        """Store `metrics` (mlflow ``Metric`` objects) in run `run_id`; `mlflow_write(metrics)` is MLflow's
        own way (``log_batch``)."""
        metrics = list(metrics)
        if not metrics:
            return
        rows = self._points(run_id, metrics) if self.state != "off" else None
        if rows is None:
            self._mlflow(metrics, mlflow_write)
            return
        if self.state == "probing":
            self._probe(run_id, metrics, rows, mlflow_write)
            return
        if not self._write(run_id, rows):
            self._mlflow(metrics, mlflow_write)
            return
        self.fast_batches += 1

    def _mlflow(self, metrics: list[Any], mlflow_write: Callable[[list[Any]], None]) -> None:
        mlflow_write(metrics)
        self.mlflow_batches += 1

    # -- rows --------------------------------------------------------------------------------
    def _points(self, run_id: str, metrics: list[Any]) -> list[tuple] | None:
        """The ``metrics`` rows of a batch, or None when MLflow must write it (see the module doc)."""
        rows: list[tuple] = []
        seen: set[tuple] = set()
        validate = self._validate
        one = len(metrics) == 1
        for i, m in enumerate(metrics):
            if getattr(m, "model_id", None) is not None or getattr(m, "dataset_name", None) is not None:
                return None
            try:
                validate(m.key, m.value, m.timestamp, m.step, path="" if one else f"metrics[{i}]")
            except Exception:
                return None  # MLflow raises its own error for it
            is_nan, value = _sanitize(float(m.value))
            row = (m.key, value, m.timestamp, m.step, is_nan, run_id)  # the table's primary key, too
            if row in seen:
                return None  # the same point twice in a batch: MLflow's de-duplication decides
            seen.add(row)
            rows.append(row)
        return rows

    @staticmethod
    def latest(points: list[tuple], stored: dict[str, tuple]) -> tuple[list[tuple], list[tuple]]:
        """The ``latest_metrics`` rows to insert and to update after `points`, given the `stored` ones
        (key -> row, the columns of _LATEST_COLUMNS)."""
        new: dict[str, tuple] = {}
        changed: dict[str, tuple] = {}
        for p in points:
            key = p[0]
            cur = changed.get(key) or new.get(key) or stored.get(key)
            if cur is None:
                new[key] = p
            elif (p[3], p[2], p[1]) > (cur[3], cur[2], cur[1]):  # (step, timestamp, value), strictly newer
                if key in stored:
                    changed[key] = p
                else:
                    new[key] = p
        return list(new.values()), list(changed.values())

    # -- sqlite ------------------------------------------------------------------------------
    def _stored_latest(self, con: sqlite3.Connection, run_id: str, keys: list[str]) -> dict[str, tuple]:
        out: dict[str, tuple] = {}
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            q = (
                f"SELECT {', '.join(_LATEST_COLUMNS)} FROM latest_metrics "
                f"WHERE run_uuid = ? AND key IN ({','.join('?' * len(part))})"
            )
            out.update((r[0], r) for r in con.execute(q, [run_id, *part]))
        return out

    def _write(self, run_id: str, rows: list[tuple]) -> bool:
        """One transaction; False (nothing written) when MLflow must write the batch."""
        with self._lock:
            con = self._connection()
            con.execute("BEGIN IMMEDIATE")
            try:
                stage = con.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
                if stage is None or stage[0] != "active":
                    con.execute("ROLLBACK")
                    return False  # MLflow raises its own error for it
                try:
                    con.executemany(
                        f"INSERT INTO metrics ({', '.join(_METRIC_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?)", rows
                    )
                except sqlite3.IntegrityError:  # already stored (a re-delivery): MLflow skips those points
                    con.execute("ROLLBACK")
                    return False
                stored = self._stored_latest(con, run_id, sorted({r[0] for r in rows}))
                insert, update = self.latest(rows, stored)
                if insert:
                    con.executemany(
                        f"INSERT INTO latest_metrics ({', '.join(_LATEST_COLUMNS)}) VALUES (?, ?, ?, ?, ?, ?)", insert
                    )
                if update:
                    con.executemany(
                        "UPDATE latest_metrics SET value = ?, timestamp = ?, step = ?, is_nan = ? "
                        "WHERE key = ? AND run_uuid = ?",
                        [(r[1], r[2], r[3], r[4], r[0], r[5]) for r in update],
                    )
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
            return True

    # -- verification ------------------------------------------------------------------------
    def _tables_of_runs(self, con: sqlite3.Connection) -> list[str]:
        if self._run_tables is None:
            found = []
            for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall():
                cols = [r[1] for r in con.execute(f"PRAGMA table_info('{table}')")]
                if "run_uuid" in cols and table not in ("metrics", "latest_metrics"):
                    found.append(table)
            self._run_tables = found
        return self._run_tables

    def _snapshot(self, run_id: str, keys: list[str]) -> tuple[dict[str, tuple], dict[str, int]]:
        with self._lock:
            con = self._connection()
            counts = {
                t: con.execute(f"SELECT COUNT(*) FROM '{t}' WHERE run_uuid = ?", (run_id,)).fetchone()[0]
                for t in self._tables_of_runs(con)
            }
            return self._stored_latest(con, run_id, keys), counts

    def _stored(self, run_id: str, rows: list[tuple]) -> tuple[list[dict], list[dict]]:
        """Every ``metrics`` row of the run at the batch's (key, step) pairs, and the batch keys' latest rows."""
        with self._lock:
            con = self._connection()
            points: list[dict] = []
            for key, step in sorted({(r[0], r[3]) for r in rows}):
                cur = con.execute(
                    "SELECT * FROM metrics WHERE run_uuid = ? AND key = ? AND step = ?", (run_id, key, step)
                )
                names = [d[0] for d in cur.description]
                points.extend(dict(zip(names, r)) for r in cur.fetchall())
            keys = sorted({r[0] for r in rows})
            latest: list[dict] = []
            for key in keys:
                cur = con.execute("SELECT * FROM latest_metrics WHERE run_uuid = ? AND key = ?", (run_id, key))
                names = [d[0] for d in cur.description]
                latest.extend(dict(zip(names, r)) for r in cur.fetchall())
            return points, latest

    def _probe(
        self, run_id: str, metrics: list[Any], rows: list[tuple], mlflow_write: Callable[[list[Any]], None]
    ) -> None:
        """MLflow writes this batch; its rows are compared with the ones computed here."""
        snapshot: tuple[dict[str, tuple], dict[str, int]] | str
        try:
            snapshot = self._snapshot(run_id, sorted({r[0] for r in rows}))
        except Exception as exc:
            snapshot = f"{type(exc).__name__}: {exc}"
        self._mlflow(metrics, mlflow_write)  # MLflow's errors propagate as they would without this writer
        diff: str | None = snapshot if isinstance(snapshot, str) else None
        if diff is None:
            try:
                diff = self._compare(run_id, rows, *snapshot)
            except Exception as exc:  # cannot tell: stay on MLflow's path
                diff = f"{type(exc).__name__}: {exc}"
        if diff is None:
            self.state = "on"
            return
        self.state = "off"
        self.mismatch = diff
        _log.warning(
            "otel-rl: MLflow store %s: the direct metric writer does not write what MLflow %s writes (%s); "
            "MLflow writes the metrics (slower)",
            self.path,
            mlflow_version(),
            diff,
        )

    def _compare(self, run_id: str, rows: list[tuple], before: dict[str, tuple], counts: dict[str, int]) -> str | None:
        points, latest = self._stored(run_id, rows)
        expected_points = sorted(tuple(r) for r in rows)
        got_points = sorted(_as_row(d, _METRIC_COLUMNS) for d in points)
        if any(set(d) != set(_METRIC_COLUMNS) for d in points):
            return f"metrics columns {sorted(points[0])}"
        if got_points != expected_points:
            return f"metrics rows {got_points[:3]} != {expected_points[:3]}"
        insert, update = self.latest(rows, before)
        expected_latest = dict(before)
        expected_latest.update((r[0], r) for r in insert + update)
        if any(set(d) != set(_LATEST_COLUMNS) for d in latest):
            return f"latest_metrics columns {sorted(latest[0])}"
        got_latest = {d["key"]: _as_row(d, _LATEST_COLUMNS) for d in latest}
        if got_latest != {k: tuple(v) for k, v in expected_latest.items()}:  # both: the batch's keys only
            return "latest_metrics rows differ"
        _, after = self._snapshot(run_id, [])
        if after != counts:
            return f"other tables changed: {counts} -> {after}"
        return None


def _as_row(d: dict, columns: Sequence[str]) -> tuple:
    out = []
    for c in columns:
        v = d[c]
        if c == "is_nan":
            v = int(bool(v))
        elif c == "value" and v is not None:
            v = float(v)
        out.append(v)
    return tuple(out)
