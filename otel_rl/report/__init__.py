"""``otel-rl report RUN [-o FILE]``: one self-contained HTML page for a run.

RUN is the run's JSONL file (verl's file logger format); with ``--mlflow-run-id`` the config and
sample trajectories (best, worst and failed of a few steps, with their turns) come from that MLflow run
(the tracking URI as the trainer uses it: ``MLFLOW_TRACKING_URI`` or ``--tracking-uri``), and without a
JSONL file its metrics too.  The page embeds plotly.js: it opens without a network.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .data import RunData, load


def default_output(jsonl: str | None, mlflow_run_id: str | None) -> str:
    """Beside the JSONL file (``<name>.report.html``), else ``mlflow-<run id>.report.html`` here."""
    if jsonl:
        return os.path.splitext(os.path.abspath(jsonl))[0] + ".report.html"
    return os.path.abspath(f"mlflow-{mlflow_run_id}.report.html")


def write_report(
    jsonl: str | None = None,
    mlflow_run_id: str | None = None,
    output: str | None = None,
    tracking_uri: str | None = None,
) -> str:
    """Write the page; returns its path."""
    from .page import render

    try:
        import plotly  # noqa: F401
    except ImportError:
        raise RuntimeError("the report's charts need plotly: run `pip install 'otel-rl[report]'`") from None
    data = load(jsonl, mlflow_run_id, tracking_uri)
    if not data.metrics and not data.trajectories:
        raise ValueError(f"nothing to show: {data.source} holds no metrics")
    path = os.path.abspath(output or default_output(jsonl, mlflow_run_id))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render(data))
    os.replace(tmp, path)
    return path


def add_arguments(parser: Any) -> None:
    parser.description = __doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else None
    parser.add_argument("run", nargs="?", metavar="RUN", help="the run's JSONL file")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="where to write the page (default: beside the JSONL file, <name>.report.html)",
    )
    parser.add_argument(
        "--mlflow-run-id",
        default=None,
        metavar="ID",
        help="the MLflow run: config and trajectories (and metrics, without RUN)",
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        metavar="URI",
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else verl's sqlite:////tmp/mlruns.db)",
    )


def run(args: Any) -> int:
    if not args.run and not args.mlflow_run_id:
        print("otel-rl report: give the run's JSONL file, or --mlflow-run-id", file=sys.stderr)
        return 2
    if args.run and not os.path.isfile(args.run):
        print(f"otel-rl report: no such file: {args.run}", file=sys.stderr)
        return 2
    try:
        path = write_report(args.run, args.mlflow_run_id, args.output, args.tracking_uri)
    except Exception as exc:  # unreadable file, unknown MLflow run, unreachable server
        print(f"otel-rl report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


__all__ = ["RunData", "default_output", "load", "write_report"]
