"""A burst of rollouts traced to MLflow: how many arrive, verl's own tracing against otel-rl's.

The same program runs twice, in a fresh process each time, once with verl's
``verl.utils.rollout_trace`` and once with ``otel_rl.compat.verl`` (the same three names, the
same arguments): ``RolloutTraceConfig.init(..., backend="mlflow")``, then N rollouts started at
once with ``asyncio.gather``, each a ``rollout_trace_attr(step, sample_index, rollout_n)`` block
around three ``@rollout_trace_op`` calls (generate, a tool call, generate), then the process
ends the way a trainer does (no explicit flush; otel-rl's exit budget is raised from its default
10 s to 1,800 s so that both wait for their stores). Each variant writes to its own MLflow sqlite
store; afterwards the traces and their spans are counted in it with MLflow's client.

::

    .venv/bin/python benchmarks/bench_burst.py                 # 1,500 rollouts, both variants
    .venv/bin/python benchmarks/bench_burst.py --rollouts 500 --repeats 3

Printed per variant and repeat: traces stored / rollouts, spans stored / spans made, the
program's wall time from the first rollout to its exit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OPS_PER_ROLLOUT = 3


def child(variant: str, rollouts: int) -> None:
    """The traced program: runs in its own process."""
    import asyncio

    if variant == "verl":
        from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op
    else:
        from otel_rl.compat.verl import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

    class Agent:
        @rollout_trace_op
        async def generate(self, prompt_ids: list[int], turn: int) -> dict:
            await asyncio.sleep(0)
            return {"response_ids": [t + turn for t in prompt_ids], "turn": turn}

        @rollout_trace_op
        async def call_tool(self, expression: str) -> str:
            await asyncio.sleep(0)
            return str(len(expression))

    agent = Agent()

    async def rollout(i: int) -> None:
        with rollout_trace_attr(sample_index=i, step=1, rollout_n=0, name="agent_loop"):
            out = await agent.generate(list(range(i % 7, i % 7 + 16)), 0)
            obs = await agent.call_tool(f"{i} + {len(out['response_ids'])}")
            await agent.generate([len(obs)] * 8, 1)

    async def main() -> None:
        await asyncio.gather(*(rollout(i) for i in range(rollouts)))

    RolloutTraceConfig.init("burst", f"burst-{variant}", backend="mlflow")
    t0 = time.perf_counter()
    asyncio.run(main())
    print(json.dumps({"emitted_s": time.perf_counter() - t0}), flush=True)


def count(uri: str) -> tuple[int, int]:
    """Traces and spans stored in the sqlite store (MLflow's client, every experiment)."""
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    traces = spans = 0
    for exp in client.search_experiments():
        token = None
        while True:
            page = client.search_traces(locations=[exp.experiment_id], max_results=500, page_token=token)
            for t in page:
                traces += 1
                spans += len(t.data.spans)
            token = page.token
            if not token:
                break
    return traces, spans


def run(variant: str, rollouts: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"burst-{variant}-") as d:
        uri = f"sqlite:///{d}/mlflow.db"
        env = dict(
            os.environ,
            MLFLOW_TRACKING_URI=uri,
            PYTHONPATH=os.pathsep.join(
                [str(ROOT), str(ROOT / "exporters" / "mlflow"), os.environ.get("PYTHONPATH", "")]
            ),
        )
        # verl's process waits at exit until MLflow's async trace queue is written; give otel-rl's
        # exit the same patience (its default budget is 10 s, then it spools what is left).
        env["OTEL_RL_SHUTDOWN_TIMEOUT_S"] = "1800"
        env["OTEL_RL_SPOOL_DIR"] = str(Path(d) / "spool")
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--rollouts", str(rollouts)],
            env=env,
            cwd=d,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{variant} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        emitted = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])["emitted_s"]
        traces, spans = count(uri)
    return {
        "variant": variant,
        "rollouts": rollouts,
        "traces": traces,
        "spans": spans,
        "spans_made": rollouts * (1 + OPS_PER_ROLLOUT),
        "emitted_s": emitted,
        "process_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", default="verl,otel-rl")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.rollouts)
        return
    print(f"load average {os.getloadavg()[0]:.1f}; {a.rollouts} rollouts x {1 + OPS_PER_ROLLOUT} spans")
    print(f"{'variant':<8} {'traces stored':>14} {'spans stored':>14} {'emit s':>7} {'process s':>9}")
    for _ in range(a.repeats):
        for v in a.variants.split(","):
            r = run(v, a.rollouts)
            print(
                f"{v:<8} {r['traces']:>7}/{r['rollouts']:<6} {r['spans']:>7}/{r['spans_made']:<6} "
                f"{r['emitted_s']:>7.2f} {r['process_s']:>9.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
