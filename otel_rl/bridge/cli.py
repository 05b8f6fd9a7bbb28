"""``otel-rl bridge``: receive OTLP, deliver to the tracker exporters.  See docs/bridge.md."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from typing import Any

from .core import MIB, Settings

_log = logging.getLogger("otel_rl.bridge")
OFF = ("off", "none", "no", "false", "0", "")


def parse_address(text: str, default_port: int) -> tuple[str, int] | None:
    """``host:port``, ``[v6]:port``, ``:port`` (loopback), ``port``; ``off`` disables the receiver."""
    t = text.strip()
    if t.lower() in OFF:
        return None
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        port = rest.lstrip(":") or str(default_port)
    elif t.count(":") == 1:
        host, _, port = t.partition(":")
    elif t.isdigit():
        host, port = "", t
    else:
        host, port = t, str(default_port)
    host = host or "127.0.0.1"
    try:
        n = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in address {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"bad port in address {text!r}")
    return host, n


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _headers_from_env(name: str | None) -> dict[str, str]:
    if not name:
        return {}
    raw = os.environ.get(name, "")
    out = {}
    for part in raw.split(","):
        k, sep, v = part.partition("=")
        if sep and k.strip():
            out[k.strip()] = v.strip()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.description = (
        "Receive OTLP (HTTP and gRPC) from trainers or an OpenTelemetry Collector and deliver it to the "
        "tracker exporters, one tracker run per run identity. Stops cleanly on SIGTERM."
    )
    g = p.add_argument_group("receivers")
    g.add_argument(
        "--http-address",
        default=env("OTEL_RL_BRIDGE_HTTP_ADDRESS", "127.0.0.1:4318"),
        metavar="HOST:PORT",
        help="OTLP/HTTP listen address (default %(default)s; 'off' to disable; port 0 picks one)",
    )
    g.add_argument(
        "--grpc-address",
        default=env("OTEL_RL_BRIDGE_GRPC_ADDRESS", "127.0.0.1:4317"),
        metavar="HOST:PORT",
        help="OTLP/gRPC listen address (default %(default)s; 'off' to disable)",
    )
    g = p.add_argument_group("delivery")
    g.add_argument(
        "--exporters",
        default=env("OTEL_RL_BRIDGE_EXPORTERS", "console"),
        metavar="NAMES",
        help="comma-separated exporter names, e.g. mlflow,wandb,swanlab ('discard' drops everything; "
        "default %(default)s)",
    )
    g.add_argument(
        "--trace-backend",
        default=env("OTEL_RL_TRACE_BACKEND") or None,
        metavar="NAME",
        help="the exporter that receives trajectories (verl's rollout.trace.backend), e.g. mlflow",
    )
    g.add_argument(
        "--root-grace",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="hold each root span this long so children arriving after it (out of order behind a "
        "Collector) still join its trajectory (default %(default)s; 0: off)",
    )
    g.add_argument("--queue-size", type=int, default=100_000, help="items per exporter queue (default %(default)s)")
    g.add_argument(
        "--batch-delay",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="how often the pipeline's worker looks for flushes and shutdown (default %(default)s); received "
        "spans are built into records as their request arrives",
    )
    g.add_argument(
        "--forward-endpoint",
        default=None,
        metavar="URL",
        help="also forward every accepted request body, as received, to this OTLP/HTTP base URL",
    )
    g.add_argument(
        "--forward-headers-env",
        default=None,
        metavar="NAME",
        help="environment variable with headers for the forward endpoint, 'k=v,k2=v2'",
    )
    g.add_argument("--forward-queue-mib", type=int, default=256, help="forward queue bound in MiB (default 256)")
    g = p.add_argument_group("security")
    g.add_argument(
        "--auth-token-env",
        default=None,
        metavar="NAME",
        help="require 'Authorization: Bearer <token>' with the token read from this environment variable",
    )
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="serve HTTPS and gRPC over TLS with this certificate"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--max-body-mib", type=float, default=20.0, help="largest request body as sent (default 20)")
    g.add_argument(
        "--max-decompressed-mib", type=float, default=64.0, help="largest request body after decompression (default 64)"
    )
    g.add_argument(
        "--max-decompression-ratio",
        type=float,
        default=200.0,
        help="largest inflate ratio for bodies above 1 MiB decompressed (default 200)",
    )
    g.add_argument(
        "--decompression-budget-mib",
        type=float,
        default=256.0,
        help="what all requests together may hold decompressed at once; beyond it a request gets a "
        "retryable 503 (default 256; at least --max-decompressed-mib)",
    )
    g.add_argument("--max-connections", type=int, default=256, help="concurrent connections / gRPC calls (default 256)")
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection idle (or stalled mid-request) this long (default 30)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request (line, headers and body) must arrive whole within this time of its first byte; "
        "408 and close beyond (default 30)",
    )
    g = p.add_argument_group("operations")
    g.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help="serve the bridge's own metrics for Prometheus on this port (0 picks one; off by default)",
    )
    g.add_argument(
        "--prometheus-host", default="127.0.0.1", help="address of the metrics endpoint (default %(default)s)"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM, time allowed to deliver what was received (default %(default)s)",
    )
    g.add_argument("--grpc-workers", type=int, default=4, help="gRPC worker threads (default %(default)s)")
    g.add_argument(
        "--log-level",
        default=env("OTEL_RL_BRIDGE_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="default %(default)s",
    )


def settings_from_args(args: Any) -> Settings:
    http = parse_address(args.http_address, 4318)
    grpc = parse_address(args.grpc_address, 4317)
    if http is None and grpc is None:
        raise ValueError("both receivers are off: give --http-address or --grpc-address")
    token = None
    if args.auth_token_env:
        token = os.environ.get(args.auth_token_env, "")
        if not token.strip():
            raise ValueError(f"--auth-token-env {args.auth_token_env}: that environment variable is empty or unset")
        token = token.strip()
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path and not os.path.isfile(path):
            raise ValueError(f"no such file: {path}")
    if args.prometheus_port is not None and not 0 <= args.prometheus_port <= 65535:
        raise ValueError("--prometheus-port must be 0..65535")
    if args.decompression_budget_mib < args.max_decompressed_mib:
        raise ValueError("--decompression-budget-mib must be at least --max-decompressed-mib")
    if not args.request_timeout > 0:
        raise ValueError("--request-timeout must be a positive number of seconds")
    names = tuple(n.strip() for n in args.exporters.split(",") if n.strip())
    if not names:
        raise ValueError("--exporters is empty")
    return Settings(
        http_address=http,
        grpc_address=grpc,
        exporters=names,
        trace_backend=args.trace_backend or None,
        forward_endpoint=args.forward_endpoint or None,
        forward_headers=_headers_from_env(args.forward_headers_env),
        forward_queue_mib=args.forward_queue_mib,
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
        auth_token=token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_body_bytes=int(args.max_body_mib * MIB),
        max_decompressed_bytes=int(args.max_decompressed_mib * MIB),
        max_decompression_ratio=args.max_decompression_ratio,
        decompression_budget_bytes=int(args.decompression_budget_mib * MIB),
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout,
        request_timeout_s=args.request_timeout,
        queue_size=args.queue_size,
        batch_delay_s=args.batch_delay,
        grpc_workers=args.grpc_workers,
        shutdown_timeout_s=args.shutdown_timeout,
        root_grace_s=max(0.0, args.root_grace),
    )


# packages of the bridge's receivers, installed by the `bridge` extra
_BRIDGE_PACKAGES = ("grpc", "google.protobuf", "opentelemetry.proto")


def _install_hint(error: BaseException) -> str:
    """The command that installs a receiver package the bridge could not import, else ''."""
    exc: BaseException | None = error
    while exc is not None:
        name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        if name and any(name == p or name.startswith(p + ".") for p in _BRIDGE_PACKAGES):
            return "; install the bridge's receivers with: pip install 'otel-rl[bridge]'"
        exc = exc.__cause__ or exc.__context__
    return ""


# The collector runs after this many allocations without a matching free (CPython's default: 700).  Decoding
# makes several objects per received span, most of them freed within the batch; at the default the bridge
# spends about a tenth of its CPU looking for cycles among them.
GC_THRESHOLD = (20_000, 50, 1000)


def _tune_gc() -> None:
    """The bridge process only: what was loaded at start (modules, tracker libraries, the exporters) is moved
    out of the collector's sight for good, and the youngest generation collected less often."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def run(args: Any) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("otel_rl").setLevel(getattr(logging, args.log_level.upper()))
    from .core import Bridge, summary_line

    try:
        settings = settings_from_args(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"otel-rl bridge: {exc}", file=sys.stderr)
        return 2
    for addr in (settings.http_address, settings.grpc_address):
        if addr is not None and not is_loopback(addr[0]):
            if settings.auth_token is None:
                _log.warning(
                    "otel-rl bridge: listening on %s without --auth-token-env: anyone who can reach it can "
                    "write to your trackers",
                    addr[0],
                )
            if not settings.tls_cert:
                _log.warning("otel-rl bridge: listening on %s without TLS (--tls-cert/--tls-key)", addr[0])
    stop = threading.Event()
    signals = {"n": 0}

    def on_signal(signum: int, frame: Any) -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            os.write(2, b"otel-rl bridge: second signal, exiting without delivering the rest\n")
            os._exit(130)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            bridge = Bridge(settings)
        except Exception as exc:  # unknown exporter, missing library, unusable tracker settings
            print(f"otel-rl bridge: cannot start: {exc}{_install_hint(exc)}", file=sys.stderr)
            return 2
        try:
            bridge.start()
        except Exception as exc:  # port in use, bad certificate, the gRPC receiver's package missing
            print(f"otel-rl bridge: cannot start: {exc}{_install_hint(exc)}", file=sys.stderr)
            bridge.stop(5.0)
            return 2
        _tune_gc()
        print(summary_line("ready", **bridge.addresses()), flush=True)
        _log.info("otel-rl bridge: ready (%s)", ", ".join(f"{k}={v}" for k, v in bridge.addresses().items() if v))
        while not stop.wait(0.5):
            pass
        _log.info("otel-rl bridge: stopping: no new requests; delivering what was received")
        summary = bridge.stop()
        lost = sum(q.get("dropped", 0) for q in summary["exporters"].values()) + summary["pipeline_dropped"]
        (_log.warning if lost else _log.info)("otel-rl bridge: stopped; %d items not delivered", lost)
        print(summary_line("stopped", **summary), flush=True)
        return 0
    finally:
        for s, h in previous.items():
            try:
                signal.signal(s, h)
            except (ValueError, TypeError):
                pass
