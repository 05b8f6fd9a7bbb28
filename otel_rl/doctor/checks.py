"""The building blocks of ``otel-rl doctor``'s checks: a library's version, a credential's shape, an
endpoint reached step by step through the configured proxy."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Mapping
from typing import Any

from .local import Check
from .net import probe

SYMBOLS = {"ok": "✓", "warn": "!", "fail": "✗", "info": "·"}

#: exporter name -> (tracker library's distribution, otel-rl plug-in distribution)
LIBRARIES: dict[str, tuple[str, str]] = {
    "mlflow": ("mlflow", "otel-rl-mlflow"),
    "wandb": ("wandb", "otel-rl-wandb"),
    "tracking": ("wandb", "otel-rl-wandb"),
    "swanlab": ("swanlab", "otel-rl-swanlab"),
    "weave": ("weave", "otel-rl-weave"),
}
OTLP_DISTS = {
    "grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "http/protobuf": "opentelemetry-exporter-otlp-proto-http",
}
WANDB_DEFAULT_URL = "https://api.wandb.ai"
SWANLAB_DEFAULT_URL = "https://api.swanlab.cn"
WEAVE_DEFAULT_URL = "https://trace.wandb.ai"
#: MLflow servers before 3.0 have no trace API for a 3.x client; before 3.4 no span ingestion
MLFLOW_SERVER_MIN = (3, 0)
MLFLOW_SERVER_SPANS = (3, 4)
_KEY_CHARS = re.compile(r"^[A-Za-z0-9_\-.:]+$")
Task = Callable[[], list[Check]]


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def check_library(subject: str, dist: str, plugin: str | None = None) -> list[Check]:
    """The tracker library and otel-rl's plug-in are installed, at versions the plug-in accepts."""
    from ..exporters.registry import KNOWN_MISSING

    hint = KNOWN_MISSING.get(subject, f"pip install {dist}")
    out = []
    if plugin is not None and dist_version(plugin) is None:
        out.append(Check(subject, "plug-in", "fail", f"{plugin} is not installed", f"run `{hint}`"))
    have = dist_version(dist)
    if have is None:
        out.append(Check(subject, "library", "fail", f"{dist} is not installed", f"run `{hint}`"))
        return out
    wanted = _requirement(plugin, dist) if plugin else None
    if wanted is not None:
        try:
            from packaging.specifiers import SpecifierSet

            if not SpecifierSet(wanted).contains(have, prereleases=True):
                out.append(
                    Check(
                        subject,
                        "library",
                        "fail",
                        f"{dist} {have} installed; {plugin} needs {dist}{wanted}",
                        f"run `pip install '{dist}{wanted}'`",
                    )
                )
                return out
        except Exception:
            pass
    out.append(Check(subject, "library", "ok", f"{dist} {have}" + (f" (needs {wanted})" if wanted else "")))
    return out


def _requirement(plugin: str, dist: str) -> str | None:
    try:
        reqs = importlib.metadata.requires(plugin) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for r in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*([^;]*)", r)
        if m and m.group(1).lower() == dist and m.group(2).strip() and ";" not in r:
            return m.group(2).strip()
    return None


def check_key(
    subject: str,
    var: str,
    env: Mapping[str, str],
    *,
    min_len: int = 1,
    required: bool = True,
    stored: bool = False,
    stored_how: str = "",
) -> Check:
    """Is the credential `var` set and well-formed?  The value is never shown."""
    value = env.get(var)
    if value is None or value == "":
        if stored:
            return Check(subject, "credentials", "ok", f"{var} not set; a saved login ({stored_how}) is used")
        return Check(
            subject,
            "credentials",
            "fail" if required else "warn",
            f"{var} is not set",
            f"export {var}=<your key>" + (f" (or {stored_how})" if stored_how else ""),
        )
    problems = []
    if value != value.strip():
        problems.append("has leading or trailing whitespace")
    if value.strip()[:1] in "'\"" or value.strip()[-1:] in "'\"":
        problems.append("is wrapped in quotes")
    if "<" in value or value.strip().lower() in ("your_key", "your-api-key", "changeme", "xxx"):
        problems.append("is a placeholder")
    elif not _KEY_CHARS.match(value.strip().strip("'\"")):
        problems.append("has characters keys do not have")
    if len(value.strip()) < min_len:
        problems.append(f"is {len(value.strip())} characters long (keys have at least {min_len})")
    if problems:
        return Check(
            subject,
            "credentials",
            "fail",
            f"{var} is set but {' and '.join(problems)}",
            f"copy the key again into {var}",
        )
    return Check(subject, "credentials", "ok", f"{var} is set ({len(value)} characters, looks well-formed)")


def check_endpoint(
    subject: str,
    url: str,
    *,
    path: str = "",
    proxy: str | None = None,
    timeout: float,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    body: bytes | None = None,
    what: str = "server",
    ok_codes: tuple[int, ...] = (),
    name: str = "endpoint",
) -> tuple[Check, Any]:
    res = probe(url, method=method, path=path, headers=headers, body=body, proxy=proxy, timeout=timeout, what=what)
    label = f"{res.url}{path}" + (f" via proxy {res.via}" if res.via else "")
    if res.ok or (res.status in ok_codes):
        return Check(subject, name, "ok", f"{label}: HTTP {res.status} in {res.seconds:.2f} s"), res
    return Check(subject, name, "fail", f"{label}: {res.cause}", res.fix), res


# ----------------------------------------------------------------------------- per exporter
