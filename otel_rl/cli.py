"""The ``otel-rl`` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import __version__
from .config import ConfigError, resolve
from .exporters import registry
from .redact import scrub_secrets

# Subcommands that live in their own modules: name -> (module, help). Each module has
# `add_arguments(parser)` and `run(args) -> int`; it is imported only when its command runs.
# The extra of the otel-rl distribution that installs what a subcommand needs.
EXTRAS: dict[str, str] = {"demo": "demo", "bridge": "bridge"}

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("otel_rl.demo.cli", "train a small agentic GRPO policy on CPU, fully instrumented"),
    "bridge": ("otel_rl.bridge.cli", "receive OTLP and deliver it to the tracker exporters"),
    "replay": ("otel_rl.spool.cli", "deliver what a spool directory still holds"),
    "doctor": ("otel_rl.doctor", "check the exporters' libraries, credentials, endpoints, paths and spool"),
    "report": ("otel_rl.report", "write one self-contained HTML page of a run's curves, trajectories and config"),
    "prune": (
        "otel_rl.prune",
        "delete old MLflow traces, delivered spool segments and old JSONL files (dry run first)",
    ),
}


def _available(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-rl", description="OpenTelemetry observability for RL training")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="cmd")
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        if _available(module):
            import importlib

            mod = importlib.import_module(module)
            mod.add_arguments(sub.add_parser(name, help=help_text))
            modules[name] = mod
    sub.add_parser("version", help="print the version")
    sub.add_parser("exporters", help="list the installed exporter names (those that cannot be used say why)")
    p_cfg = sub.add_parser("config", help="print the resolved configuration (arguments > config > env > defaults)")
    p_cfg.add_argument(
        "overrides", nargs="*", help="verl-style dotlist overrides, e.g. trainer.logger='[console,file]'"
    )
    args = parser.parse_args(argv)
    if args.cmd in modules:
        try:
            return int(modules[args.cmd].run(args) or 0)
        except ModuleNotFoundError as exc:  # a package the command needs is not installed: say which extra
            extra = EXTRAS.get(args.cmd)
            fix = f"pip install 'otel-rl[{extra}]'" if extra else f"pip install {exc.name or ''}".strip()
            print(f"otel-rl {args.cmd}: needs the package {exc.name!r}, which is not installed: {fix}", file=sys.stderr)
            return 2
    if args.cmd == "version":
        print(__version__)
        return 0
    if args.cmd == "exporters":
        for name in registry.installed_names():
            why = registry.unusable(name)
            print(name if why is None else f"{name}  (not usable: {why})")
        return 0
    if args.cmd == "config":
        try:
            cfg = resolve(args.overrides)
        except ConfigError as exc:
            print(f"otel-rl: {exc}", file=sys.stderr)
            return 2
        out = scrub_secrets(dataclasses.asdict(cfg))  # verl_config and e.g. otlp_headers
        print(json.dumps(out, indent=2, default=str))
        return 0
    parser.print_help()
    return 0


def program() -> None:
    """The ``otel-rl`` program (its console script, ``python -m otel_rl.cli``): `main`, then the exit.

    After ``otel-rl demo`` the process leaves without the interpreter's teardown of every module and
    object (torch's alone takes ~0.4 s; the demo's process ~0.75 s): by then its telemetry is delivered
    and its files closed; `otel_rl._exit.quick_exit` still waits for working threads, runs the exit
    handlers and flushes the standard streams."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["demo"]:
        from ._exit import quick_exit

        quick_exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    program()
