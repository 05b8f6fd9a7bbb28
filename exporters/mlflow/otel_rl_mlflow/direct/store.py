"""A new sqlite tracking store made at once: MLflow's tables built by its own migrations the first time, then
kept as a template (one per MLflow, SQLAlchemy, alembic and sqlite version) and copied for every later
new store, which MLflow then opens and uses as its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

from otel_rl.config import cache_dir
from otel_rl.spool import fsync_dir

from . import switched_on

_log = logging.getLogger("otel_rl")


def sqlite_path(uri: str) -> str | None:
    """The file of a sqlite tracking URI, as SQLAlchemy reads it (None for anything else, or in memory)."""
    try:
        from sqlalchemy.engine import make_url

        url = make_url(uri)
    except Exception:
        return None
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return url.database


#: where the empty tables of a new sqlite store are kept between runs, one file per MLflow version
#: (default ``$XDG_CACHE_HOME/otel-rl/mlflow``, ``~/.cache/...`` without it); an empty value: not kept
ENV_STORE_TEMPLATE_DIR = "OTEL_RL_MLFLOW_TEMPLATE_DIR"


def template_path() -> str | None:
    """The file holding what MLflow's `_initialize_tables` makes of an empty sqlite file, for this
    MLflow, its migrations, SQLAlchemy, alembic and sqlite (None: templates are off)."""
    directory = os.environ.get(ENV_STORE_TEMPLATE_DIR)
    if directory is None:
        directory = cache_dir("mlflow")
    if not directory:
        return None
    import hashlib
    import sqlite3

    import alembic
    import mlflow
    import sqlalchemy

    versions = os.path.join(os.path.dirname(mlflow.__file__), "store", "db_migrations", "versions")
    revisions = sorted(n for n in os.listdir(versions) if n.endswith(".py"))
    key = "\n".join(
        [mlflow.__version__, sqlalchemy.__version__, alembic.__version__, sqlite3.sqlite_version, *revisions]
    )
    return os.path.join(directory, f"store-{mlflow.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.db")


def _copy_synced(src: str, dst: str) -> None:
    """`src` copied to the new file `dst` (which must not exist), its data on disk before this returns."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(1 << 20):
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())


def is_sqlite_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _keep_template(built: str, template: str) -> None:
    """A store just built becomes the template of later ones (put in place whole, never half-written;
    one made meanwhile by another process stays, a file there that is no sqlite store is replaced).
    Failures only cost the next new store the build."""
    tmp = f"{template}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        os.makedirs(os.path.dirname(template), exist_ok=True)
        _copy_synced(built, tmp)
        try:
            os.link(tmp, template)
        except FileExistsError:
            if not is_sqlite_file(template):  # not a store (written by something else): replaced
                os.replace(tmp, template)
    except OSError as exc:
        _log.debug("otel-rl: the empty MLflow store could not be kept as %s (%s)", template, exc)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def create_sqlite_store(uri: str) -> bool:
    """A new sqlite store gets MLflow's tables here, all at once, and is put in place only if no store
    appeared there meanwhile.  The tables are what MLflow's own `_initialize_tables` makes of an empty
    file: built once per MLflow version in a scratch file without a sync per migration step (MLflow's
    migrations commit one by one, ~1,000 fsyncs, ~1 s of CPU time in all), kept as a template
    (`ENV_STORE_TEMPLATE_DIR`), and copied from it for every later new store.  An existing file is left
    alone (MLflow opens and checks it).  True if this call created the store; any failure leaves the
    creation to MLflow, as without this."""
    path = sqlite_path(uri)
    if path is None or os.path.exists(path) or not switched_on():
        return False
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return False
    tmp = f"{path}.otel-rl-{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        try:
            template = template_path()
        except Exception as exc:  # no MLflow migrations where expected: build as before
            _log.debug("otel-rl: no template for new MLflow stores (%s)", exc)
            template = None
        if template is not None and is_sqlite_file(template):
            _copy_synced(template, tmp)
        else:
            _build_tables(tmp)
            if template is not None:
                _keep_template(tmp, template)
        try:
            os.link(tmp, path)  # fails if a store appeared meanwhile: that one stays
        except FileExistsError:
            return False
        fsync_dir(directory)  # the new name, durable
        return True
    except Exception as exc:  # MLflow creates the store itself, one migration at a time
        _log.debug("otel-rl: creating the MLflow store %s in one go failed (%s); MLflow creates it", path, exc)
        return False
    finally:
        for leftover in (tmp, tmp + "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


def _build_tables(tmp: str) -> None:
    """MLflow's tables in the new file `tmp`, made by MLflow's own migrations, synced once at the end."""
    import sqlalchemy
    from mlflow.store.db import utils as db_utils

    engine = sqlalchemy.create_engine(f"sqlite:///{tmp}")

    @sqlalchemy.event.listens_for(engine, "connect")
    def _unsynced(dbapi_con: Any, _record: Any) -> None:  # a scratch file until it is synced below
        dbapi_con.execute("PRAGMA synchronous=OFF")
        dbapi_con.execute("PRAGMA journal_mode=MEMORY")

    try:
        db_utils._initialize_tables(engine)
    finally:
        engine.dispose()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
