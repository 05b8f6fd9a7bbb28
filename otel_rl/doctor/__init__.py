"""``otel-rl doctor``: check, before a training starts, everything its telemetry will need.

The configuration is resolved exactly as `otel_rl.init` resolves it (dotlist overrides, the
``otel_rl:`` section, ``OTEL_*`` / ``OTEL_RL_*`` and the trackers' own variables).  For each
configured exporter and the trace backend: the library and its version, the credentials (which
variable, and whether it looks well-formed: never the value), the endpoint step by step through
the configured proxy, the local paths (exist or can be created, writable, free space); then the
spool an earlier run left undelivered, and the log levels.  One line per check: ``✓`` fine,
``!`` worth a look, ``✗`` will fail, each with its cause and fix.  Network checks run at once,
each step bounded by ``--timeout``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import Config
from . import local
from .checks import (  # noqa: F401 - the names the doctor and its tests use
    LIBRARIES,
    MLFLOW_SERVER_MIN,
    MLFLOW_SERVER_SPANS,
    OTLP_DISTS,
    SWANLAB_DEFAULT_URL,
    SYMBOLS,
    WANDB_DEFAULT_URL,
    WEAVE_DEFAULT_URL,
    Task,
    check_endpoint,
    check_key,
    check_library,
    dist_version,
    version_tuple,
)
from .local import Check
from .net import proxy_for, redact_url


def _mlflow(cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[Check]:
    out = check_library("mlflow", "mlflow", "otel-rl-mlflow")
    uri = env.get("MLFLOW_TRACKING_URI") or "sqlite:////tmp/mlruns.db"
    shown = redact_url(uri) if "://" in uri else uri
    if uri.startswith(("http://", "https://")):
        out.append(Check("mlflow", "tracking URI", "ok", f"MLFLOW_TRACKING_URI={shown}"))
        headers: dict[str, str] = {}
        token, user, pw = (
            env.get("MLFLOW_TRACKING_TOKEN"),
            env.get("MLFLOW_TRACKING_USERNAME"),
            env.get("MLFLOW_TRACKING_PASSWORD"),
        )
        if token:
            out.append(check_key("mlflow", "MLFLOW_TRACKING_TOKEN", env))
            headers["Authorization"] = f"Bearer {token.strip()}"
        elif user or pw:
            if not (user and pw):
                missing = "MLFLOW_TRACKING_PASSWORD" if user else "MLFLOW_TRACKING_USERNAME"
                out.append(
                    Check(
                        "mlflow",
                        "credentials",
                        "fail",
                        f"{missing} is not set (the other one is)",
                        f"export {missing}=...",
                    )
                )
            else:
                import base64

                headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
                out.append(Check("mlflow", "credentials", "ok", "MLFLOW_TRACKING_USERNAME and _PASSWORD are set"))
        proxy = proxy_for(uri, env=env)
        health, res = check_endpoint("mlflow", uri, path="/health", proxy=proxy, timeout=timeout, what="MLflow server")
        out.append(health)
        if not res.ok:
            return out
        ver, vres = check_endpoint(
            "mlflow", uri, path="/version", proxy=proxy, timeout=timeout, what="MLflow server", name="server version"
        )
        if vres.ok:
            out.append(_mlflow_server_version(vres.body.decode("utf-8", "replace").strip()))
        api, _ = check_endpoint(
            "mlflow",
            uri,
            path="/api/2.0/mlflow/experiments/search?max_results=1",
            proxy=proxy,
            timeout=timeout,
            what="MLflow server",
            headers=headers,
            name="API",
        )
        out.append(api)
        return out
    out.append(
        Check(
            "mlflow",
            "tracking URI",
            "ok" if env.get("MLFLOW_TRACKING_URI") else "warn",
            f"MLFLOW_TRACKING_URI={shown}"
            if env.get("MLFLOW_TRACKING_URI")
            else f"MLFLOW_TRACKING_URI is not set: runs go to {uri} (verl's default)",
            "" if env.get("MLFLOW_TRACKING_URI") else "export MLFLOW_TRACKING_URI=sqlite:////path/to/mlruns.db",
        )
    )
    path = local.store_path(uri)
    if path is not None:
        out += local.check_path("mlflow", "store", path, min_free, is_file=uri.startswith("sqlite:"))
    return out


def _mlflow_server_version(text: str) -> Check:
    v = version_tuple(text)
    client = dist_version("mlflow") or "?"
    if v and v < MLFLOW_SERVER_MIN:
        return Check(
            "mlflow",
            "server version",
            "fail",
            f"server runs MLflow {text}, the client {client}: the server has no trace API for this client",
            "upgrade the server to MLflow >= 3.0",
        )
    if v and v < MLFLOW_SERVER_SPANS:
        return Check(
            "mlflow",
            "server version",
            "warn",
            f"server runs MLflow {text}: no span ingestion before 3.4, traces are sent one by one (slower)",
            "upgrade the server to MLflow >= 3.4",
        )
    return Check("mlflow", "server version", "ok", f"server MLflow {text}, client {client}")


def _wandb_like(subject: str, cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[Check]:
    dist, plugin = LIBRARIES[subject]
    out = check_library(subject, dist, plugin)
    mode = (env.get("WANDB_MODE") or "").strip().lower()
    if subject != "weave" and mode in ("offline", "disabled", "dryrun"):
        out.append(Check(subject, "mode", "ok", f"WANDB_MODE={mode}: no network needed"))
        out += local.check_path(subject, "run dir", os.path.join(env.get("WANDB_DIR") or ".", "wandb"), min_free)
        return out
    stored = local.netrc_has(env, "api.wandb.ai") or local.netrc_has(env, _host(env.get("WANDB_BASE_URL") or ""))
    key = check_key(subject, "WANDB_API_KEY", env, min_len=40, stored=stored, stored_how="`wandb login`")
    out.append(key)
    base = (env.get("WANDB_BASE_URL") or WANDB_DEFAULT_URL).rstrip("/")
    trainer = cfg.verl_config.get("trainer") if isinstance(cfg.verl_config, Mapping) else None
    proxy = proxy_for(base, trainer.get("wandb_proxy") if isinstance(trainer, Mapping) else None, env)
    if subject == "weave":
        base = (env.get("WF_TRACE_SERVER_URL") or WEAVE_DEFAULT_URL).rstrip("/")
        check, _ = check_endpoint(subject, base, path="/health", proxy=proxy, timeout=timeout, what="Weave server")
        out.append(check)
        return out
    headers = {"Content-Type": "application/json"}
    api_key = (env.get("WANDB_API_KEY") or "").strip()
    if api_key:
        import base64

        headers["Authorization"] = "Basic " + base64.b64encode(f"api:{api_key}".encode()).decode()
    check, res = check_endpoint(
        subject,
        base,
        path="/graphql",
        method="POST",
        proxy=proxy,
        timeout=timeout,
        what="W&B server",
        headers=headers,
        body=b'{"query":"{ viewer { id } }"}',
        ok_codes=() if api_key else (401,),
    )
    if res.status == 401 and api_key:
        check.detail += " (WANDB_API_KEY was sent)"
    out.append(check)
    return out


def _swanlab(cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[Check]:
    out = check_library("swanlab", "swanlab", "otel-rl-swanlab")
    mode = (env.get("SWANLAB_MODE") or "").strip().lower()
    key_set = bool(env.get("SWANLAB_API_KEY"))
    stored = local.netrc_has(env, "api.swanlab.cn", os.path.join(os.path.expanduser("~"), ".swanlab", ".netrc"))
    if mode in ("offline", "local", "disabled") or (not mode and not key_set and not stored):
        why = f"SWANLAB_MODE={mode}" if mode else "no SWANLAB_API_KEY and no saved login: offline mode"
        out.append(
            Check(
                "swanlab",
                "mode",
                "ok" if mode else "warn",
                f"{why}; no network needed",
                "" if mode else "export SWANLAB_API_KEY=... for cloud runs, or SWANLAB_MODE=offline",
            )
        )
        out += local.check_path("swanlab", "log dir", env.get("SWANLAB_LOG_DIR") or "swanlog", min_free)
        return out
    out.append(check_key("swanlab", "SWANLAB_API_KEY", env, min_len=16, stored=stored, stored_how="`swanlab login`"))
    base = (env.get("SWANLAB_API_HOST") or SWANLAB_DEFAULT_URL).rstrip("/")
    check, _ = check_endpoint(
        "swanlab",
        base,
        proxy=proxy_for(base, env=env),
        timeout=timeout,
        what="SwanLab server",
        ok_codes=tuple(range(300, 500)),
    )
    out.append(check)
    return out


def _otlp(cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[Check]:
    from ..exporters.otlp import _protocol

    try:
        protocol = _protocol(cfg)
    except ValueError as exc:
        return [Check("otlp", "protocol", "fail", str(exc), "set otlp_protocol to grpc or http/protobuf")]
    out = check_library("otlp", OTLP_DISTS[protocol])
    raw = cfg.otlp_headers or env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS")
    headers: dict[str, str] = {}
    if raw:
        bad = [p for p in raw.split(",") if p.strip() and "=" not in p]
        for part in raw.split(","):
            k, sep, v = part.partition("=")
            if sep and k.strip():
                from urllib.parse import unquote

                headers[k.strip()] = unquote(v.strip())
        if bad:
            out.append(
                Check(
                    "otlp",
                    "headers",
                    "fail",
                    f"{len(bad)} header entr{'y' if len(bad) == 1 else 'ies'} without '=' (expected k=v,k2=v2)",
                    "write the headers as key=value,key2=value2",
                )
            )
        else:
            out.append(Check("otlp", "headers", "ok", f"headers set: {', '.join(sorted(headers))} (values not shown)"))
    default = "http://localhost:4317" if protocol == "grpc" else "http://localhost:4318"
    endpoint = (
        cfg.otlp_endpoint
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or default
    )
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    if endpoint.endswith("/v1/traces"):
        endpoint = endpoint[: -len("/v1/traces")]
    proxy = proxy_for(endpoint, env=env)
    if protocol == "grpc":
        import urllib.parse

        from .net import _connect

        p = urllib.parse.urlsplit(endpoint)
        s, _, cause, fix = _connect(p.hostname or "localhost", p.port or 4317, timeout, "OTLP receiver")
        if s is None:
            out.append(Check("otlp", "endpoint", "fail", f"endpoint {redact_url(endpoint)} (gRPC): {cause}", fix))
        else:
            s.close()
            out.append(Check("otlp", "endpoint", "ok", f"endpoint {redact_url(endpoint)} (gRPC): TCP connected"))
        return out
    health, hres = check_endpoint(
        "otlp", endpoint, path="/healthz", proxy=proxy, timeout=timeout, what="OTLP receiver", name="bridge /healthz"
    )
    if hres.stage in ("dns", "tcp", "proxy", "tls", "url") or (hres.stage == "http" and hres.status is None):
        out.append(Check("otlp", "endpoint", "fail", health.detail, health.fix))
        return out
    if hres.ok and b'"ok"' in hres.body:
        out.append(Check("otlp", "bridge", "ok", f"otel-rl bridge at {redact_url(endpoint)}: /healthz ok"))
    else:
        out.append(
            Check(
                "otlp",
                "bridge",
                "info",
                f"{redact_url(endpoint)} is not an otel-rl bridge "
                f"(/healthz: HTTP {hres.status}); an OpenTelemetry Collector or another receiver",
            )
        )
    send, sres = check_endpoint(
        "otlp",
        endpoint,
        path="/v1/traces",
        method="POST",
        body=b"",
        proxy=proxy,
        timeout=timeout,
        what="OTLP receiver",
        headers={"Content-Type": "application/x-protobuf", **headers},
        name="export",
    )
    if sres.status in (401, 403):
        send.detail += (" (headers sent: " + ", ".join(sorted(headers)) + ")") if headers else " (no headers sent)"
        send.fix = (
            "set the token in otlp_headers / OTEL_EXPORTER_OTLP_HEADERS as "
            "'Authorization=Bearer <token>' (the bridge's --auth-token-env value)"
        )
    out.append(send)
    return out


def _prometheus(cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[Check]:
    out = check_library("prometheus", "opentelemetry-exporter-prometheus")
    out.append(local.check_port("prometheus", cfg.prometheus_host, cfg.prometheus_port))
    return out


def _jsonl(cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[Check]:
    from ..exporters.jsonl import resolve_path

    return local.check_path("file", "JSONL file", resolve_path(cfg), min_free, is_file=True)


EXPORTER_CHECKS: dict[str, Callable[..., list[Check]]] = {
    "mlflow": _mlflow,
    "wandb": lambda *a: _wandb_like("wandb", *a),
    "tracking": lambda *a: _wandb_like("tracking", *a),
    "weave": lambda *a: _wandb_like("weave", *a),
    "swanlab": _swanlab,
    "otlp": _otlp,
    "prometheus": _prometheus,
    "file": _jsonl,
    "jsonl": _jsonl,
}


def _host(url: str) -> str:
    import urllib.parse

    try:
        return urllib.parse.urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _exporter_checks(
    fn: Callable[..., list[Check]], role: str, cfg: Config, env: Mapping[str, str], timeout: float, min_free: int
) -> list[Check]:
    """An exporter's checks, their subject marked with its `role` (" (trace backend)" or "")."""
    return [dataclasses.replace(c, subject=c.subject + role) for c in fn(cfg, env, timeout, min_free)]


def _unknown(name: str) -> list[Check]:
    from ..exporters.registry import UnknownExporterError, resolve_factory

    try:
        resolve_factory(name)
    except UnknownExporterError as exc:
        return [
            Check(
                name,
                "exporter",
                "fail",
                str(exc).split(" Installed", 1)[0],
                "correct trainer.logger or install the exporter",
            )
        ]
    except Exception as exc:
        return [Check(name, "exporter", "fail", f"cannot load: {type(exc).__name__}: {exc}", "reinstall it")]
    return [Check(name, "exporter", "ok", "installed (a plug-in: nothing more to check)")]


def tasks(cfg: Config, env: Mapping[str, str], timeout: float, min_free: int) -> list[tuple[str, Task]]:
    """(subject, task) per subject, in the order the lines are printed."""
    out: list[tuple[str, Task]] = []
    if cfg.disabled:
        out.append(
            (
                "otel-rl",
                lambda: [
                    Check(
                        "otel-rl",
                        "enabled",
                        "warn",
                        "telemetry is disabled (OTEL_SDK_DISABLED=true or otel_rl.disabled)",
                        "unset it to record anything",
                    )
                ],
            )
        )
    for name in cfg.exporter_names():
        fn = EXPORTER_CHECKS.get(name)
        if name in ("console", "memory"):
            continue
        role = " (trace backend)" if name == cfg.trace_backend and name not in cfg.exporters else ""
        if fn is None:
            out.append((name, functools.partial(_unknown, name)))
        else:
            out.append((name + role, functools.partial(_exporter_checks, fn, role, cfg, env, timeout, min_free)))
    out.append(("spool", lambda: local.check_spool(cfg, min_free)))
    out.append(("log level", lambda: local.check_log_levels(env)))
    return out


def time_bound(timeout: float) -> float:
    """Seconds all checks get together: a subject's steps stop at its first failure, so with every endpoint
    dead the checks end after about one `timeout`; a service that answers slowly step after step is cut
    off here (8 s at the default timeout of 3 s)."""
    return 2 * timeout + 2.0


def run_checks(
    cfg: Config, env: Mapping[str, str] | None = None, timeout: float = 3.0, min_free: int = 1 << 30
) -> list[Check]:
    """All checks, each subject in a thread of its own; the lines come back in a fixed order.

    The threads are daemon threads: a check still running at `time_bound` is a failed line of its subject,
    and the process does not wait for it when it ends."""
    env = os.environ if env is None else env
    jobs = tasks(cfg, env, timeout, min_free)
    bound = time_bound(timeout)
    deadline = time.monotonic() + bound
    results: list[list[Check] | BaseException | None] = [None] * len(jobs)
    threads = []
    for i, (_, job) in enumerate(jobs):

        def work(i: int = i, job: Task = job) -> None:
            try:
                results[i] = job()
            except Exception as exc:  # a check's own bug is a line, not a crash
                results[i] = exc

        t = threading.Thread(target=work, name="otel-rl-doctor", daemon=True)
        t.start()
        threads.append(t)
    out: list[Check] = []
    for (subject, _), t, i in zip(jobs, threads, range(len(jobs))):
        t.join(max(0.0, deadline - time.monotonic()))
        got = results[i]
        if t.is_alive():
            out.append(
                Check(
                    subject,
                    "time",
                    "fail",
                    f"the checks did not finish within {bound:g} s: an endpoint answers, but too slowly "
                    "(or trickles its answer)",
                    f"check the service's health; run again with a larger --timeout (now {timeout:g} s)",
                )
            )
        elif isinstance(got, BaseException):
            out.append(Check(subject, "internal", "fail", f"{type(got).__name__}: {got}", "report this"))
        else:
            out += got or []
    return out


def format_line(c: Check) -> str:
    line = f"{SYMBOLS[c.status]} {c.subject}: {c.name}: {c.detail}"
    if c.fix and c.status in ("fail", "warn"):
        line += f"\n    fix: {c.fix}"
    return line


def add_arguments(parser: Any) -> None:
    parser.description = __doc__.split("\n\n", 1)[1].replace("\n", " ") if __doc__ else None
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="the trainer's verl-style overrides, e.g. 'trainer.logger=[console,wandb,mlflow]'",
    )
    parser.add_argument("--config", default=None, metavar="YAML", help="the trainer's config file (YAML or JSON)")
    parser.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds allowed to each network step (DNS, TCP, TLS, HTTP; default 3); all checks: at most 2*S+2 s",
    )
    parser.add_argument(
        "--min-free", default="1GiB", metavar="SIZE", help="free disk space below this is a failure (default 1GiB)"
    )


def run(args: Any) -> int:
    from ..config import ConfigError, _as_size, resolve

    try:
        base = local.load_config_file(args.config) if args.config else None
        cfg = resolve(base, list(args.overrides))
        min_free = _as_size("--min-free", args.min_free)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"otel-rl doctor: {exc}", file=sys.stderr)
        return 2
    checks = run_checks(cfg, timeout=max(0.1, args.timeout), min_free=min_free)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not failed,
                    "exporters": cfg.exporter_names(),
                    "checks": [dataclasses.asdict(c) for c in checks],
                },
                indent=1,
            )
        )
    else:
        print(
            f"otel-rl doctor: exporters {', '.join(cfg.exporter_names()) or 'none'}"
            + (f"; trace backend {cfg.trace_backend}" if cfg.trace_backend else "")
        )
        for c in checks:
            print(format_line(c))
        n_fail = sum(c.status == "fail" for c in checks)
        n_warn = sum(c.status == "warn" for c in checks)
        print(f"{len(checks)} checks: {n_fail} failed, {n_warn} to look at" if checks else "nothing to check")
    return 1 if failed else 0
