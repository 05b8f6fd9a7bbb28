"""Prometheus cardinality and scrape cost: otel-rl's endpoint vs a naive one-series-per-(key, step) exporter.

    .venv/bin/python benchmarks/bench_prometheus.py                    # 300 keys, 10 / 100 / 1000 steps
    .venv/bin/python benchmarks/bench_prometheus.py --keys 300 --steps 10 100 1000 --scrapes 5

For each number of steps, the same 300 verl-style keys (actor/*, critic/*, response_length/*, timing_s/*,
perf/*, val-core/* ...) are logged once per step:

- **otel-rl**: ``otel_rl.log(data, step)`` with ``exporters=["prometheus"]`` — the official OpenTelemetry
  Prometheus reader behind otel-rl's endpoint: one gauge per key (``rl_train_<key>``), labels = run identity,
  no step label;
- **naive**: ``prometheus_client`` directly, one ``Gauge`` per key with a ``step`` label (plus the same run
  identity labels), set for every step — what an exporter that keeps the step in Prometheus would serve.

Each endpoint is then scraped over HTTP on 127.0.0.1 ``--scrapes`` times. Reported: the number of series
(sample lines of the exposition), the scrape size in bytes, and the scrape time (median and min wall time of a
full GET, in ms). The otel-rl figure also contains its fixed instrument series (``target_info``, exporter
health). Expect otel-rl flat in the number of steps and the naive exporter linear in it.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROJECT, EXPERIMENT, RUN_ID = "bench", "grpo_prometheus", "0123456789abcdef"


def verl_keys(n: int) -> list[str]:
    """`n` distinct keys shaped like a verl PPO/GRPO run's (distinct Prometheus names too)."""
    stats = ("mean", "max", "min")
    base = [f"critic/{m}/{s}" for m in ("score", "rewards", "advantages", "returns", "values") for s in stats]
    base += [f"{m}/{s}" for m in ("response_length", "prompt_length", "num_turns", "tool_call_counts") for s in stats]
    base += ["response_length/clip_ratio", "prompt_length/clip_ratio"]
    base += [f"actor/{m}" for m in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "kl_coef",
                                    "entropy", "grad_norm", "lr")]
    base += [f"timing_s/{p}" for p in ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic",
                                       "update_actor", "testing", "step", "save_checkpoint")]
    base += [f"timing_per_token_ms/{p}" for p in ("gen", "ref", "adv", "update_actor")]
    base += [f"perf/{m}" for m in ("total_num_tokens", "time_per_step", "throughput", "max_memory_allocated_gb",
                                   "max_memory_reserved_gb", "cpu_memory_used_gb", "mfu/actor")]
    base += ["training/global_step", "training/epoch"]
    keys = list(dict.fromkeys(base))
    sources = ["gsm8k", "math", "aime24", "hotpotqa", "searchr1", "codecontests", "arith", "mbpp"]
    metrics = ["reward/mean@1", "reward/mean@4", "reward/best@4/mean", "reward/worst@4/mean", "acc/mean@1",
               "acc/maj@4/mean", "num_turns/mean", "response_length/mean"]
    i = 0
    while len(keys) < n:
        src, m = sources[i % len(sources)], metrics[(i // len(sources)) % len(metrics)]
        group = "val-core" if m.startswith("reward/mean") else "val-aux"
        extra = i // (len(sources) * len(metrics))
        keys.append(f"{group}/{src}{extra or ''}/{m}")
        i += 1
    keys = keys[:n]
    assert len(set(keys)) == n
    return keys


def scrape(url: str, times: int) -> tuple[int, int, list[float]]:
    """(series, bytes, [ms per scrape]) of `times` full GETs."""
    size = series = 0
    took = []
    for _ in range(times):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=300) as r:
            body = r.read()
        took.append((time.perf_counter() - t0) * 1000)
        size = len(body)
        series = sum(1 for ln in body.split(b"\n") if ln and not ln.startswith(b"#"))
    return series, size, took


def run_otel_rl(keys: list[str], steps: int, scrapes: int) -> dict:
    import otel_rl

    h = otel_rl.init(exporters=["prometheus"], prometheus_port=0, project=PROJECT, experiment=EXPERIMENT,
                     batch_delay_s=0.05)
    try:
        rng = random.Random(0)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            otel_rl.log({k: rng.random() for k in keys}, step=step)
            if step % 50 == 0:
                h.flush(60)
        h.flush(120)
        log_s = time.perf_counter() - t0
        p = h.exporters[0]
        series, size, took = scrape(p.url, scrapes)
        train = sum(1 for ln in urllib.request.urlopen(p.url).read().split(b"\n") if ln.startswith(b"rl_train_"))
        return {"series": series, "train_series": train, "bytes": size, "ms": took, "log_s": log_s}
    finally:
        h.shutdown(30)


def run_naive(keys: list[str], steps: int, scrapes: int) -> dict:
    import re

    from prometheus_client import CollectorRegistry, Gauge
    from prometheus_client.exposition import start_http_server

    registry = CollectorRegistry()
    labels = ["rl_project_name", "rl_experiment_name", "rl_run_id", "step"]
    gauges = [Gauge("naive_" + re.sub(r"[^A-Za-z0-9:]+", "_", k), f"log() key {k}", labels, registry=registry)
              for k in keys]
    rng = random.Random(0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        s = str(step)
        for g in gauges:
            g.labels(PROJECT, EXPERIMENT, RUN_ID, s).set(rng.random())
    log_s = time.perf_counter() - t0
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        series, size, took = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics", scrapes)
        return {"series": series, "train_series": series, "bytes": size, "ms": took, "log_s": log_s}
    finally:
        server.shutdown()
        server.server_close()
        del gauges, registry
        gc.collect()


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--scrapes", type=int, default=5, help="scrapes per endpoint (median and min reported)")
    args = ap.parse_args()
    for k in list(os.environ):
        if k.startswith("OTEL_") or k.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            del os.environ[k]
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1,localhost"
    keys = verl_keys(args.keys)
    print(f"# {args.keys} verl-style keys logged once per step; {args.scrapes} scrapes per endpoint on 127.0.0.1")
    print(f"# python {sys.version.split()[0]}, {os.cpu_count()} cpu(s)")
    header = (f"{'steps':>6}  {'exporter':<28} {'series':>9} {'log-key series':>14} {'scrape size':>12} "
              f"{'scrape ms (median)':>18} {'min':>8}")
    print(header)
    print("-" * len(header))
    for steps in args.steps:
        for name, fn in (("otel-rl (no step label)", run_otel_rl), ("naive (step label)", run_naive)):
            r = fn(keys, steps, args.scrapes)
            print(f"{steps:>6}  {name:<28} {r['series']:>9} {r['train_series']:>14} {fmt_bytes(r['bytes']):>12} "
                  f"{statistics.median(r['ms']):>18.1f} {min(r['ms']):>8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
