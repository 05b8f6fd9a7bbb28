"""A trainer for the crash tests (run as a subprocess; killed with SIGKILL by the test).

Each step: a sampled trajectory (one LLM span), one `log()` of 6 keys, one validation generation
row; then `flush()`.  It prints one JSON line per step: ``{"event": "ack", "step": n}`` when, after
the flush, nothing of that step or before it is only in memory (delivered, or written and
fsynced to the spool: acknowledged), ``"noack"`` otherwise.

Environment: ``PHASE1_STEPS`` steps are flushed until delivered (the tracker is up), then it prints
``{"event": "phase1"}`` and waits for ``$CRASH_DIR/go`` (the test takes the tracker down), then goes
on with short flushes until ``LAST_STEP``.  ``FIRST_STEP``, ``PROJECT``, ``OTEL_RL_RUN_ID``,
``OTEL_RL_SPOOL_DIR``, ``MLFLOW_TRACKING_URI``, ``SPOOL_TEST_SINK`` come from the test.
"""

from __future__ import annotations

import json
import os
import time

import otel_rl
from spool_helpers import AppendLogExporter

ctl = os.environ["CRASH_DIR"]
first = int(os.environ.get("FIRST_STEP", "1"))
last = int(os.environ.get("LAST_STEP", "100000"))
phase1 = int(os.environ.get("PHASE1_STEPS", "1000000"))
flush_s = float(os.environ.get("FLUSH_S", "0.3"))


@otel_rl.generate(model="policy")
def generate(prompt_ids: list) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": [7, 8], "text": "ok"}


def one_step(n: int) -> None:
    with otel_rl.step(n):
        with otel_rl.trajectory(sample_index=0):
            generate([1, 2, n])
        otel_rl.log({"n": n, **{f"k/{i}": n + i / 100 for i in range(5)}}, step=n)
    otel_rl.log_generations([(f"p{n}", f"o{n}", 1.0)], step=n)


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


h = otel_rl.init(project=os.environ["PROJECT"], experiment="crash", exporters=["mlflow", AppendLogExporter()],
                 trace_backend="mlflow", batch_delay_s=0.05)
emit(event="started", run_id=h.run_id, pid=os.getpid())
for n in range(first, last + 1):
    if n == first + phase1:
        emit(event="phase1", step=n - 1)
        while not os.path.exists(os.path.join(ctl, "go")):
            time.sleep(0.02)
    one_step(n)
    ok = h.flush(60.0 if n < first + phase1 else flush_s)
    stats = h.stats()["exporters"]
    acked = all(s["in_memory"] == 0 for s in stats.values())
    emit(event="ack" if acked else "noack", step=n, delivered=ok,
         spooled={k: s["spool_pending"] for k, s in stats.items()})
h.shutdown(60)
emit(event="done", stats=h.stats()["exporters"])
