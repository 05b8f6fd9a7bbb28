"""What the layout of trace ids does to storing traces in MLflow's sqlite store.

    .venv/bin/python benchmarks/bench_trace_ids.py            # ~1 min
    .venv/bin/python benchmarks/bench_trace_ids.py --rounds 8 --deliveries 20

The demo's trajectories (a few training steps run in process, 4 samples/step traced, captured in
memory) are made into the rows the MLflow exporter's direct writer stores (``otel_rl_mlflow.direct.traces``).
Those rows are then stored again and again under new trace ids, one delivery (~160 traces, the
demo's 5 steps of a 1 s export interval) per transaction, into a store that already holds
``--prefill`` traces, in two layouts:

  random       128 random bits (OpenTelemetry's default id generator)
  time-ordered the milliseconds since the epoch in the first 48 bits, 80 random bits after them
               (``otel_rl._lightspan.new_trace_id``, what otel-rl gives its traces)

MLflow's trace tables are indexed by trace id (trace_info, spans, trace_tags and their indexes):
random ids land each new trace on another page of each index; time-ordered ones at their end.
Rounds alternate the layouts, each on a fresh store; reported: the median time of a delivery's
transaction (inserts + commit) per layout and their ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporters" / "mlflow"))


def demo_trajectories(steps: int) -> list:
    import otel_rl
    from otel_rl.demo.config import build_config
    from otel_rl.demo.task import ArithTokenizer
    from otel_rl.demo.trainer import GRPOTrainer
    from otel_rl.testing import CaptureExporter

    cfg = build_config([f"trainer.total_training_steps={steps}", "trainer.logger=[]",
                        "actor_rollout_ref.rollout.trace.backend=memory", "trainer.val_before_train=false",
                        "actor_rollout_ref.model.pretrain.steps=20"], seed=0)
    cap = CaptureExporter()
    h = otel_rl.init(cfg, tokenizer=ArithTokenizer(), exporters=[cap], export_process=False)
    GRPOTrainer(cfg).fit()
    cap.collect()
    h.shutdown()
    return cap.trajectories()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per layout (alternating)")
    ap.add_argument("--deliveries", type=int, default=12, help="deliveries timed per round")
    ap.add_argument("--per-delivery", type=int, default=160, help="traces per delivery")
    ap.add_argument("--prefill", type=int, default=3000, help="traces in the store before the timed deliveries")
    args = ap.parse_args()

    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient
    from otel_rl_mlflow import _traces
    from otel_rl_mlflow.direct import traces as direct_traces

    trajs = demo_trajectories(4)
    builder = _traces.SpanBuilder()

    def new_store() -> tuple:
        d = tempfile.mkdtemp(prefix="bench_trace_ids_")
        client = MlflowClient(tracking_uri=f"sqlite:///{d}/mlruns.db")
        exp = client.create_experiment("e")
        run = client.create_run(exp).info.run_id
        writer = direct_traces.BulkTraceWriter.for_store(client._tracking_client.store)
        if writer is None:
            sys.exit("the direct trace writer does not apply to this MLflow")
        return writer, exp, run

    writer, exp, run = new_store()
    template = writer._rows(exp, run, [(_traces.mlflow_trace_id(t.trace_id), builder.spans(t)) for t in trajs])
    by_trace: dict[str, dict[str, list[dict]]] = {}
    for table, rows in template.tables.items():
        for r in rows:
            tid = r.get("request_id") or r.get("trace_id") or r.get("source_id")
            by_trace.setdefault(tid, {}).setdefault(table, []).append(r)
    shapes = list(by_trace.values())
    clock = [time.time_ns() // 1_000_000]

    def ids(layout: str, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if layout == "random":
                out.append("tr-%032x" % random.getrandbits(128))
            else:  # as new_trace_id lays them out, ~6 ms apart (a delivery spans ~1 s)
                clock[0] += 6
                out.append("tr-%032x" % (((clock[0] & 0xFFFF_FFFF_FFFF) << 80) | random.getrandbits(80)))
        return out

    def delivery(layout: str, n: int, exp_id: str, run_id: str):
        rows = direct_traces.Rows()
        for k, tid in enumerate(ids(layout, n)):
            for table, items in shapes[k % len(shapes)].items():
                for r in items:
                    r = dict(r)
                    for c in ("request_id", "trace_id", "source_id"):
                        if c in r:
                            r[c] = tid
                    if "experiment_id" in r:
                        r["experiment_id"] = int(exp_id)
                    if "destination_id" in r:
                        r["destination_id"] = run_id
                    if "association_id" in r:
                        r["association_id"] = "%032x" % random.getrandbits(128)
                    rows.tables[table].append(r)
        return rows

    times: dict[str, list[float]] = {"random": [], "time-ordered": []}
    for k in range(args.rounds * 2):
        layout = ("random", "time-ordered")[(k + k // 2) % 2]  # r, t, t, r, r, t, ...
        writer, exp, run = new_store()
        for i in range(0, args.prefill, 500):
            writer._write(delivery(layout, min(500, args.prefill - i), exp, run))
        for _ in range(args.deliveries):
            rows = delivery(layout, args.per_delivery, exp, run)
            t0 = time.perf_counter()
            writer._write(rows)
            times[layout].append(time.perf_counter() - t0)
        writer.close()
    r, t = statistics.median(times["random"]), statistics.median(times["time-ordered"])
    print(f"storing {args.per_delivery} demo traces per transaction into a store of {args.prefill}+ traces "
          f"({args.rounds} rounds x {args.deliveries} deliveries per layout)")
    print(f"{'trace ids':<16}{'ms per delivery (median)':>26}{'per trace (us)':>16}")
    print(f"{'random':<16}{r * 1e3:>26.1f}{r / args.per_delivery * 1e6:>16.0f}")
    print(f"{'time-ordered':<16}{t * 1e3:>26.1f}{t / args.per_delivery * 1e6:>16.0f}")
    print(f"time-ordered / random: {t / r:.2f}")


if __name__ == "__main__":
    main()
