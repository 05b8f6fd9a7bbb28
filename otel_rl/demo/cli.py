"""``otel-rl demo``: train a small agentic GRPO policy on CPU, fully instrumented.

    otel-rl demo [--seed N] [--steps N] [--output-dir DIR] [--wandb] [--swanlab]
                 [--otlp-endpoint URL] [--prometheus-port PORT] [--quick] [overrides ...]

Overrides are verl-style dotlist items merged over `config.DEFAULT_CONFIG`, e.g.
``trainer.logger='["console","mlflow","file"]' actor_rollout_ref.rollout.n=4``.
See docs/demo.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

from otel_rl.redact import redact_text

from .config import DEFAULT_OUTPUT_DIR, build_config, get

#: a few seconds: what the tests and a first look use
QUICK = [
    "trainer.total_training_steps=6",
    "trainer.test_freq=3",
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "data.val_batch_size=16",
    "actor_rollout_ref.model.pretrain.steps=50",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train a tiny transformer with GRPO to answer arithmetic questions with a calculator "
        "tool (multi-turn agent loop), on CPU, with every otel-rl exporter available. Data goes "
        "to the console, a local MLflow store and a JSONL file by default (no server, no account)."
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="verl-style dotlist overrides, e.g. trainer.total_training_steps=20 "
        "actor_rollout_ref.rollout.n=4 'trainer.logger=[console,file]'",
    )
    parser.add_argument("--seed", type=int, default=None, help="trainer.seed (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="trainer.total_training_steps")
    parser.add_argument("--quick", action="store_true", help="a few-second run: " + " ".join(QUICK))
    parser.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        help=f"where the MLflow store, the JSONL file and offline tracker runs go (default {DEFAULT_OUTPUT_DIR})",
    )
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="also log to Weights & Biases (offline under the output dir unless WANDB_API_KEY is set)",
    )
    parser.add_argument(
        "--swanlab",
        action="store_true",
        help="also log to SwanLab (offline under the output dir unless SWANLAB_API_KEY is set)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="also send spans and metrics over OTLP to this endpoint (e.g. http://localhost:4318)",
    )
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve Prometheus metrics on this port during the run (0: a free port)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.add_argument(
        "--report-json",
        default=None,
        metavar="PATH",
        help="also write the run's timings, validation rewards and last metrics as JSON",
    )


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("["):
            from otel_rl.config import parse_value

            return _names(parse_value(s))
        return [p.strip() for p in s.split(",") if p.strip()]
    return [str(v).strip() for v in value]


def prepare(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str], str]:
    """The config given to `otel_rl.init` and the environment defaults to set (unset variables only)."""
    overrides = (QUICK if args.quick else []) + list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_training_steps={int(args.steps)}")
    cfg = build_config(overrides, seed=args.seed)
    out = os.path.abspath(os.path.expanduser(args.output_dir))
    trainer = cfg["trainer"]
    loggers = _names(trainer.get("logger"))
    for flag, name in (
        (args.wandb, "wandb"),
        (args.swanlab, "swanlab"),
        (args.otlp_endpoint, "otlp"),
        (args.prometheus_port is not None, "prometheus"),
    ):
        if flag and name not in loggers:
            loggers.append(name)
    trainer["logger"] = loggers
    ours = cfg.setdefault("otel_rl", {})
    if args.otlp_endpoint:
        ours["otlp_endpoint"] = args.otlp_endpoint
    if args.prometheus_port is not None:
        ours["prometheus_port"] = int(args.prometheus_port)
    used = set(loggers) | {get(cfg, "actor_rollout_ref.rollout.trace.backend") or ""}
    env: dict[str, str] = {}
    environ = os.environ
    if (
        {"file", "jsonl"} & used
        and not ours.get("jsonl_path")
        and not any(environ.get(v) for v in ("OTEL_RL_JSONL_PATH", "VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT"))
    ):
        ours["jsonl_path"] = os.path.join(out, trainer["project_name"], f"{trainer['experiment_name']}.jsonl")
    if (
        used & {"mlflow", "wandb", "tracking", "swanlab", "weave"}
        and "spool_dir" not in ours
        and not environ.get("OTEL_RL_SPOOL_DIR")
        and "spool_dir" in _config_fields()
    ):
        ours["spool_dir"] = os.path.join(out, "spool")  # where undelivered tracker data would wait
    if (
        used & {"mlflow", "wandb", "tracking", "swanlab"}
        and "export_process_cpus" not in ours
        and not environ.get("OTEL_RL_EXPORT_PROCESS_CPUS")
        and int(trainer.get("torch_threads") or 0) == 1
    ):
        # one training thread: the export process keeps to another CPU (benchmarks/results/2026-12-04-demo-cost.md)
        ours["export_process_cpus"] = "last"
    if "mlflow" in used and not environ.get("MLFLOW_TRACKING_URI"):
        env["MLFLOW_TRACKING_URI"] = "sqlite:///" + os.path.join(out, "mlruns.db")
        if not environ.get("OTEL_RL_MLFLOW_ARTIFACT_LOCATION"):
            # in a store of our own, artifacts go beside it (MLflow's default is ./mlruns)
            env["OTEL_RL_MLFLOW_ARTIFACT_LOCATION"] = os.path.join(out, "mlartifacts")
    if used & {"wandb", "tracking"}:
        if not environ.get("WANDB_API_KEY") and not environ.get("WANDB_MODE"):
            env["WANDB_MODE"] = "offline"
        if not environ.get("WANDB_DIR"):
            env["WANDB_DIR"] = out
    if "swanlab" in used:
        if not environ.get("SWANLAB_API_KEY") and not environ.get("SWANLAB_MODE"):
            env["SWANLAB_MODE"] = "offline"
        if not environ.get("SWANLAB_LOG_DIR"):
            env["SWANLAB_LOG_DIR"] = os.path.join(out, "swanlog")
    if not ours:
        del cfg["otel_rl"]
    return cfg, env, out


def _config_fields() -> set[str]:
    import dataclasses

    from otel_rl.config import Config

    return {f.name for f in dataclasses.fields(Config)}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args: argparse.Namespace) -> int:
    import otel_rl

    from .progress import Progress
    from .task import ArithTokenizer

    try:
        cfg, env, out = prepare(args)
    except (otel_rl.ConfigError, ValueError) as exc:
        print(f"otel-rl demo: {exc}", file=sys.stderr)
        return 2
    from otel_rl.exporters.registry import _importable

    if not _importable("torch"):  # checked before it is imported (below, after init): say what to install
        print(
            "otel-rl demo: the demo's policy needs torch, which is not installed: pip install 'otel-rl[demo]' "
            "(or a torch build for your machine, e.g. the CPU one: pip install torch "
            "--index-url https://download.pytorch.org/whl/cpu)",
            file=sys.stderr,
        )
        return 2
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    with _environment(env):
        try:
            handle = otel_rl.init(cfg, tokenizer=ArithTokenizer())
        except (otel_rl.ConfigError, otel_rl.UnknownExporterError) as exc:
            print(f"otel-rl demo: {exc}", file=sys.stderr)
            return 2
        # torch is imported only now: the export process starts its trackers (importing their libraries,
        # opening their runs: seconds of CPU time on another core) while this process imports torch and
        # builds the models rather than during the first training steps, and a short run waits less for
        # it at its end (benchmarks/results/2026-12-04-demo-cost.md)
        from .trainer import GRPOTrainer

        for e in handle.exporters:
            if e.name == "prometheus":
                print(f"otel-rl demo: Prometheus metrics at {_prometheus_url(e, cfg)}", file=sys.stderr, flush=True)
        progress = Progress(int(get(cfg, "trainer.total_training_steps", 0)), enabled=not args.no_progress)
        trainer = GRPOTrainer(cfg, on_step=progress.update)
        t1 = time.perf_counter()
        t2 = None
        cpu0 = _cpu_counters()
        try:
            with handle:
                try:
                    trainer.fit()
                finally:
                    progress.close()
                t2 = time.perf_counter()
                cpu1 = _cpu_counters()
        except KeyboardInterrupt:
            print("otel-rl demo: interrupted", file=sys.stderr)
            return 130
        t3 = time.perf_counter()
        timings = {"setup_s": t1 - t0, "train_s": t2 - t1, "flush_s": t3 - t2}
        training_cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
        summary = format_summary(cfg, handle, trainer, out, timings)
        print(summary, flush=True)
        report = write_report(cfg, handle)
    if report:
        print(f"  report (open in a browser): {report}", flush=True)
    if args.report_json:
        summary_json = {
            "config": cfg,
            "run_id": handle.run_id,
            "exporters": [e.name for e in handle.exporters],
            "steps": trainer.total_steps,
            "trajectories": trainer.trajectories,
            **timings,
            "training_cpu": training_cpu,
            "step_timings": trainer.step_timings,
            "val_history": trainer.val_history,
            "last_metrics": trainer.last_metrics,
            "num_params": trainer.num_params,
        }
        with open(args.report_json, "w", encoding="utf-8") as f:
            json.dump(summary_json, f, indent=1)
    return 0


def write_report(cfg: dict[str, Any], handle: Any) -> str | None:
    """The run's page of curves, trajectories and config (`otel-rl report`), beside its JSONL file; None when
    the run wrote no JSONL file or the page could not be written (said on stderr: the run itself is fine)."""
    jsonl = next((e.path for e in handle.exporters if e.name in ("file", "jsonl") and getattr(e, "path", None)), None)
    if not jsonl:
        return None
    try:
        from otel_rl.report import write_report as write
        from otel_rl.report.data import find_mlflow_run, mlflow_client

        run_id = None
        if any(e.name == "mlflow" for e in handle.exporters):
            run_id = find_mlflow_run(mlflow_client(), cfg["trainer"]["project_name"], handle.run_id)
        return write(jsonl, run_id)
    except Exception as exc:
        print(f"otel-rl demo: the report could not be written: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _cpu_counters() -> dict[str, float]:
    """CPU time of the training thread and of the whole process, and the process's context switches."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "main_thread_s": time.thread_time(),
        "process_s": time.process_time(),
        "voluntary_switches": ru.ru_nvcsw,
        "involuntary_switches": ru.ru_nivcsw,
    }


def _prometheus_url(exporter: Any, cfg: dict[str, Any]) -> str:
    url = getattr(exporter, "url", None)
    url = url() if callable(url) else url
    return str(url or f"port {get(cfg, 'otel_rl.prometheus_port', 9464)}")


def _command(name: str) -> str:
    """How to run the console script `name` of this installation as typed in this shell: its path next to
    the running interpreter (a virtual environment that is not activated is not on PATH), relative when
    it is under the working directory."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(here) and os.access(here, os.X_OK):
        rel = os.path.relpath(here)
        path = rel if not rel.startswith("..") else here
        return shlex.quote(path if os.sep in path else "./" + path)
    found = shutil.which(name)
    if found:
        return shlex.quote(found)
    module = {"otel-rl": "otel_rl.cli"}.get(name, name)
    return f"{shlex.quote(sys.executable)} -m {module}"


def _undelivered(handle: Any, name: str) -> int:
    """Items of exporter `name` that were not delivered by the end of the run (in its spool)."""
    try:
        stats = handle.stats()["exporters"].get(name) or {}
    except Exception:
        return 0
    return int(stats.get("queued", 0) or 0)


def mlflow_trace_hints() -> list[str]:
    """Where to find a step's traces in the MLflow UI and from Python (docs/demo.md)."""
    return [
        "    a step's traces in the UI: the experiment's Traces page, Filters (the funnel button): Field 'Tag', "
        "key 'step', '=', value '3', Apply filters",
        "      (the search box there looks in trace ids, inputs and outputs, not in tags; other tags: validate = True, "
        "sample_index = 0, rollout_n = 2)",
        "    python: mlflow.search_traces(locations=[experiment_id], filter_string=\"tags.step = '3'\")",
    ]


def format_summary(cfg: dict[str, Any], handle: Any, trainer: Any, out: str, timings: dict[str, float]) -> str:
    tr = cfg["trainer"]
    steps, t_train = trainer.total_steps, timings["train_s"]
    step0_s = getattr(trainer, "step0_s", 0.0)
    t_grpo = max(t_train - step0_s, 0.0)  # the GRPO steps alone: not the warm-up, not the first validation
    lines = [
        "",
        f"otel-rl demo: {steps} GRPO steps in {t_grpo:.1f} s ({steps / max(t_grpo, 1e-9):.2f} steps/s), "
        f"after a supervised warm-up of {getattr(trainer, 'warmup_s', 0.0):.1f} s and the validation before "
        f"training ({max(step0_s - getattr(trainer, 'warmup_s', 0.0), 0.0):.1f} s); "
        f"{trainer.trajectories:,} trajectories, a policy of {trainer.num_params:,} parameters; "
        f"setup {timings['setup_s']:.1f} s, telemetry flushed in {timings['flush_s']:.1f} s",
    ]
    hist = trainer.val_history
    if hist:
        (s0, r0), (s1, r1) = hist[0], hist[-1]
        lines.append(
            f"validation reward (val-core/arith/reward/mean@1): {r0:.3f} at step {s0} -> {r1:.3f} at step {s1}"
        )
    last = trainer.last_metrics
    if "tool_call_counts/mean" in last:
        lines.append(
            f"last step: reward {last.get('critic/score/mean', float('nan')):.3f}, "
            f"tool calls per trajectory {last['tool_call_counts/mean']:.2f}"
        )
    names = [e.name for e in handle.exporters]
    lines.append(
        f"run {tr['project_name']}/{tr['experiment_name']}, otel-rl run id {handle.run_id}; "
        f"exporters: {', '.join(names) or 'none (telemetry off)'}"
    )
    for e in handle.exporters:
        if e.name in ("file", "jsonl") and getattr(e, "path", None):
            lines.append(f"  metrics (JSONL, one line per log call): {os.path.abspath(e.path)}")
        elif e.name == "mlflow":
            uri = (
                os.environ.get("MLFLOW_TRACKING_URI") or getattr(e, "tracking_uri", None) or "sqlite:////tmp/mlruns.db"
            )
            waiting = _undelivered(handle, "mlflow")
            if waiting:
                spool = get(cfg, "otel_rl.spool_dir") or os.environ.get("OTEL_RL_SPOOL_DIR") or "the spool"
                lines.append(
                    f"  MLflow: {redact_text(uri)} could not be reached: {waiting:,} items were not delivered "
                    f"and wait in the spool {spool}"
                )
                lines.append(f"    deliver them once MLflow is up: {_command('otel-rl')} replay {shlex.quote(spool)}")
                continue
            lines.append(
                f"  MLflow: {redact_text(uri)}  experiment '{tr['project_name']}', run '{tr['experiment_name']}'"
            )
            if uri.startswith("sqlite:"):
                lines.append(f"    {_command('mlflow')} ui --backend-store-uri {shlex.quote(uri)}")
            lines.extend(mlflow_trace_hints())
        elif e.name in ("wandb", "tracking"):
            mode = os.environ.get("WANDB_MODE", "online")
            where = os.path.join(os.environ.get("WANDB_DIR", "."), "wandb")
            extra = f"; upload with: wandb sync {where}/offline-run-*" if mode == "offline" else ""
            lines.append(f"  wandb ({mode}): {where}{extra}")
        elif e.name == "swanlab":
            mode = os.environ.get("SWANLAB_MODE", "cloud")
            where = os.environ.get("SWANLAB_LOG_DIR", "swanlog")
            extra = f"; upload with: swanlab sync {where}/<run dir>" if mode == "offline" else ""
            lines.append(f"  swanlab ({mode}): {where}{extra}")
        elif e.name == "otlp":
            ep = get(cfg, "otel_rl.otlp_endpoint") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "default endpoint")
            lines.append(f"  OTLP: spans and metrics sent to {redact_text(ep)}")
        elif e.name == "prometheus":
            lines.append(
                f"  Prometheus: metrics were served at {_prometheus_url(e, cfg)} during the run "
                "(the endpoint closes with the run)"
            )
    return "\n".join(lines)
