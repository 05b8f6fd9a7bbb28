"""``otel-rl replay [SPOOL_DIR ...] [--exporters NAMES] [--timeout S] [--list]``

Delivers what spool directories still hold (a trainer or bridge that was killed, or that shut
down while its tracker was unreachable).  A directory may be one exporter's spool, a run's
spool directory (one sub-directory per exporter) or the whole spool root; without one, the
default root (``~/.cache/otel-rl/spool``) is searched.  Exit status: 0 when everything found
was delivered (or there was nothing), 1 when something is left (exporter still failing, spool
in use, an exporter that cannot be rebuilt).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[1] if __doc__ else None
    parser.add_argument(
        "paths", nargs="*", metavar="SPOOL_DIR", help="spool directories (default: the default spool root)"
    )
    parser.add_argument(
        "--exporters",
        action="append",
        default=None,
        metavar="NAMES",
        help="only these exporters (comma-separated; may be repeated)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="give up on one spool after S seconds of failing deliveries (default 300)",
    )
    parser.add_argument("--list", action="store_true", help="only show what is waiting; deliver nothing")


def run(args: Any) -> int:
    from . import default_root
    from .replay import replay

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    paths = list(args.paths) or [default_root()]
    names = None
    if args.exporters:
        names = [n.strip() for part in args.exporters for n in part.split(",") if n.strip()]
    results = replay(paths, exporters=names, timeout_s=args.timeout, list_only=args.list, out=sys.stdout)
    if not results:
        print(f"otel-rl replay: no spool under {', '.join(paths)}", flush=True)
        return 0
    if args.list:
        return 0
    bad = [r for r in results if r.status not in ("delivered", "empty")]
    total = sum(r.delivered for r in results)
    print(
        f"otel-rl replay: {total} items delivered from {len(results)} spool(s); {len(bad)} with items left", flush=True
    )
    return 1 if bad else 0
