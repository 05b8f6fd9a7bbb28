"""``otel-rl prune``: retention for what grows -- MLflow traces, delivered spool segments, old JSONL files.

A dry run by default: it prints what would go and the bytes it frees; ``--yes`` deletes.

MLflow traces of an experiment (``--experiment``) or one run (``--mlflow-run-id``) go when they match every
criterion given: ``--older-than`` (a date, or an age like ``30d``) and ``--keep-last-steps N`` (beyond the
run's newest N steps).  Kept whatever the criteria: every k-th step (``--keep-every k``), failed
trajectories and validation ones (unless ``--include-failed`` / ``--include-validation``), traces without a
step when a step criterion is given, and the newest step of a RUNNING run.  Deleted through MLflow's own
``delete_traces``, 100 ids a call (in a SQL store, the run links it leaves behind are removed too).  Spool
segments go once delivered (a spool in use is skipped); JSONL files under ``--jsonl DIR`` go when last
modified before ``--older-than``, unless a live process holds the file open for writing (otel-rl's JSONL
writer marks its file with a shared ``flock``): a running trainer that has been silent for long keeps it.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
import time
from collections.abc import Iterable
from typing import Any

from . import semconv as sc
from .exporters.jsonl import is_in_use

DELETE_BATCH = 100  # trace ids per delete_traces call (MLflow's request limit)
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_cutoff(text: str, now: float | None = None) -> float:
    """A UNIX time from ``2026-01-31``, ``2026-01-31T12:00`` (UTC unless an offset is given) or an age (``30d``,
    ``12h``, ``2w``)."""
    now = time.time() if now is None else now
    m = _AGE.match(text)
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        dt = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--older-than: expected a date (2026-01-31) or an age (30d, 12h), got {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp()


@dataclasses.dataclass
class TracePolicy:
    older_than: float | None = None  # UNIX seconds
    keep_last_steps: int | None = None
    keep_every: int | None = None
    include_failed: bool = False
    include_validation: bool = False

    def given(self) -> bool:
        return self.older_than is not None or self.keep_last_steps is not None


@dataclasses.dataclass
class TraceRow:
    trace_id: str
    step: int | None
    validate: bool
    failed: bool
    timestamp_s: float
    size: int | None = None


def decide(rows: list[TraceRow], policy: TracePolicy, running: bool) -> tuple[list[TraceRow], dict[str, int]]:
    """The traces of one run that go, and why the others stay (reason -> count)."""
    steps = [r.step for r in rows if r.step is not None]
    newest = max(steps) if steps else None
    kept: dict[str, int] = {}
    gone = []

    def keep(reason: str) -> None:
        kept[reason] = kept.get(reason, 0) + 1

    for r in rows:
        if running and (r.step is None or r.step == newest):
            keep("newest step of a running run")
        elif r.failed and not policy.include_failed:
            keep("failed")
        elif r.validate and not policy.include_validation:
            keep("validation")
        elif policy.keep_every and r.step is not None and r.step % policy.keep_every == 0:
            keep(f"every {policy.keep_every}th step")
        elif policy.older_than is not None and r.timestamp_s >= policy.older_than:
            keep("newer than the date")
        elif policy.keep_last_steps is not None and r.step is None:
            keep("no step")
        elif (
            policy.keep_last_steps is not None
            and newest is not None
            and r.step is not None
            and r.step > newest - policy.keep_last_steps
        ):
            keep(f"newest {policy.keep_last_steps} steps")
        else:
            gone.append(r)
    return gone, kept


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


# ----------------------------------------------------------------------------- MLflow


def _sqlite_file(uri: str) -> str | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return path if os.path.isfile(path) else None


def _span_bytes(db: str, trace_ids: list[str]) -> dict[str, int]:
    """Bytes of each trace's span rows in a sqlite store (read only)."""
    import sqlite3

    out: dict[str, int] = {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        for i in range(0, len(trace_ids), 500):
            part = trace_ids[i : i + 500]
            q = (
                f"SELECT trace_id, SUM(LENGTH(content)) FROM spans WHERE trace_id IN ({','.join('?' * len(part))}) "
                "GROUP BY trace_id"
            )
            out.update({tid: int(n or 0) for tid, n in con.execute(q, part)})
    except sqlite3.Error:
        return {}
    finally:
        con.close()
    return out


_SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def drop_run_links(uri: str, trace_ids: list[str]) -> bool:
    """Remove the trace -> run links MLflow's `delete_traces` leaves behind (its SQL stores keep them, and
    `unlink_traces_from_run` is not implemented there).  Only rows of traces that no longer exist are
    removed.  False when the store is not a database this process can reach (a tracking server)."""
    if uri.split(":", 1)[0].split("+", 1)[0] not in _SQL_SCHEMES:
        return False
    import sqlalchemy as sa

    engine = sa.create_engine(uri)
    try:
        with engine.begin() as con:
            for i in range(0, len(trace_ids), 500):
                part = trace_ids[i : i + 500]
                con.execute(
                    sa.text(
                        "DELETE FROM entity_associations WHERE source_type = 'trace' AND source_id IN :ids "
                        "AND source_id NOT IN (SELECT request_id FROM trace_info WHERE request_id IN :ids)"
                    ).bindparams(sa.bindparam("ids", expanding=True)),
                    {"ids": part},
                )
    finally:
        engine.dispose()
    return True


def trace_rows(client: Any, experiment_id: str, run_id: str) -> list[TraceRow]:
    rows: list[TraceRow] = []
    token = None
    while True:
        page = client.search_traces(
            locations=[experiment_id], run_id=run_id, include_spans=False, max_results=500, page_token=token
        )
        for t in page:
            tags = t.info.tags
            step = tags.get(sc.TAG_STEP, "")
            state = str(getattr(t.info.state, "value", t.info.state))
            size = t.info.trace_metadata.get("mlflow.trace.sizeBytes")
            rows.append(
                TraceRow(
                    t.info.trace_id,
                    int(step) if step.lstrip("-").isdigit() else None,
                    tags.get(sc.TAG_VALIDATE) == "True",
                    state == "ERROR",
                    (t.info.request_time or 0) / 1000.0,
                    int(size) if size and size.isdigit() else None,
                )
            )
        token = page.token
        if not token:
            return rows


def prune_traces(client: Any, runs: list[Any], policy: TracePolicy, act: bool, out: Any) -> tuple[int, int]:
    """(traces deleted or to delete, bytes) over `runs`."""
    total_n = total_b = 0
    db = _sqlite_file(client.tracking_uri)
    for run in runs:
        info = run.info
        rows = trace_rows(client, info.experiment_id, info.run_id)
        gone, kept = decide(rows, policy, info.status == "RUNNING")
        if db and gone:
            sizes = _span_bytes(db, [r.trace_id for r in gone])
            for r in gone:
                r.size = r.size if r.size is not None else sizes.get(r.trace_id)
        nbytes = sum(r.size or 0 for r in gone)
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(kept.items())) or "none"
        steps = sorted({r.step for r in gone if r.step is not None})
        span = f" (steps {steps[0]}-{steps[-1]})" if steps else ""
        verb = "deleted" if act else "would delete"
        print(
            f"MLflow run {info.run_name!r} ({info.run_id}, {info.status}): {len(rows)} traces; {verb} "
            f"{len(gone)}{span}, ~{human(nbytes)}; kept {len(rows) - len(gone)} ({why})",
            file=out,
        )
        if act:
            ids = [r.trace_id for r in gone]
            for i in range(0, len(ids), DELETE_BATCH):
                client.delete_traces(info.experiment_id, trace_ids=ids[i : i + DELETE_BATCH])
            if ids and not drop_run_links(client.tracking_uri, ids):
                print(
                    "  (the run's links to the deleted traces stay in the server's database: MLflow has no API "
                    "that removes them; they are invisible to searches)",
                    file=out,
                )
        total_n += len(gone)
        total_b += nbytes
    return total_n, total_b


def mlflow_runs(client: Any, experiment: str | None, run_id: str | None) -> list[Any]:
    if run_id:
        return [client.get_run(run_id)]
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment named {experiment!r} at {client.tracking_uri}")
    runs, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


# ----------------------------------------------------------------------------- spool


def _ack(path: str) -> tuple[int, int] | None:
    """(segment, offset) the spool at `path` has acknowledged; None when its ack file has no valid slot."""
    from .spool.segment import read_ack

    try:
        fd = os.open(os.path.join(path, "ack"), os.O_RDONLY)
    except OSError:
        return None
    try:
        best = read_ack(fd)
    except OSError:
        best = None
    finally:
        os.close(fd)
    return None if best is None else (best[1], best[2])


def delivered_segments(path: str) -> tuple[list[str], bool]:
    """(segment files fully delivered, whether nothing at all is left) of one spool directory."""
    ack = _ack(path)
    segs = sorted(n for n in os.listdir(path) if n.endswith(".seg") and n[:-4].isdigit())
    if ack is None:
        return [], not segs
    done = []
    for name in segs:
        seq = int(name[:-4])
        full = os.path.join(path, name)
        if seq < ack[0] or (seq == ack[0] and ack[1] >= os.path.getsize(full)):
            done.append(full)
    return done, len(done) == len(segs)


def prune_spool(roots: Iterable[str], act: bool, out: Any) -> tuple[int, int]:
    import fcntl

    from .spool.replay import find_spools

    n_files = n_bytes = 0
    for path in find_spools(roots):
        lock = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                print(f"spool {path}: in use by a running process; skipped", file=out)
                continue
            done, empty = delivered_segments(path)
            size = sum(os.path.getsize(p) for p in done)
            if not done and not empty:
                continue
            what = "the whole directory (all delivered)" if empty else f"{len(done)} delivered segment(s)"
            print(f"spool {path}: {'deleted' if act else 'would delete'} {what}, {human(size)}", file=out)
            if act:
                for p in done:
                    os.unlink(p)
                if empty:
                    for name in ("ack", "meta.json", "lock"):
                        try:
                            os.unlink(os.path.join(path, name))
                        except FileNotFoundError:
                            pass
                    try:
                        os.rmdir(path)
                    except OSError:
                        pass
            n_files += len(done)
            n_bytes += size
        finally:
            os.close(lock)
    return n_files, n_bytes


# ----------------------------------------------------------------------------- JSONL


def prune_jsonl(dirs: Iterable[str], cutoff: float, act: bool, out: Any) -> tuple[int, int]:
    n = size = 0
    for d in dirs:
        files = (
            [d]
            if os.path.isfile(d)
            else [os.path.join(root, f) for root, _, names in os.walk(d) for f in names if f.endswith(".jsonl")]
        )
        for path in sorted(files):
            st = os.stat(path)
            if st.st_mtime >= cutoff:
                continue
            when = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
            if is_in_use(path):  # a running trainer's file, silent for long: never deleted
                print(f"JSONL {path}: kept, a running process writes it (last written {when} UTC)", file=out)
                continue
            print(
                f"JSONL {path}: {'deleted' if act else 'would delete'}, {human(st.st_size)} (last written {when} UTC)",
                file=out,
            )
            if act:
                os.unlink(path)
            n += 1
            size += st.st_size
    return n, size


# ----------------------------------------------------------------------------- command


def add_arguments(p: Any) -> None:
    p.description = __doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else None
    g = p.add_argument_group("MLflow traces")
    g.add_argument("--experiment", default=None, metavar="NAME", help="every run of this MLflow experiment")
    g.add_argument("--mlflow-run-id", default=None, metavar="ID", help="only this MLflow run")
    g.add_argument("--tracking-uri", default=None, metavar="URI", help="default: MLFLOW_TRACKING_URI")
    g.add_argument(
        "--keep-last-steps", type=int, default=None, metavar="N", help="delete traces beyond the run's newest N steps"
    )
    g.add_argument("--keep-every", type=int, default=None, metavar="K", help="keep every K-th step (step %% K == 0)")
    g.add_argument("--include-failed", action="store_true", help="failed trajectories may go too")
    g.add_argument("--include-validation", action="store_true", help="validation trajectories may go too")
    g = p.add_argument_group("files")
    g.add_argument(
        "--spool",
        action="append",
        default=None,
        metavar="DIR",
        help="delete delivered segments of the spools under DIR (repeatable)",
    )
    g.add_argument(
        "--jsonl",
        action="append",
        default=None,
        metavar="DIR",
        help="delete *.jsonl files under DIR last written before --older-than (repeatable)",
    )
    p.add_argument(
        "--older-than",
        default=None,
        metavar="DATE|AGE",
        help="traces logged / files written before this: 2026-01-31, 30d, 12h",
    )
    p.add_argument("--yes", action="store_true", help="delete (without it: a dry run)")


def run(args: Any) -> int:
    out = sys.stdout
    try:
        cutoff = parse_cutoff(args.older_than) if args.older_than else None
        for name in ("keep_last_steps", "keep_every"):
            v = getattr(args, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        policy = TracePolicy(
            cutoff, args.keep_last_steps, args.keep_every, args.include_failed, args.include_validation
        )
        if args.jsonl and cutoff is None:
            raise ValueError("--jsonl needs --older-than")
        if (args.experiment or args.mlflow_run_id) and not policy.given():
            raise ValueError("say which traces go: --older-than and/or --keep-last-steps")
        if not (args.experiment or args.mlflow_run_id or args.spool or args.jsonl):
            raise ValueError("nothing to prune: give --experiment / --mlflow-run-id, --spool or --jsonl")
    except ValueError as exc:
        print(f"otel-rl prune: {exc}", file=sys.stderr)
        return 2
    total = 0
    try:
        if args.experiment or args.mlflow_run_id:
            from .exporters.registry import store_client

            uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:////tmp/mlruns.db"
            client = store_client("mlflow", uri)
            n, b = prune_traces(client, mlflow_runs(client, args.experiment, args.mlflow_run_id), policy, args.yes, out)
            total += b
        if args.spool:
            total += prune_spool(args.spool, args.yes, out)[1]
        if args.jsonl:
            total += prune_jsonl(args.jsonl, cutoff, args.yes, out)[1]  # type: ignore[arg-type]
    except Exception as exc:  # unknown run or experiment, unreachable server
        print(f"otel-rl prune: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.yes:
        print(f"freed ~{human(total)}", file=out)
    else:
        print(f"would free ~{human(total)}; nothing was deleted (dry run): add --yes to delete", file=out)
    return 0


__all__ = ["TracePolicy", "TraceRow", "decide", "parse_cutoff", "prune_jsonl", "prune_spool", "prune_traces"]
