"""The local half of ``otel-rl doctor``: paths, disk space, ports, the spool an earlier run left, log levels."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import tempfile
from collections.abc import Mapping
from typing import Any

#: the probe written to a directory to prove it takes data (a few pages, then removed)
PROBE_BYTES = 64 * 1024


@dataclasses.dataclass
class Check:
    """One line of the doctor's output."""

    subject: str  # the exporter (or "spool", "log level")
    name: str  # what was checked
    status: str  # ok | warn | fail | info
    detail: str
    fix: str = ""


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


_WRITE_ERRORS = {
    errno.EROFS: ("the filesystem is mounted read-only", "choose a path on a writable filesystem"),
    errno.EACCES: ("no permission to write there", "fix the directory's owner or mode, or choose another path"),
    errno.EPERM: ("no permission to write there", "fix the directory's owner or mode, or choose another path"),
    errno.ENOSPC: ("the disk is full", "free space there, or choose another path"),
    errno.EDQUOT: ("the disk quota is used up", "free space in your quota, or choose another path"),
    errno.EFBIG: ("a file size limit (ulimit -f) stops writes", "raise the limit (ulimit -f unlimited)"),
}


def _write_probe(directory: str) -> OSError | None:
    try:
        fd, name = tempfile.mkstemp(prefix=".otel-rl-doctor-", dir=directory)
    except OSError as exc:
        return exc
    try:
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        except OSError as exc:
            return exc
        return None
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass


def check_path(subject: str, label: str, path: str, min_free: int, is_file: bool = False) -> list[Check]:
    """The directory of `path` exists or can be created, takes a write, and has `min_free` bytes free."""
    p = os.path.abspath(os.path.expanduser(path))
    d = os.path.dirname(p) if is_file else p
    existing = d
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        return [
            Check(
                subject,
                label,
                "fail",
                f"{p}: {existing} is a file, not a directory",
                "remove it or choose another path",
            )
        ]
    if is_file and os.path.isdir(p):
        return [Check(subject, label, "fail", f"{p} is a directory, not a file", "choose a file path")]
    err = _write_probe(existing)
    where = (
        f"{p} (exists)"
        if os.path.exists(p)
        else (f"{p} (directory exists)" if existing == d else f"{p} (will be created under {existing})")
    )
    out: list[Check] = []
    if err is not None:
        cause, fix = _WRITE_ERRORS.get(
            err.errno or 0, (f"cannot write there ({err.strerror or err})", "choose another path")
        )
        out.append(Check(subject, label, "fail", f"{where}: {cause}", fix))
    elif is_file and os.path.exists(p) and not os.access(p, os.W_OK):
        out.append(Check(subject, label, "fail", f"{p}: the file is not writable", "fix its mode or owner"))
    else:
        out.append(Check(subject, label, "ok", f"{where}: writable"))
    try:
        st = os.statvfs(existing)
        free = st.f_bavail * st.f_frsize
    except OSError as exc:
        out.append(Check(subject, "free space", "warn", f"cannot read free space of {existing}: {exc}"))
        return out
    if free < min_free:
        out.append(
            Check(
                subject,
                "free space",
                "fail",
                f"{human(free)} free on the filesystem of {existing} (less than {human(min_free)})",
                "free disk space, or choose a path on another disk",
            )
        )
    else:
        out.append(Check(subject, "free space", "ok", f"{human(free)} free at {existing}"))
    return out


def store_path(uri: str) -> str | None:
    """The local file or directory of an MLflow tracking URI (None: not local)."""
    if uri.startswith("sqlite:"):
        rest = uri[len("sqlite:") :]
        if rest.startswith("////"):
            return "/" + rest[4:].split("?", 1)[0]
        if rest.startswith("///"):
            return rest[3:].split("?", 1)[0]
        return None
    if uri.startswith("file:"):
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(uri).path)
    if "://" not in uri:
        return uri
    return None


def netrc_has(env: Mapping[str, str], host: str, path: str | None = None) -> bool:
    """A saved login for `host` in a netrc file (``wandb login`` and ``swanlab login`` write one)."""
    if not host:
        return False
    import netrc

    path = path or env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_port(subject: str, host: str, port: int) -> Check:
    """Can the exporter's server bind ``host:port``?"""
    if port == 0:
        return Check(subject, "port", "ok", f"{host}:0 (a free port is picked)")
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return Check(
                subject,
                "port",
                "warn",
                f"{host}:{port} is in use (a training still running, or another "
                "service): the exporter will not serve metrics",
                "stop the other process or set otel_rl.prometheus_port (OTEL_EXPORTER_PROMETHEUS_PORT)",
            )
        return Check(
            subject,
            "port",
            "fail",
            f"cannot bind {host}:{port} ({exc.strerror or exc})",
            "set otel_rl.prometheus_host to an address of this machine",
        )
    finally:
        s.close()
    return Check(subject, "port", "ok", f"{host}:{port} is free")


def check_spool(cfg: Any, min_free: int) -> list[Check]:
    """Where undelivered tracker data waits, and what an earlier run left there."""
    from ..spool import OFF_VALUES, default_root
    from ..spool.replay import find_spools, replay_one

    raw = cfg.spool_dir
    if isinstance(raw, str) and raw.strip().lower() in OFF_VALUES:
        return [
            Check(
                "spool",
                "directory",
                "warn",
                "spool_dir is off: what a tracker does not take while it is "
                "down is lost when the queue fills or the process ends",
                "unset OTEL_RL_SPOOL_DIR / spool_dir",
            )
        ]
    root = os.path.abspath(os.path.expanduser(raw)) if raw else default_root()
    out = check_path("spool", "directory", root, min_free)
    if not os.path.isdir(root):
        return out
    waiting = busy = 0
    dirs = []
    for path in find_spools([root]):
        r = replay_one(path, list_only=True)
        if r is None:
            continue
        if r.status == "busy":
            busy += 1
        elif r.pending_items:
            waiting += r.pending_items
            dirs.append(f"{os.path.relpath(path, root)} [{r.exporter}]: {r.pending_items}")
    if waiting:
        out.append(
            Check(
                "spool",
                "undelivered",
                "warn",
                f"{waiting} items an earlier run did not deliver "
                f"({'; '.join(dirs[:5])}{' ...' if len(dirs) > 5 else ''})",
                f"deliver them with `otel-rl replay {root}` (the tracker reachable)",
            )
        )
    else:
        out.append(Check("spool", "undelivered", "ok", f"nothing waiting under {root}"))
    if busy:
        out.append(Check("spool", "in use", "info", f"{busy} spool(s) held by a running trainer or bridge"))
    return out


#: variables that set a log level some part of a training reads
LEVEL_VARS = ("OTEL_LOG_LEVEL", "OTEL_PYTHON_LOG_LEVEL", "VERL_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")
_LEVELS = {"trace": 5, "debug": 10, "info": 20, "warn": 30, "warning": 30, "error": 40, "fatal": 50, "critical": 50}


def check_log_levels(env: Mapping[str, str]) -> list[Check]:
    """A level above WARNING hides what otel-rl says about spooled, retried and dropped data."""
    out = []
    for var in LEVEL_VARS:
        value = (env.get(var) or "").strip()
        if not value:
            continue
        level = _LEVELS.get(value.lower())
        if level is None and value.isdigit():
            level = int(value)
        if level is None:
            out.append(
                Check(
                    "log level",
                    var,
                    "warn",
                    f"{var}={value} is not a level name",
                    f"set {var}=WARNING (or INFO, DEBUG)",
                )
            )
        elif level > 30:
            out.append(
                Check(
                    "log level",
                    var,
                    "warn",
                    f"{var}={value}: warnings (delivery failures, spooled or dropped data) are hidden",
                    f"set {var}=WARNING or INFO while you investigate",
                )
            )
        else:
            out.append(Check("log level", var, "ok", f"{var}={value}"))
    if (env.get("WANDB_SILENT") or "").strip().lower() in ("1", "true", "yes"):
        out.append(
            Check(
                "log level",
                "WANDB_SILENT",
                "warn",
                "WANDB_SILENT is on: wandb's own errors are not printed",
                "unset WANDB_SILENT while you investigate",
            )
        )
    if not out:
        out.append(
            Check(
                "log level",
                "levels",
                "ok",
                "no variable raises a log level above WARNING: otel-rl's warnings are printed",
            )
        )
    return out


def load_config_file(path: str) -> Any:
    with open(os.path.expanduser(path), encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        return json.loads(text)
    try:
        import yaml
    except ImportError:
        raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or give a .json file") from None
    return yaml.safe_load(text) or {}
