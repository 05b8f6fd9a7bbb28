"""A direct writer's own connection to MLflow's sqlite store file, and what the writers need to know of the store."""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Any


def sqlite_store_path(store: Any) -> str | None:
    """The local sqlite file of an MLflow ``SqlAlchemyStore``; None for other stores, in-memory or missing files."""
    from mlflow.store.tracking import sqlalchemy_store as m

    if not isinstance(store, m.SqlAlchemyStore) or store.db_type != "sqlite":
        return None
    db = store.engine.url.database
    if not db or db == ":memory:" or not os.path.exists(db):
        return None
    return os.path.abspath(db)


class SqliteWriter:
    """A direct writer's own connection to a sqlite store file (autocommit; transactions are explicit)."""

    def __init__(self, db_path: str):
        self.path = db_path
        self._con: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        if self._con is None:
            self._con = sqlite3.connect(self.path, timeout=60.0, isolation_level=None, check_same_thread=False)
            # room for a large transaction's pages: with sqlite's default 2 MiB cache, a transaction of a
            # few thousand spans spills pages to the database file before its commit (more syncs, pages
            # written twice)
            self._con.execute("PRAGMA cache_size=-32768")
        return self._con

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                try:
                    self._con.close()
                except sqlite3.Error:
                    pass
                self._con = None


def mlflow_version() -> str:
    try:
        import mlflow

        return mlflow.__version__
    except Exception:  # pragma: no cover
        return "?"
