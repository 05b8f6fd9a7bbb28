"""Ray workers join the driver's run and link their trajectories to the driver's step span.

Real Ray (a local cluster of 2 CPUs): the driver (this process) and every worker process export
over OTLP/HTTP to a receiver started here, so the spans of all processes are read back in one
place and checked: one run id everywhere, each process its own rank, every worker trajectory
carries the driver's step number and a span link to the driver's step span.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import otel_rl
from otel_rl import semconv as sc
from otel_rl.integrations import ray as otel_ray

pytestmark = pytest.mark.slow


class OtlpReceiver:
    """OTLP/HTTP: keeps every /v1/traces request body; answers /v1/metrics too."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self._pb = trace_service_pb2
        self.lock = threading.Lock()
        self.bodies: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    with receiver.lock:
                        receiver.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        out = []
        with self.lock:
            bodies = list(self.bodies)
        for b in bodies:
            req = self._pb.ExportTraceServiceRequest.FromString(b)
            for rs in req.resource_spans:
                res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((res, s) for s in ss.spans)
        return out

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    which = v.WhichOneof("value")
    return getattr(v, which) if which and which not in ("array_value", "kvlist_value") else None


def _attrs(span) -> dict:
    return {kv.key: _value(kv.value) for kv in span.attributes}


# ----------------------------------------------------------------------------- what runs in the workers


class RolloutWorker:
    """An agent-loop-like actor: init from the driver's environment, trajectories per sample."""

    def __init__(self):
        self.handle = otel_ray.init_worker()

    def identity(self):
        c = self.handle.config
        return {"run_id": c.run_id, "rank": c.rank, "project": c.project, "experiment": c.experiment,
                "pid": os.getpid()}

    @otel_rl.op(kind="LLM", name="generate")
    async def generate(self, prompt):
        await asyncio.sleep(0)
        return {"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "text": prompt.upper()}

    @otel_ray.propagated
    async def rollout(self, samples):
        async def one(i):
            with otel_rl.trajectory(sample_index=i, rollout_n=0, name="agent_loop") as t:
                out = await self.generate(f"q{i}")
                t.set_reward(len(out["text"]))
            return i

        done = await asyncio.gather(*(one(i) for i in samples))
        otel_rl.flush(20)
        return list(done)

    def shutdown(self):
        otel_rl.shutdown()
        return True


@otel_ray.propagated
def scoring_task(sample_index):
    otel_ray.init_worker(rank=9)
    with otel_rl.trajectory(sample_index=sample_index, name="score") as t:
        t.set_reward(1.0)
    h = otel_rl.current()
    ident = (h.config.run_id, h.config.rank, os.getpid())
    h.shutdown()  # the task's worker process may be reused or killed: deliver now
    return ident


# ----------------------------------------------------------------------------- the test


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "VERL_FILE_LOGGER")) or k in ("RANK", "LOCAL_RANK") or \
                k.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.chdir(tmp_path)
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def test_ray_actors_and_tasks_join_the_run_and_link_to_the_driver_step(clean_env):
    ray = pytest.importorskip("ray")
    import ray.cloudpickle

    # the worker code above is shipped by value: the workers cannot import this test module
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    receiver = OtlpReceiver()
    h = otel_rl.init(project="ray-proj", experiment="ray-exp", exporters=["otlp"], otlp_endpoint=receiver.url,
                     batch_delay_s=0.05, tracing=True, max_samples=None)
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        Worker = ray.remote(num_cpus=0.5)(RolloutWorker)
        # rank from the actor's name; rank from runtime_env(rank=...) (OTEL_RL_RANK)
        a = Worker.options(name="agent_loop_worker_5", runtime_env=otel_ray.runtime_env()).remote()
        b = Worker.options(**otel_ray.actor_options(rank=3)).remote()
        ids = ray.get([a.identity.remote(), b.identity.remote()], timeout=120)
        task = ray.remote(num_cpus=0.5)(scoring_task).options(runtime_env=otel_ray.runtime_env())
        with otel_rl.step(4) as st:
            with otel_rl.timer("gen"):
                ctx = otel_ray.inject()  # inside a timer: still the step span
                done = ray.get([a.rollout.remote([0, 1], otel_rl_context=ctx),
                                b.rollout.remote([2, 3], otel_rl_context=ctx),
                                task.remote(7, otel_rl_context=ctx)], timeout=120)
        step_ctx = st.span_context
        assert ray.get([a.shutdown.remote(), b.shutdown.remote()], timeout=60) == [True, True]
    finally:
        ray.shutdown()
    took = time.monotonic() - t0
    assert h.flush(20)
    h.shutdown()
    receiver.stop()

    assert done[0] == [0, 1] and done[1] == [2, 3]
    task_run_id, task_rank, task_pid = done[2]
    # run identity: one run id everywhere, the driver's project/experiment, each worker its own rank
    assert [i["run_id"] for i in ids] == [h.run_id, h.run_id] and task_run_id == h.run_id
    assert {(i["project"], i["experiment"]) for i in ids} == {("ray-proj", "ray-exp")}
    assert [i["rank"] for i in ids] == [5, 3] and task_rank == 9
    assert len({i["pid"] for i in ids} | {task_pid, os.getpid()}) == 4  # four processes

    spans = receiver.spans()
    assert {res[sc.RL_RUN_ID] for res, _ in spans} == {h.run_id}
    step_spans = [s for res, s in spans if s.name == sc.SPAN_STEP]
    assert len(step_spans) == 1 and int.from_bytes(step_spans[0].span_id, "big") == step_ctx.span_id

    roots = [(res, s) for res, s in spans if _attrs(s).get(sc.RL_SPAN_KIND) == sc.KIND_AGENT]
    by_sample = {_attrs(s)[sc.RL_SAMPLE_INDEX]: (res, s) for res, s in roots}
    assert sorted(by_sample) == [0, 1, 2, 3, 7]
    want_rank = {0: 5, 1: 5, 2: 3, 3: 3, 7: 9}
    for i, (res, s) in by_sample.items():
        a_ = _attrs(s)
        assert a_[sc.RL_STEP] == 4  # the driver's step number, not given to trajectory()
        assert res[sc.RL_WORKER_RANK] == want_rank[i] and res[sc.RL_RUN_ID] == h.run_id
        assert res[sc.RL_PROJECT_NAME] == "ray-proj" and res[sc.RL_EXPERIMENT_NAME] == "ray-exp"
        assert res["ray.worker.id"] and res["process.pid"] != os.getpid()
        # its own trace, linked to the driver's step span
        assert s.trace_id != step_spans[0].trace_id and not s.parent_span_id
        assert [(ln.trace_id, ln.span_id) for ln in s.links] == [(step_spans[0].trace_id, step_spans[0].span_id)]
    assert by_sample[0][0]["ray.actor.name"] == "agent_loop_worker_5"
    # the generate ops are children of their trajectories, in the worker processes
    gens = [s for _, s in spans if s.name == "generate"]
    assert len(gens) == 4
    root_ids = {(s.trace_id, s.span_id) for _, s in roots}
    assert all((g.trace_id, g.parent_span_id) in root_ids for g in gens)
    print(f"ray section took {took:.1f}s")


def test_step_context_without_ray():
    """inject/step_context round trip in one process (the carrier is plain W3C + the step)."""
    from otel_rl.testing import CaptureExporter

    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], tracing=True, batch_delay_s=0.05)
    try:
        with otel_rl.step(2) as st:
            carrier = otel_ray.inject()
        assert carrier[otel_ray.STEP_KEY] == "2" and carrier["traceparent"].split("-")[2] == f"{st.span_context.span_id:016x}"
        assert otel_rl.current_step() is None
        with otel_ray.step_context(carrier):
            assert otel_rl.current_step() == 2
            with otel_rl.trajectory(sample_index=1):
                pass
        assert otel_rl.current_step() is None
        with otel_ray.step_context(None):  # no carrier: nothing happens
            assert otel_rl.current_step() is None
        # outside any step: only the current span's context, no step number
        assert otel_ray.STEP_KEY not in otel_ray.inject()
        cap.collect()
        (t,) = cap.trajectories(sample_index=1)
        assert t.step == 2
    finally:
        h.shutdown()
