"""Caller-side cost of otel-rl's core paths, measured against baselines in the same run.

    .venv/bin/python benchmarks/bench_core.py            # full run (~1-2 min)
    .venv/bin/python benchmarks/bench_core.py --quick    # smoke run (~15 s, noisier)
    .venv/bin/python benchmarks/bench_core.py --json out.json

See benchmarks/README.md for what every figure means.

Method.  Every figure is measured as `repeats` repeats; a repeat is `chunks`
timed chunks of `chunk` calls of each variant (ours and its baseline(s)), the
variants interleaved chunk by chunk with a rotating order, so a noisy neighbour
on a shared machine hits ours and the baseline alike.  A chunk is timed with
`time.perf_counter_ns` around the bare loop, gc disabled inside it.  Between
chunks, outside the timed region, the pipelines are flushed (`Handle.flush()`
for otel-rl, `TracerProvider.force_flush()` for the SDK baseline).  A traced
chunk stays below 512 items, the batch size at which both otel-rl's pipeline
worker and the SDK's BatchSpanProcessor wake up on their own, so the figure is
the cost paid on the caller's thread and not background work competing for the
GIL (that is reported separately as "worker" info lines).  The reported value
is the minimum over repeats of the per-call time (the median is printed too);
ratio = ours / baseline of those minima; "paired-median ratio" is the median
over repeats of ours/baseline within the same repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from opentelemetry import context as otel_context  # noqa: E402
from opentelemetry import trace as trace_api  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

import otel_rl  # noqa: E402
from otel_rl import _runtime  # noqa: E402

pc = time.perf_counter_ns


# ----------------------------------------------------------------------------- fixtures


class Null(otel_rl.Exporter):
    """Consumes spans and trajectories (so tracing is on) and discards them."""

    wants_spans = True
    wants_trajectories = True


class NullSpanExporter(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def plain_f(a, b):
    return {"sum": a + b, "a": a}


@otel_rl.op
def op_f(a, b):
    return {"sum": a + b, "a": a}


async def plain_af(a, b):
    return {"sum": a + b, "a": a}


@otel_rl.op
async def op_af(a, b):
    return {"sum": a + b, "a": a}


def verl_metrics() -> dict[str, Any]:
    """100 keys named the way verl's trainer names them; floats plus a few ints."""
    rnd = random.Random(0)
    keys: list[str] = []
    keys += [f"actor/{k}" for k in ("entropy", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "grad_norm",
                                    "lr", "kl_loss", "kl_coef")]
    keys += [f"critic/{k}" for k in ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr", "vf_explained_var")]
    for group in ("score", "rewards", "advantages", "returns", "values"):
        keys += [f"critic/{group}/{s}" for s in ("mean", "max", "min")]
    keys += [f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")]
    keys += [f"prompt_length/{s}" for s in ("mean", "max", "min", "clip_ratio")]
    keys += ["response/aborted_ratio"]
    timers = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "step",
              "testing", "save_checkpoint", "start_profile", "stop_profile")
    keys += [f"timing_s/{t}" for t in timers]
    keys += [f"timing_per_token_ms/{t}" for t in ("gen", "ref", "values", "adv", "update_critic", "update_actor")]
    keys += ["perf/time_per_step", "perf/throughput", "perf/mfu/actor", "perf/mfu/critic",
             "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb"]
    keys += [f"val-core/openai/gsm8k/reward/{s}" for s in ("mean@1", "mean@4", "best@4/mean", "best@4/std",
                                                            "maj@4/mean", "maj@4/std")]
    keys += [f"val-aux/openai/gsm8k/{m}/{s}" for m in ("acc", "format_score", "length")
             for s in ("mean@4", "std@4", "best@4/mean", "worst@4/mean")]
    keys += [f"actor/{k}" for k in ("pg_loss_std", "entropy_coeff", "loss_scale_factor", "clip_ratio_high",
                                    "clip_ratio_low", "dual_clip_frac")]
    int_keys = ["perf/total_num_tokens", "training/global_step", "training/epoch", "global_seqlen/min",
                "global_seqlen/max", "global_seqlen/minmax_diff", "global_seqlen/balanced_min",
                "global_seqlen/balanced_max", "global_seqlen/mean", "num_turns/max"]
    n_float = 100 - len(int_keys)
    extra = 0
    while len(keys) < n_float:
        keys.append(f"val-aux/openai/math/acc/mean@{1 << extra}")
        extra += 1
    keys = keys[:n_float]
    items: list[tuple[str, Any]] = [(k, rnd.uniform(-2.0, 2.0)) for k in keys]
    for i, k in enumerate(int_keys):  # ints spread among the floats, as in verl's dict
        items.insert(9 * i + 5, (k, rnd.randint(1, 1_000_000)))
    d = dict(items)
    assert len(d) == 100
    return d


# ----------------------------------------------------------------------------- timing


class Timed:
    """Per-call ns of each repeat for one measured variant."""

    def __init__(self, name: str):
        self.name = name
        self.per_call: list[float] = []

    @property
    def best(self) -> float:
        return min(self.per_call)

    @property
    def median(self) -> float:
        return statistics.median(self.per_call)


def run_chunk(body: Callable[[int], int], between: Callable[[], Any] | None, chunk: int) -> int:
    """One timed chunk of `chunk` calls (gc off inside), then the untimed `between` (a flush)."""
    gc.disable()
    try:
        ns = body(chunk)
    finally:
        gc.enable()
    if between is not None:
        between()
    return ns


def measure(variants: list[tuple[str, Callable[[int], int], Callable[[], Any] | None]], chunk: int, chunks: int,
            repeats: int) -> list[Timed]:
    """Warm up, then interleave the variants chunk by chunk (rotating which goes first).

    A repeat is `chunks` chunks of every variant; variant i's figure for the repeat is the sum of
    its timed chunks / calls.  Interleaving at chunk granularity (a few ms) means a noisy
    neighbour hits ours and the baseline alike.
    """
    results = [Timed(name) for name, _, _ in variants]
    for _, body, between in variants:  # warm-up: caches, lazy imports, first-seen types
        for _ in range(max(2, chunks // 4)):
            run_chunk(body, between, chunk)
    gc.collect()
    k = len(variants)
    for r in range(repeats):
        totals = [0] * k
        for c in range(chunks):
            for j in range(k):
                i = (j + c + r) % k
                _, body, between = variants[i]
                totals[i] += run_chunk(body, between, chunk)
        for i in range(k):
            results[i].per_call.append(totals[i] / (chunk * chunks))
    return results


# ----------------------------------------------------------------------------- report


FIGURES: list[dict[str, Any]] = []
INFO: list[dict[str, Any]] = []


def figure(name: str, ours: Timed, base: Timed | None, goal: str | None, *, overhead: bool = False,
           base_label: str = "") -> None:
    """Record a figure.  goal: 'ratio<=X' (ours/base), 'us<=X' (ours, or ours - base when `overhead`),
    or None (reported for context, no goal)."""
    o_us = ours.best / 1e3
    b_us = base.best / 1e3 if base is not None else None
    ratio = (ours.best / base.best) if base is not None and base.best > 0 else None
    value: float | None = None
    met: bool | None = None
    if goal is not None:
        kind, limit = goal.split("<=")
        if kind == "ratio":
            value = ratio
        elif overhead:
            value = o_us - b_us  # type: ignore[operator]
        else:
            value = o_us
        met = value is not None and value <= float(limit)
    paired = statistics.median(o / b for o, b in zip(ours.per_call, base.per_call)) if base is not None else None
    FIGURES.append({
        "figure": name, "ours_us": o_us, "baseline_us": b_us, "ratio": ratio, "paired_median_ratio": paired,
        "goal": goal, "value": value, "overhead_us": (o_us - b_us) if overhead else None,  # type: ignore[operator]
        "met": met, "baseline": base_label,
        "ours_median_us": ours.median / 1e3, "baseline_median_us": base.median / 1e3 if base is not None else None,
        "ours_repeats_us": [x / 1e3 for x in ours.per_call],
        "baseline_repeats_us": [x / 1e3 for x in base.per_call] if base is not None else None,
    })
    extra = f"  overhead {o_us - b_us:+.3f} us" if overhead else ""  # type: ignore[operator]
    if paired is not None and not overhead:
        extra += f"  paired-median ratio {paired:.2f}"
    med = f"(median {ours.median / 1e3:.3f}" + (f" / {base.median / 1e3:.3f})" if base is not None else ")")
    print(f"  {name:<50} ours {o_us:9.3f} us   base {b_us if b_us is not None else float('nan'):9.3f} us   "
          f"ratio {ratio if ratio is not None else float('nan'):6.2f}{extra}   {med}", flush=True)
    if base_label:
        print(f"  {'':<50} baseline: {base_label}", flush=True)


def info(name: str, value_us: float, note: str = "") -> None:
    INFO.append({"figure": name, "us": value_us, "note": note})
    print(f"  [info] {name:<57} {value_us:10.3f} us  {note}", flush=True)


def print_table() -> None:
    print()
    hdr = f"{'figure':<52} {'ours':>11} {'baseline':>11} {'ratio':>7} {'goal':>22} {'met?':>5}"
    print(hdr)
    print("-" * len(hdr))
    for f in FIGURES:
        ours = f"{f['ours_us']:.3f}us"
        base = f"{f['baseline_us']:.3f}us" if f["baseline_us"] is not None else "-"
        ratio = f"{f['ratio']:.2f}x" if f["ratio"] is not None else "-"
        goal = f["goal"]
        if goal is None:
            goal_s, met_s = "(context, no goal)", "-"
        else:
            limit = goal.split("<=")[1]
            if f["overhead_us"] is not None:
                goal_s = f"overhead {f['overhead_us']:.3f} <= {limit}us"
            elif goal.startswith("us"):
                goal_s = f"<= {limit} us"
            else:
                goal_s = f"<= {limit}x"
            met_s = "yes" if f["met"] else "NO"
        print(f"{f['figure']:<52} {ours:>11} {base:>11} {ratio:>7} {goal_s:>22} {met_s:>5}")
    print("-" * len(hdr))
    goals = [f for f in FIGURES if f["goal"] is not None]
    missed = [f["figure"] for f in goals if not f["met"]]
    print(f"{len(goals) - len(missed)}/{len(goals)} goals met" + (f"; missed: {'; '.join(missed)}" if missed else ""))


# ----------------------------------------------------------------------------- helpers


def start(**kw: Any) -> otel_rl.Handle:
    h = otel_rl.init(project="bench", experiment="bench", exporters=[Null()], **kw)
    assert _runtime.active.tracing, "tracing should be on"
    return h


def stop(h: otel_rl.Handle) -> None:
    check_memory(h)
    h.shutdown()
    assert _runtime.active.handle is None and not _runtime.active.tracing


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_memory(h: otel_rl.Handle) -> None:
    """The pipeline holds nothing between chunks (flush drained it): no unbounded growth."""
    h.flush()
    p = h._pipeline
    pending = len(p._builder._pending)
    queued = len(p._items)
    exp_q = sum(len(q._batches) for q in p.queues)
    assert pending == 0 and queued == 0 and exp_q == 0, \
        f"pipeline retains items: pending traces={pending} queued={queued} exporter batches={exp_q}"


def sdk_baseline() -> tuple[TracerProvider, Any]:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NullSpanExporter()))
    return provider, provider.get_tracer("bench")


# ----------------------------------------------------------------------------- sections


def section_op_sampled(cfg: dict) -> None:
    print("1. @op call in a sampled trajectory vs a bare SDK span", flush=True)
    h = start()
    provider, tracer = sdk_baseline()
    a, b = 3, 4

    def ours(n: int) -> int:
        with otel_rl.trajectory(step=1, sample_index=0, rollout_n=0) as t:
            assert t.sampled
            f = op_f
            t0 = pc()
            for _ in range(n):
                f(a, b)
            t1 = pc()
        return t1 - t0

    def base(n: int) -> int:  # exactly the brief's baseline: a root span (no parent)
        f = plain_f
        span = tracer.start_as_current_span
        t0 = pc()
        for _ in range(n):
            with span("f"):
                f(a, b)
        return pc() - t0

    def base_child(n: int) -> int:  # the same, nested in a parent span as our op is nested in its trajectory
        with tracer.start_as_current_span("parent"):
            f = plain_f
            span = tracer.start_as_current_span
            t0 = pc()
            for _ in range(n):
                with span("f"):
                    f(a, b)
            t1 = pc()
        return t1 - t0

    def base_same_job(n: int) -> int:
        # what otel-rl records, written by hand on the bare SDK: the same three attributes and
        # the same JSON of the arguments and the result (context only, not a goal)
        with tracer.start_as_current_span("parent"):
            f = plain_f
            start_span = tracer.start_span
            dumps = json.dumps
            attach, detach, set_in = otel_context.attach, otel_context.detach, trace_api.set_span_in_context
            t0 = pc()
            for _ in range(n):
                span = start_span("f", attributes={"rl.span.kind": "CHAIN",
                                                   "rl.op.inputs": dumps({"a": a, "b": b}, ensure_ascii=False)})
                token = attach(set_in(span))
                try:
                    r = f(a, b)
                    span.set_attribute("rl.op.output", dumps(r, ensure_ascii=False))
                finally:
                    detach(token)
                    span.end()
            t1 = pc()
        return t1 - t0

    o, bs, bc, bj = measure([("ours", ours, h.flush), ("sdk", base, provider.force_flush),
                             ("sdk-child", base_child, provider.force_flush),
                             ("sdk-same-job", base_same_job, provider.force_flush)],
                            cfg["chunk_traced"], cfg["chunks_traced"], cfg["repeats"])
    figure("op call in sampled traj. vs SDK root span", o, bs, "ratio<=1.3",
           base_label="with tracer.start_as_current_span('f'): f(a, b)  (root span, as in the brief)")
    figure("op call in sampled traj. vs SDK child span", o, bc, "ratio<=1.3",
           base_label="the same inside an SDK parent span (our op is inside its trajectory span)")
    figure("op call in sampled traj. vs SDK same job", o, bj, None,
           base_label="SDK child span + same 3 attributes + json.dumps of args and result, by hand")
    # the pipeline worker's share (runs off the caller's thread, but holds the GIL)
    n = cfg["chunk_traced"]
    with otel_rl.trajectory(step=1, sample_index=0, rollout_n=0):
        for _ in range(n):
            op_f(a, b)
    t0 = pc()
    h.flush()
    info("worker: op span -> record, per op (off-thread)", (pc() - t0) / n / 1e3, "flush time / ops")
    stop(h)
    provider.shutdown()


def section_trajectory(cfg: dict) -> None:
    print("2. trajectory() enter/exit, sampled, vs a bare SDK span", flush=True)
    h = start()
    provider, tracer = sdk_baseline()
    counter = [0]

    def ours(n: int) -> int:
        traj = otel_rl.trajectory
        i0 = counter[0]
        counter[0] += n
        t0 = pc()
        for i in range(i0, i0 + n):
            with traj(step=1, sample_index=i, rollout_n=0):
                pass
        return pc() - t0

    def base(n: int) -> int:
        span = tracer.start_as_current_span
        t0 = pc()
        for _ in range(n):
            with span("f"):
                pass
        return pc() - t0

    o, bs = measure([("ours", ours, h.flush), ("sdk", base, provider.force_flush)],
                    cfg["chunk_traced"], cfg["chunks_traced"], cfg["repeats"])
    figure("trajectory enter/exit, sampled (us/call)", o, bs, "ratio<=1.3",
           base_label="with tracer.start_as_current_span('f'): pass  (BatchSpanProcessor, discarding exporter)")
    n = cfg["chunk_traced"]
    for i in range(n):
        with otel_rl.trajectory(step=1, sample_index=i, rollout_n=0):
            pass
    t0 = pc()
    h.flush()
    info("worker: trajectory -> record, per trajectory (off-thread)", (pc() - t0) / n / 1e3, "flush time / trajs")
    stop(h)
    provider.shutdown()


def _plain_body(a: int, b: int) -> Callable[[int], int]:
    def plain(n: int) -> int:
        f = plain_f
        t0 = pc()
        for _ in range(n):
            f(a, b)
        return pc() - t0
    return plain


def section_disabled(cfg: dict) -> None:
    print("3. disabled / unsampled paths (overhead over a plain call)", flush=True)
    a, b = 3, 4
    chunk, chunks, repeats = cfg["chunk_fast"], cfg["chunks_fast"], cfg["repeats"]

    # 3a. no init at all
    assert _runtime.active.handle is None and not _runtime.active.tracing

    def op_noinit(n: int) -> int:
        f = op_f
        t0 = pc()
        for _ in range(n):
            f(a, b)
        return pc() - t0

    o, p = measure([("op", op_noinit, None), ("plain", _plain_body(a, b), None)], chunk, chunks, repeats)
    figure("op call, no init / tracing off", o, p, "us<=1", overhead=True, base_label="plain call")

    # 3b. inside trajectory(trace=False), tracing on
    h = start()

    def op_trace_false(n: int) -> int:
        with otel_rl.trajectory(step=1, sample_index=0, trace=False) as t:
            assert not t.sampled
            f = op_f
            t0 = pc()
            for _ in range(n):
                f(a, b)
            t1 = pc()
        return t1 - t0

    o, p = measure([("op", op_trace_false, None), ("plain", _plain_body(a, b), None)], chunk, chunks, repeats)
    figure("op call in trajectory(trace=False)", o, p, "us<=1", overhead=True, base_label="plain call")
    stop(h)

    # 3c. inside an unsampled trajectory
    h = start(max_samples=0, tracing=True)

    def op_unsampled(n: int) -> int:
        with otel_rl.trajectory(step=1, sample_index=0, rollout_n=0) as t:
            assert t.mode == 1  # UNSAMPLED
            f = op_f
            t0 = pc()
            for _ in range(n):
                f(a, b)
            t1 = pc()
        return t1 - t0

    o, p = measure([("op", op_unsampled, None), ("plain", _plain_body(a, b), None)], chunk, chunks, repeats)
    figure("op call in unsampled trajectory", o, p, "us<=1", overhead=True, base_label="plain call")

    # unsampled trajectory enter/exit itself (informational)
    def traj_unsampled(n: int) -> int:
        traj = otel_rl.trajectory
        t0 = pc()
        for i in range(n):
            with traj(step=1, sample_index=i, rollout_n=0):
                pass
        return pc() - t0

    t = measure([("traj", traj_unsampled, h.flush)], cfg["chunk_traced"], cfg["chunks_traced"], repeats)[0]
    info("unsampled trajectory enter/exit", t.best / 1e3, f"(median {t.median / 1e3:.3f})")

    # 3d. async op in an unsampled trajectory, awaited inside a running event loop
    loop = asyncio.new_event_loop()

    async def _await_loop(fn: Callable, n: int, in_traj: bool) -> int:
        if in_traj:
            with otel_rl.trajectory(step=1, sample_index=0, rollout_n=0) as t:
                assert t.mode == 1
                t0 = pc()
                for _ in range(n):
                    await fn(a, b)
                t1 = pc()
            return t1 - t0
        t0 = pc()
        for _ in range(n):
            await fn(a, b)
        return pc() - t0

    o, p = measure([("op", lambda n: loop.run_until_complete(_await_loop(op_af, n, True)), None),
                    ("plain", lambda n: loop.run_until_complete(_await_loop(plain_af, n, False)), None)],
                   chunk, chunks, repeats)
    figure("async op await in unsampled trajectory", o, p, "us<=1", overhead=True, base_label="plain coroutine")
    loop.close()
    stop(h)


def section_log(cfg: dict) -> None:
    print("4. log() of a 100-key verl-like metrics dict", flush=True)
    metrics = verl_metrics()
    tensors = {k: torch.tensor(float(v), dtype=torch.float32) for k, v in metrics.items()}
    np_metrics = {k: np.float64(v) for k, v in metrics.items()}
    h = start()
    chunk, chunks, repeats = cfg["chunk_log"], cfg["chunks_log"], cfg["repeats"]

    def log_body(d: dict) -> Callable[[int], int]:
        def body(n: int) -> int:
            log = otel_rl.log
            t0 = pc()
            for _ in range(n):
                log(d, step=1)
            return pc() - t0
        return body

    def json_body(n: int) -> int:
        dumps = json.dumps
        d = metrics
        t0 = pc()
        for _ in range(n):
            dumps(d)
        return pc() - t0

    def item_body(n: int) -> int:  # the naive alternative: one .item() (one device sync) per tensor
        d = tensors
        t0 = pc()
        for _ in range(n):
            {k: v.item() for k, v in d.items()}
        return pc() - t0

    def np_json_body(n: int) -> int:  # what a user would do by hand: float() each value, then serialise
        d = np_metrics
        dumps = json.dumps
        t0 = pc()
        for _ in range(n):
            dumps({k: float(v) for k, v in d.items()})
        return pc() - t0

    o, j = measure([("log", log_body(metrics), h.flush), ("json", json_body, None)], chunk, chunks, repeats)
    figure("log(100 floats/ints) (us/call)", o, j, "us<=50", base_label="json.dumps(dict)")
    o, j = measure([("log", log_body(np_metrics), h.flush), ("json", np_json_body, None)], chunk, chunks, repeats)
    figure("log(100 numpy float64) (us/call)", o, j, "us<=50", base_label="json.dumps({k: float(v)})")
    o, j = measure([("log", log_body(tensors), h.flush), ("item", item_body, None)], chunk, chunks, repeats)
    figure("log(100 torch 0-d tensors) (us/call)", o, j, None,
           base_label="{k: t.item()} (one device sync per tensor; on CPU .item() is cheap)")
    n = chunk
    for _ in range(n):
        otel_rl.log(metrics, step=1)
    t0 = pc()
    h.flush()
    info("worker: log item -> span, record, 100 gauges (off-thread)", (pc() - t0) / n / 1e3, "flush time / logs")
    stop(h)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke test; noisier)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--repeats", type=int, default=None, help="override the number of repeats (>= 5)")
    ap.add_argument("--only", default="1,2,3,4", help="comma-separated sections to run (default: all)")
    args = ap.parse_args(argv)

    if args.quick:
        cfg = dict(repeats=5, chunk_traced=400, chunks_traced=4, chunk_fast=20_000, chunks_fast=2,
                   chunk_log=200, chunks_log=3)
    else:
        cfg = dict(repeats=9, chunk_traced=400, chunks_traced=25, chunk_fast=100_000, chunks_fast=5,
                   chunk_log=200, chunks_log=10)
    if args.repeats:
        cfg["repeats"] = max(5, args.repeats)

    import logging

    logging.getLogger("otel_rl").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(f"otel-rl {otel_rl.__version__}  python {platform.python_version()}  {platform.machine()}  "
          f"cpus={os.cpu_count()}  torch {torch.__version__}  numpy {np.__version__}  "
          f"mode={'quick' if args.quick else 'full'}  repeats={cfg['repeats']}", flush=True)
    t_start = time.monotonic()
    sections = {"1": section_op_sampled, "2": section_trajectory, "3": section_disabled, "4": section_log}
    for key in args.only.split(","):
        sections[key.strip()](cfg)
        gc.collect()
        print(f"  [mem] rss after section {key.strip()}: {rss_mb():.1f} MB", flush=True)
    print_table()
    print(f"(µs = min over {cfg['repeats']} repeats; total wall {time.monotonic() - t_start:.1f}s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": cfg, "python": platform.python_version(), "cpus": os.cpu_count(),
                       "figures": FIGURES, "info": INFO}, fh, indent=2,
                      default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
