"""Weave exporter: trajectories -> Weave calls, read back from Weave's own write-ahead log.

No Weave service here.  Two set-ups:

- in process: a `WeaveClient` built directly on a `RemoteHTTPTraceServer` pointed at a closed
  port, registered as the global client (as `weave.init` would), with the write-ahead log on
  and its sender off (``WEAVE_ENABLE_WAL``, ``WEAVE_DISABLE_WAL_SENDER``) under a temporary
  ``$HOME``.  The exporter finds that client and uses it; the test reads the WAL back and compares
  the call tree with the `Trajectory` records captured next to it.
- in a subprocess: the real ``weave.init`` (called by the exporter, or by the application first)
  against a small fake W&B / Weave HTTP server, WAL sender on, to check that otel-rl's spans still
  flow after Weave set up its own OpenTelemetry provider, and that the calls leave the process as
  HTTP requests to the trace server.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap

import pytest

weave = pytest.importorskip("weave")
otel_rl_weave = pytest.importorskip("otel_rl_weave")

import otel_rl  # noqa: E402
from otel_rl import semconv as sc  # noqa: E402
from otel_rl.records import RunIdentity, Trajectory  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402
from otel_rl_weave import META_KEY, WeaveExporter, call_id, call_inputs, call_output, exception_info  # noqa: E402
from otel_rl_weave._exporter import op_name as weave_op_name  # noqa: E402
from otel_rl_weave._exporter import to_datetime, usage_summary  # noqa: E402
from otel_rl_weave.wal import op_name, read_calls, read_records  # noqa: E402

CLOSED_PORT_URL = "http://127.0.0.1:9"  # discard port: nothing listens, nothing is sent (WAL sender off)


@pytest.fixture
def weave_wal(tmp_path, monkeypatch):
    """A WAL-backed global Weave client for entity 'ent', project 'proj'; yields (client, wal root)."""
    import weave.durability.wal_manager as wal_manager
    from weave.trace.context import weave_client_context
    from weave.trace.weave_client import WeaveClient
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    for k in list(os.environ):
        if k.startswith("OTEL_RL_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WEAVE_ENABLE_WAL", "true")
    monkeypatch.setenv("WEAVE_DISABLE_WAL_SENDER", "true")
    monkeypatch.setenv("WEAVE_PRINT_CALL_LINK", "false")
    root = tmp_path / ".weave" / "wal"
    monkeypatch.setattr(wal_manager, "WAL_ROOT", str(root))  # computed from $HOME when weave was imported
    previous = weave_client_context.get_weave_client()
    client = WeaveClient("ent", "proj", RemoteHTTPTraceServer(CLOSED_PORT_URL, should_batch=True),
                         ensure_project_exists=False)
    assert client._wal is not None and str(client._wal.wal_dir).startswith(str(root))
    weave_client_context.set_weave_client_global(client)
    try:
        yield client, root
    finally:
        client.finish(use_progress_bar=False)
        weave_client_context.set_weave_client_global(previous)


# ----------------------------------------------------------------------------- an instrumented workload


@otel_rl.generate(model="policy-7b")
async def chat(messages: list[dict]) -> dict:
    text = messages[-1]["content"]
    return {"prompt_ids": list(range(len(text))), "response_ids": [7, 8, 9], "content": f"answer to {text}"}


@otel_rl.tool(name="calculator")
def calculator(expression: str, tool_call_id: str = "call-0") -> float:
    if expression == "1/0":
        raise ZeroDivisionError("division by zero")
    return 42.0


@otel_rl.op(kind="REWARD")
def reward_fn(answer: float, notes: str = "") -> float:
    return 1.0 if answer == 42.0 else 0.0


class MathAgent:
    class ToolFailure(Exception):
        pass

    @otel_rl.op(kind="AGENT")
    async def run(self, question: str, extra: str = "") -> dict:
        reply = await chat([{"role": "user", "content": question}])
        try:
            calculator("1/0", tool_call_id="c1")
        except ZeroDivisionError:
            pass
        value = calculator("6*7", tool_call_id="c2")
        if question == "fail":
            raise MathAgent.ToolFailure("the environment crashed 💥")
        return {"answer": value, "reply": reply["content"], "nan": float("nan")}

    @otel_rl.op
    def steps(self, n: int):
        for i in range(n):
            yield {"i": i}


async def _workload() -> None:
    for step in (1, 2):
        with otel_rl.step(step):
            for i in range(3):
                with otel_rl.trajectory(sample_index=i, rollout_n=0, name="math_rollout") as t:
                    out = await MathAgent().run(f"q{i} 中文", extra="x" * 3000)  # cut at max_value_chars
                    list(MathAgent().steps(2))
                    t.set_reward(reward_fn(out["answer"], notes="ünïcødé"))
            try:
                with otel_rl.trajectory(sample_index=9, rollout_n=1):
                    await MathAgent().run("fail")
            except MathAgent.ToolFailure:
                pass
    with otel_rl.trajectory(step=2, sample_index=0, validate=True, name="val_rollout"):
        await MathAgent().run("validation")


def _run_workload(**init) -> tuple[CaptureExporter, otel_rl.Handle]:
    import asyncio

    cap = CaptureExporter()
    names = init.pop("exporters", [])
    h = otel_rl.init(project="proj", experiment="exp-1", exporters=[*names, cap], batch_delay_s=0.02,
                     max_value_chars=2000, **init)
    asyncio.run(_workload())
    return cap, h


def _iso(dt: datetime.datetime | None) -> str | None:
    return None if dt is None else dt.astimezone(datetime.timezone.utc).isoformat()


def _parse_iso(text: str | None) -> str | None:
    return None if text is None else _iso(datetime.datetime.fromisoformat(text.replace("Z", "+00:00")))


def _assert_tree(t: Trajectory, calls: dict[str, dict]) -> int:
    """Compare one trajectory's span tree with its Weave calls; returns the number of nodes."""
    from weave.trace.weave_client import sanitize_object_name

    root_id = call_id(t.trace_id, t.root.span_id, t.root.start_ns)
    tags = {sc.TAG_EXPERIMENT_NAME: t.run.experiment, sc.TAG_VALIDATE: t.validate}
    for key, value in ((sc.TAG_STEP, t.step), (sc.TAG_SAMPLE_INDEX, t.sample_index), (sc.TAG_ROLLOUT_N, t.rollout_n)):
        if value is not None:
            tags[key] = value
    n = 0
    for node in t.root.walk():
        n += 1
        cid = call_id(t.trace_id, node.span_id, node.start_ns)
        assert cid in calls, f"no Weave call for span {node.name}"
        c = calls[cid]
        is_root = node is t.root
        parent = None if is_root else call_id(t.trace_id, node.parent_id,
                                              next(p.start_ns for p in t.root.walk() if p.span_id == node.parent_id))
        assert c["parent_id"] == parent
        assert c["trace_id"] == root_id
        assert op_name(c) == sanitize_object_name(weave_op_name(node.name))
        assert c["display_name"] == (t.name if is_root else node.name)
        assert c["inputs"] == call_inputs(node)
        assert c["output"] == call_output(node)
        assert _parse_iso(c["started_at"]) == _iso(to_datetime(node.start_ns))
        assert _parse_iso(c["ended_at"]) == _iso(to_datetime(node.end_ns))
        info = exception_info(node)
        if info is None:
            assert c["exception"] is None
        else:
            assert json.loads(c["exception"]) == {"type": info["type"].rsplit(".", 1)[-1], "message": info["message"]}
        attrs = c["attributes"]
        assert {k: attrs[k] for k in tags} == tags
        meta = attrs[META_KEY]
        assert meta["span_id"] == f"{node.span_id:016x}" and meta["trace_id"] == f"{t.trace_id:032x}"
        assert meta["kind"] == node.kind and meta["status"] == node.status
        assert meta["run_id"] == t.run.run_id and meta["project"] == t.run.project
        usage = usage_summary(node)
        if usage is not None:
            assert c["summary"]["usage"] == usage["usage"]
    return n


def test_trajectories_become_weave_call_trees(weave_wal):
    client, root = weave_wal
    cap, h = _run_workload(trace_backend="weave", max_samples=2)
    assert isinstance(next(e for e in h.exporters if e.name == "weave"), WeaveExporter)
    cap.collect()
    trajectories = cap.of_type(Trajectory)
    h.shutdown()

    # per step: samples 0 and 1 traced (max_samples=2); the unsampled ones (2 and the failing 9) are
    # kept because an op failed in them, with their root and failing ops only; then the validation one
    by_kind = sorted((t.step, t.sample_index, t.validate, t.status) for t in trajectories)
    assert by_kind == sorted([(s, 0, False, "UNSET") for s in (1, 2)] + [(s, 1, False, "UNSET") for s in (1, 2)]
                             + [(s, 2, False, "ERROR") for s in (1, 2)] + [(s, 9, False, "ERROR") for s in (1, 2)]
                             + [(2, 0, True, "UNSET")])

    calls = read_calls(root)
    starts = [r["req"]["start"]["id"] for r in read_records(root) if r["type"] == "call_start"]
    assert len(starts) == len(set(starts)) == len(calls)  # each call once
    assert sum(_assert_tree(t, calls) for t in trajectories) == len(calls)  # nothing else was sent

    # spot checks of the mapping, independent of the helpers
    roots = [c for c in calls.values() if c["parent_id"] is None]
    assert sorted(c["display_name"] for c in roots) == sorted(
        ["math_rollout"] * 6 + [sc.SPAN_TRAJECTORY] * 2 + ["val_rollout"])
    failed_root = next(c for c in roots if c["attributes"][sc.TAG_SAMPLE_INDEX] == 9 and c["attributes"]["step"] == 1)
    assert json.loads(failed_root["exception"]) == {"type": "ToolFailure", "message": "the environment crashed 💥"}
    assert "Traceback" in failed_root["attributes"][META_KEY]["exception"]["stacktrace"]
    tool_errors = [c for c in calls.values() if c["exception"] and "ZeroDivisionError" in c["exception"]]
    assert len(tool_errors) == 9
    assert [c["inputs"] for c in tool_errors if c["inputs"]] == [{"expression": "1/0", "tool_call_id": "c1"}] * 5
    kept = [c for c in roots if c["attributes"][sc.TAG_SAMPLE_INDEX] in (2, 9)]  # unsampled, kept for an error
    assert len(kept) == 4 and all(c["attributes"][META_KEY]["attributes"][sc.RL_SAMPLED] is False for c in kept)
    llm = [c for c in calls.values() if c["display_name"] == "chat policy-7b"]
    assert len(llm) == 5 and all(c["summary"]["usage"]["policy-7b"]["output_tokens"] == 3 for c in llm)
    ok_root = next(c for c in roots if c["display_name"] == "math_rollout")
    assert ok_root["summary"]["usage"]["policy-7b"]["requests"] == 1  # Weave sums children into the root
    assert ok_root["attributes"][META_KEY]["attributes"][sc.RL_REWARD] == 1.0
    agent = [c for c in calls.values() if c["display_name"] == "MathAgent.run" and "raw_json" in c["inputs"]]
    assert agent and all(c["inputs"]["raw_json"].startswith('{"question"') for c in agent)  # cut at 2000 chars
    gen = [c for c in calls.values() if c["display_name"] == "MathAgent.steps"]
    assert gen and all(c["output"] == [{"i": 0}, {"i": 1}] for c in gen)


def test_only_trajectories_reach_weave(weave_wal):
    """Named in trainer.logger (not as trace backend) it still gets trajectories; metrics are ignored."""
    client, root = weave_wal
    cap = CaptureExporter()
    h = otel_rl.init(project="proj", experiment="e", exporters=["weave", cap], batch_delay_s=0.02)
    otel_rl.log({"a": 1.0}, step=1)
    otel_rl.log_generations([("i", "o", 1.0)], step=1)
    with otel_rl.trajectory(step=1, sample_index=0):
        calculator("1+1")
    h.shutdown()
    calls = read_calls(root)
    assert sorted(c["display_name"] for c in calls.values()) == sorted([sc.SPAN_TRAJECTORY, "execute_tool calculator"])


def test_retried_batch_sends_each_call_once(weave_wal, monkeypatch):
    """A batch that failed half-way is retried by the pipeline: trajectories already sent are skipped."""
    client, root = weave_wal
    cap, h = _run_workload(exporters=[])  # records only
    cap.collect()
    trajectories = cap.of_type(Trajectory)
    h.shutdown()

    from otel_rl.config import resolve

    exp = WeaveExporter(resolve(env={}, project="proj", exporters=[]))
    monkeypatch.setattr(exp, "write_trajectory", _failing_once(exp.write_trajectory, after=3))
    with pytest.raises(ConnectionError):
        exp.export_records(trajectories)
    exp.export_records(trajectories)  # the retry
    exp.shutdown()
    starts = [r["req"]["start"]["id"] for r in read_records(root) if r["type"] == "call_start"]
    assert len(starts) == len(set(starts)) == sum(len(list(t.root.walk())) for t in trajectories)


def _failing_once(fn, after: int):
    state = {"n": 0}

    def wrapper(client, t):
        state["n"] += 1
        if state["n"] == after + 1:
            raise ConnectionError("transient")
        return fn(client, t)

    return wrapper


def test_usage_summary_reads_token_counts_by_their_type():
    """A token count that is no integer (only a hand-made span holds one: the bridge refuses it) counts
    as none."""
    from otel_rl.records import SpanNode

    attrs = {sc.GEN_AI_USAGE_INPUT_TOKENS: 3, sc.GEN_AI_USAGE_OUTPUT_TOKENS: ("x",), sc.GEN_AI_REQUEST_MODEL: "m"}
    node = SpanNode("llm", sc.KIND_LLM, 1, None, 0, 1, attrs, None, None, "OK", None, [])
    assert usage_summary(node) == {
        "usage": {"m": {"requests": 1, "input_tokens": 3, "output_tokens": 0, "total_tokens": 3}}
    }


def _flat_trajectory(trace_id: int, name: str, start_ns: int = 1_700_000_000_000_000_000) -> Trajectory:
    from otel_rl.records import SpanNode

    node = SpanNode(name=name, kind="AGENT", span_id=trace_id, parent_id=None, start_ns=start_ns,
                    end_ns=start_ns + 10**9, attributes={}, inputs='{"x": 1}', output="2", status="UNSET",
                    status_message=None, events=[])
    return Trajectory(RunIdentity("proj", "e", "r"), trace_id, 1, trace_id, None, False, name, node)


def test_a_name_weave_refuses_as_an_op_falls_back_to_a_generic_op(weave_wal):
    client, root = weave_wal
    from otel_rl.config import resolve

    exp = WeaveExporter(resolve(env={}, project="proj", exporters=[]))
    exp.export_records([_flat_trajectory(1, "!!!"), _flat_trajectory(2, "good")])  # "!!!" is no Weave op name
    exp.shutdown()
    calls = read_calls(root)
    assert sorted((op_name(c), c["display_name"]) for c in calls.values()) == [("good", "good"),
                                                                              ("otel_rl_op", "!!!")]


def test_weave_stores_every_good_trajectory_around_one_it_cannot_store(weave_wal, caplog):
    """Two trajectories Weave cannot take (a start time no datetime can hold; a child span ending at such
    a time) sit among 16 good ones in one delivery: each is rejected whole (no call of it is made, one
    warning naming its trace, counted in ``rejected``, not retried); the 16 are calls in Weave's
    write-ahead log."""
    import logging

    from otel_rl._delivery import DeliveryQueue
    from otel_rl.config import resolve
    from otel_rl.records import SpanNode

    client, root = weave_wal
    bad_child = _flat_trajectory(98, "bad-child")
    bad_child.root.children.append(SpanNode(
        name="chat", kind="LLM", span_id=5, parent_id=98, start_ns=bad_child.root.start_ns, end_ns=2**90,
        attributes={}, inputs=None, output=None, status="UNSET", status_message=None, events=[]))
    batch = ([_flat_trajectory(i, f"t{i}") for i in range(1, 9)] + [_flat_trajectory(99, "bad", start_ns=2**90)]
             + [_flat_trajectory(i, f"t{i}") for i in range(9, 13)] + [bad_child]
             + [_flat_trajectory(i, f"t{i}") for i in range(13, 17)])
    exp = WeaveExporter(resolve(env={}, project="proj", exporters=[]))
    exp.name = "weave"
    q = DeliveryQueue(exp, 10_000, gather_s=0.0)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_rl"):
            q.put([], batch)
            assert q.wait_idle(60), "the queue is stuck on a bad trajectory"
        stats = q.stats.as_dict()
    finally:
        q.stop(10)
        exp.shutdown()
    calls = read_calls(root)
    assert sorted(c["display_name"] for c in calls.values()) == sorted(f"t{i}" for i in range(1, 17))
    assert all(c.get("ended_at") for c in calls.values())
    assert stats["rejected"] == 2 and stats["exported"] == 18 and stats["failed_attempts"] == 0
    msgs = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(msgs) == 2 and f"trace {99:032x}" in msgs[0] and f"trace {98:032x}" in msgs[1]


def test_entry_points_and_span_exporter_adapter(weave_wal, monkeypatch):
    """``OTEL_TRACES_EXPORTER=weave``: spans of another process become the same call trees."""
    from importlib.metadata import entry_points

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from otel_rl.exporters import registry

    client, root = weave_wal
    assert registry.resolve_factory("weave") is WeaveExporter
    (ep,) = [e for e in entry_points(group="opentelemetry_traces_exporter") if e.name == "weave"]
    cls = ep.load()
    assert issubclass(cls, SpanExporter)
    cap, h = _run_workload(exporters=[])
    cap.collect()
    spans, trajectories = list(cap.spans), cap.of_type(Trajectory)
    h.shutdown()
    monkeypatch.setenv("OTEL_RL_PROJECT", "proj")
    bridge = cls()
    assert bridge.export(spans[: len(spans) // 2]) is SpanExportResult.SUCCESS
    assert bridge.export(spans[len(spans) // 2:]) is SpanExportResult.SUCCESS
    bridge.shutdown()
    calls = read_calls(root)
    assert sum(_assert_tree(t, calls) for t in trajectories) == len(calls)


# ----------------------------------------------------------------------------- weave.init, in a subprocess

_FAKE_SERVER_AND_RUN = textwrap.dedent('''
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    LOG = []

    class Handler(BaseHTTPRequestHandler):
        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            LOG.append(("GET", self.path, b""))
            if self.path.endswith("/server_info"):
                return self._send({"min_required_weave_python_version": "0.0.1", "trace_server_version": "99.0.0"})
            self._send({})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            LOG.append(("POST", self.path, body))
            if self.path.endswith("/graphql"):  # W&B API: project lookup, viewer
                return self._send({"data": {"project": {"id": "p1", "name": "proj"},
                                            "viewer": {"id": "u1", "username": "tester",
                                                       "defaultEntity": {"id": "e1", "name": "ent"}}}})
            if self.path.endswith(("/obj/create", "/file/create")):
                return self._send({"digest": "d%d" % len(LOG)})
            if self.path.endswith("/table/create"):
                return self._send({"digest": "t%d" % len(LOG), "row_digests": []})
            self._send({})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = "http://127.0.0.1:%d" % server.server_address[1]
    order = sys.argv[1]
    if order == "exit":
        os.environ["WEAVE_DISABLE_WAL_SENDER"] = "true"  # the WAL stays on disk for the test to read
    os.environ.update(WANDB_API_KEY="k" * 40, WANDB_BASE_URL=url, WF_TRACE_SERVER_URL=url + "/traces",
                      WANDB_ENTITY="ent", WEAVE_ENABLE_WAL="true", WEAVE_PRINT_CALL_LINK="false",
                      WEAVE_USE_SERVER_CACHE="false")

    import otel_rl
    from opentelemetry import trace
    from otel_rl.records import Trajectory
    from otel_rl.testing import CaptureExporter
    from otel_rl_weave import call_id

    out = {}
    if order == "exit":  # no shutdown(): the batch delay keeps the trajectory queued until the script ends
        otel_rl.init(project="proj", experiment="e", trace_backend="weave", exporters=[], batch_delay_s=5.0)

        @otel_rl.op
        def act(x):
            return x + 1

        with otel_rl.trajectory(step=1, sample_index=0):
            act(1)
        sys.exit(0)
    if order == "weave-first":
        import weave
        weave.init("proj")  # the application's own weave.init, before otel-rl
    out["provider_before"] = type(trace.get_tracer_provider()).__name__
    cap = CaptureExporter()
    h = otel_rl.init(project="proj", experiment="e", trace_backend="weave", exporters=[cap], batch_delay_s=0.02)
    out["provider_after_otel_rl"] = type(trace.get_tracer_provider()).__name__

    @otel_rl.op
    def act(x):
        return x + 1

    with otel_rl.trajectory(step=1, sample_index=0):
        act(1)
    h.flush()  # the exporter has now made (or found) its Weave client
    from weave.trace.context import weave_client_context
    client = weave_client_context.get_weave_client()
    out["weave_client"] = client is not None and f"{client.entity}/{client.project}"
    out["provider_after_weave"] = type(trace.get_tracer_provider()).__name__
    with otel_rl.trajectory(step=2, sample_index=0):  # after weave.init: our spans still flow
        act(2)
    with trace.get_tracer("third.party").start_as_current_span("third-party-span"):
        pass
    cap.collect()
    out["spans"] = sorted({s.name for s in cap.spans})
    trajectories = cap.of_type(Trajectory)
    out["trajectory_steps"] = sorted(t.step for t in trajectories if t.step is not None)
    expected = sorted(call_id(t.trace_id, n.span_id, n.start_ns) for t in trajectories for n in t.root.walk())
    h.shutdown()
    deadline = time.time() + 30
    uploaded = set()
    while time.time() < deadline:
        uploaded = set()
        for method, path, body in list(LOG):
            if method == "POST" and "/calls/" in path:
                for item in json.loads(body).get("batch", []):
                    uploaded.add(item.get("id") or item.get("req", {}).get("id"))
        if set(expected) <= uploaded:
            break
        time.sleep(0.2)
    out["expected_ids"] = expected
    out["uploaded_ids"] = sorted(i for i in uploaded if i)
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush(5000)  # Weave's own provider (weave-first): its OTLP export goes out now
    otlp = [b for m, p, b in LOG if "otel" in p]
    out["otlp_requests"] = len(otlp)
    out["otlp_has_third_party"] = any(b"third-party-span" in b for b in otlp)
    from otel_rl import semconv as sc
    ours = [name.encode() for name in (sc.SPAN_TRAJECTORY, sc.SPAN_RUN)]
    out["otlp_has_ours"] = any(name in b for b in otlp for name in ours)
    out["paths"] = sorted({p for m, p, b in LOG})
    print("RESULT " + json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # skip exit-time uploads: what matters was checked above
''')


@pytest.mark.parametrize("order", ["otel-first", "weave-first"])
def test_weave_init_keeps_otel_rl_spans_flowing(tmp_path, order):
    script = tmp_path / "run.py"
    script.write_text(_FAKE_SERVER_AND_RUN, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WANDB_", "WEAVE_", "WF_"))}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), order], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["weave_client"] == "ent/proj"
    if order == "otel-first":
        # otel-rl's forwarding provider was global first; Weave could not replace it
        assert out["provider_after_otel_rl"] == out["provider_after_weave"] == "_ForwardingTracerProvider"
        assert "third-party-span" in out["spans"]  # the global API still reaches otel-rl
        assert out["otlp_requests"] == 0
    else:
        # weave.init installed its own SDK provider as the global one; otel-rl kept its private provider
        assert out["provider_before"] == out["provider_after_otel_rl"] == out["provider_after_weave"] == \
            "TracerProvider"
        assert "third-party-span" not in out["spans"]
        assert out["otlp_has_third_party"]  # the global API now reaches Weave's OTLP exporter ...
        assert not out["otlp_has_ours"]  # ... but otel-rl's spans never do
    assert "act" in out["spans"] and out["trajectory_steps"] == [1, 2]
    assert set(out["expected_ids"]) <= set(out["uploaded_ids"]), out["paths"]  # sent to the trace server


def test_without_credentials_the_batch_waits_instead_of_prompting(tmp_path, monkeypatch):
    """No Weave client and no W&B key: weave.init would try an interactive login on the export
    thread; the exporter raises a clear error instead (the pipeline keeps the batch and retries)."""
    from weave.trace.context import weave_client_context

    from otel_rl.config import resolve
    from otel_rl.records import SpanNode

    for k in list(os.environ):
        if k.startswith(("WANDB_", "WEAVE_", "WF_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setattr(weave_client_context, "get_weave_client", lambda: None)
    node = SpanNode(name="n", kind="AGENT", span_id=1, parent_id=None, start_ns=1, end_ns=2, attributes={},
                    inputs=None, output=None, status="UNSET", status_message=None, events=[])
    exp = WeaveExporter(resolve(env={}, project="proj", exporters=[]))
    with pytest.raises(RuntimeError, match="WANDB_API_KEY"):
        exp.export_records([Trajectory(RunIdentity("proj", "e", "r"), 1, 1, 0, None, False, "n", node)])


def test_trajectory_still_queued_at_exit_reaches_weave(tmp_path):
    """No shutdown() call and a 5 s batch delay: the exporter (weave.init included) runs at interpreter
    exit, from otel-rl's atexit handler; Weave cannot set up its OTel provider that late (it needs a
    thread pool), the batch is retried once and the calls are written."""
    script = tmp_path / "run.py"
    script.write_text(_FAKE_SERVER_AND_RUN, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "WANDB_", "WEAVE_", "WF_"))}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(script), "exit"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = read_calls(tmp_path / ".weave" / "wal")
    assert sorted(c["display_name"] for c in calls.values()) == sorted([sc.SPAN_TRAJECTORY, "act"])
    assert all(c.get("ended_at") for c in calls.values())
