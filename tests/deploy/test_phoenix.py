"""Arize Phoenix behind the gateway Collector (deploy/collector/gateway.yaml + phoenix.yaml), end to end on 127.0.0.1.

A trainer process (tests/bridge/trainer.py: steps with timers; trajectories with a `plan` op, an LLM turn with
token counts, a tool call -- one of them raises -- and a reward op; log() and validation tables) sends OTLP/HTTP
to a real gateway (otelcol-rl) while Phoenix is down; the gateway is killed (SIGKILL) as soon as the trainer's
last export is acknowledged, then Phoenix (`phoenix serve`, sqlite, its own venv: .cache/phoenix-venv) starts and
the gateway restarts: its `traces/phoenix` pipeline (filter + transform/openinference) delivers from its disk
queue. Phoenix is read back with its REST API (/v1/projects/{project}/spans), its GraphQL API (a trace's root
span and its cumulative token counts) and its UI in headless Chromium.

The gateway's tracker path (`otlp_http/bridge`) goes to an OTLP/HTTP sink in this process, so the test sees
what the trainer sent, span for span; a second exporter merged into the Phoenix pipeline copies what the
transform wrote to another sink, so each OpenInference attribute is known to come from the Collector (recent
Phoenix releases also derive some from GenAI attributes themselves).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from . import _stack as S
from ._collector import COLLECTOR_DIR, Collector, otelcol_available

pytestmark = pytest.mark.slow

PHOENIX_VENV = S.ROOT / ".cache" / "phoenix-venv"
PHOENIX_PYTHON = PHOENIX_VENV / "bin" / "python"

# `phoenix serve`, except that its OTLP/gRPC receiver listens on 127.0.0.1: Phoenix binds it to every interface
# ("[::]:<PHOENIX_GRPC_PORT>") and has no setting for the host, while everything a test starts stays on loopback.
_SERVE = """\
import sys
from grpc.aio import _server
bind = _server.Server.add_insecure_port
_server.Server.add_insecure_port = lambda self, address: bind(self, address.replace("[::]:", "127.0.0.1:", 1))
from phoenix.server.main import main
sys.argv = ["phoenix", "serve"]
main()
"""

# OpenInference span kind for each rl.span.kind the trainer emits (untagged @op spans are CHAIN)
KINDS = {"AGENT": "AGENT", "LLM": "LLM", "TOOL": "TOOL", "REWARD": "EVALUATOR", "STEP": "CHAIN", "TIMER": "CHAIN",
         None: "CHAIN"}
# attributes the transform writes (span level), and the resource attribute naming Phoenix's project
OI_SPAN_KEYS = ("openinference.span.kind", "input.value", "input.mime_type", "output.value", "output.mime_type",
                "llm.model_name", "llm.token_count.prompt", "llm.token_count.completion", "llm.token_count.total",
                "tool.name", "tool.id")
OI_PROJECT = "openinference.project.name"


def _require(ok: bool, what: str) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} (scripts/bootstrap.sh --test installs it)", pytrace=False)
    pytest.skip(what)


class Phoenix:
    """`phoenix serve` on 127.0.0.1: sqlite under `cwd`, UI/HTTP and gRPC on free ports, no outbound calls."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.port, self.grpc_port = S.free_port(), S.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = cwd / "phoenix.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        work = self.cwd / "phoenix"
        work.mkdir()
        env = S.clean_env(
            PHOENIX_WORKING_DIR=str(work), PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=str(self.port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            # no telemetry pixels, web fonts or downloads; no assistant, MCP endpoint or Prometheus exporter
            PHOENIX_TELEMETRY_ENABLED="false", PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
            PHOENIX_DISABLE_AGENT_ASSISTANT="true", PHOENIX_ENABLE_MCP_SERVER="false",
            PHOENIX_ENABLE_PROMETHEUS="false")
        env.pop("PHOENIX_COLLECTOR_ENDPOINT", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(PHOENIX_PYTHON), "-c", _SERVE], cwd=work, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"phoenix exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("phoenix not ready:\n" + self.log())
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def get(self, path: str, **params: Any) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(params, doseq=True) if params else "")
        with urllib.request.urlopen(url, timeout=15) as r:
            return json.loads(r.read())

    def spans(self, project: str) -> list[dict]:
        """Every span of `project` (REST API, paged); [] while the project does not exist."""
        out: list[dict] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            try:
                page = self.get(f"/v1/projects/{urllib.parse.quote(project, safe='')}/spans", **params)
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return []
                raise
            out.extend(page["data"])
            cursor = page.get("next_cursor")
            if not cursor:
                return out

    def graphql(self, query: str, **variables: Any) -> dict:
        req = urllib.request.Request(self.url + "/graphql", data=json.dumps({"query": query, "variables": variables})
                                     .encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=15) as r:
            body = json.loads(r.read())
        assert not body.get("errors"), body
        return body["data"]

    def close(self) -> None:
        S.stop(self.proc)


ROOT_SPAN = """
query ($project: ID!, $trace: ID!) {
  node(id: $project) { ... on Project { trace(traceId: $trace) { rootSpan {
    name spanKind cumulativeTokenCountPrompt cumulativeTokenCountCompletion cumulativeTokenCountTotal
  } } } }
}"""


def _settle(counts: Any, done: Any, *procs: Any, timeout_s: float = 60.0) -> None:
    """Poll `counts()` until `done(counts)` holds for two polls in a row with the same counts."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = counts()
        if done(now) and now == last:
            return
        last = now
        assert time.monotonic() < deadline, f"{now}\n" + "\n".join(f"{type(x).__name__}:\n{x.log()}" for x in procs)
        time.sleep(0.5)


@pytest.fixture(scope="module")
def phoenix_run(tmp_path_factory):
    _require(otelcol_available(), "otelcol-rl is not built (bash scripts/build-collector.sh)")
    _require(PHOENIX_PYTHON.is_file(), f"no Phoenix venv at {PHOENIX_VENV}")
    from bridge.helpers import TRAINER

    root = tmp_path_factory.mktemp("phoenix")
    project = f"phoenix-{uuid.uuid4().hex[:6]}"
    trackers, inspect = S.OtlpSink(), S.OtlpSink()
    phoenix = Phoenix(root)  # its ports now; started once the gateway holds everything for it
    gateway = None
    try:
        # no Tempo here: the gateway's main traces pipeline keeps only the bridge exporter; the Phoenix pipeline
        # also copies what it sends to `inspect`
        extra = {
            "exporters": {"otlp_http/inspect": {"endpoint": inspect.url,
                                                "sending_queue": {"storage": "file_storage/queue"}}},
            "service": {"pipelines": {
                "traces": {"receivers": ["otlp"], "processors": ["memory_limiter"], "exporters": ["otlp_http/bridge"]},
                "traces/phoenix": {"exporters": ["otlp_http/phoenix", "otlp_http/inspect"]}}},
        }
        gateway = Collector(root, "gateway", [COLLECTOR_DIR / "gateway.yaml", COLLECTOR_DIR / "phoenix.yaml"],
                            extra=extra, env={
                                "OTEL_RL_BRIDGE_ENDPOINT": trackers.url, "OTEL_RL_BRIDGE_TOKEN": uuid.uuid4().hex,
                                "PHOENIX_OTLP_ENDPOINT": phoenix.url,
                                # no metrics are sent; the exporter only needs a loopback URL
                                "PROMETHEUS_REMOTE_WRITE_ENDPOINT": f"http://127.0.0.1:{S.free_port()}/api/v1/write"})
        out = root / "trainer.json"
        p = subprocess.run([sys.executable, str(TRAINER), "http", f"http://{gateway.http}", str(out),
                            "--project", project, "--experiment", "grpo", "--run-id", "phoenix-run-1",
                            "--steps", "3", "--samples", "2"],
                           env=S.clean_env(), cwd=root, capture_output=True, text=True, timeout=180, check=False)
        assert p.returncode == 0, f"trainer failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        captured = json.loads(out.read_text())
        n_traced = sum(len(t["spans"]) for t in captured["trajectories"])

        def for_phoenix() -> list:
            return [s for _, a, s in trackers.spans() if a.get("rl.span.kind") != "METRICS"
                    and s.name != "rl.generations"]

        # Phoenix is still down, and the gateway is killed as soon as the trainer's last export is acknowledged:
        # what it acknowledged is in its disk queues. Phoenix starts, the gateway restarts and sends it all.
        gateway.kill9()
        phoenix.start()
        gateway.start()
        _settle(lambda: (len(trackers.spans()), len(for_phoenix()), len(inspect.spans()), len(phoenix.spans(project))),
                lambda n: n[1] >= n_traced and n[1] == n[2] == n[3], gateway, phoenix)
        yield SimpleNamespace(phoenix=phoenix, project=project, captured=captured, sent=trackers.spans(),
                              inspected=inspect.spans(), spans=phoenix.spans(project), root=root)
    finally:
        if gateway is not None:
            gateway.stop()
        phoenix.close()
        trackers.close()
        inspect.close()


def test_phoenix_gets_every_trajectory_span_once_through_its_outage_and_a_gateway_kill(phoenix_run):
    r = phoenix_run
    sent = {s.span_id.hex(): (a, s) for _, a, s in r.sent}
    for_phoenix = {sid for sid, (a, s) in sent.items()
                   if a.get("rl.span.kind") != "METRICS" and s.name != "rl.generations"}
    ids = [s["context"]["span_id"] for s in r.spans]
    assert len(ids) == len(set(ids)), "a span stored twice"
    assert set(ids) == for_phoenix
    # the filter acts on Phoenix's pipeline only: the trackers still got the step metrics, run and tables
    names = {s.name for a, s in sent.values() if a.get("rl.span.kind") == "METRICS"}
    assert {"rl.log", "rl.run", "rl.generations"} <= names
    # every span of every trajectory the trainer's core recorded, with its parent
    by_id = {s["context"]["span_id"]: s for s in r.spans}
    for t in r.captured["trajectories"]:
        for span_id, parent_id, name, *_ in t["spans"]:
            s = by_id[span_id]
            assert (s["context"]["trace_id"], s["parent_id"], s["name"]) == (t["trace_id"], parent_id, name)


def test_trajectory_is_an_agent_span_with_llm_and_tool_children(phoenix_run):
    r = phoenix_run
    by_trace: dict[str, list[dict]] = {}
    for s in r.spans:
        by_trace.setdefault(s["context"]["trace_id"], []).append(s)
    assert len(r.captured["trajectories"]) == 3 * 2
    failed_tools = 0
    for t in r.captured["trajectories"]:
        spans = by_trace[t["trace_id"]]
        (root,) = [s for s in spans if s["parent_id"] is None]
        assert root["span_kind"] == "AGENT"
        assert (root["attributes"]["rl.step"], root["attributes"]["rl.sample_index"]) == (t["step"], t["sample_index"])
        children = {s["span_kind"]: s for s in spans if s["parent_id"] == root["context"]["span_id"]}
        assert sorted(children) == ["CHAIN", "EVALUATOR", "LLM", "TOOL"], sorted(children)
        for s in children.values():  # an op's inputs and output, as the trainer serialized them
            a = s["attributes"]
            assert a["input.value"] == a["rl.op.inputs"] and a["input.mime_type"] == "application/json"
            assert isinstance(json.loads(a["input.value"]), dict)
        llm = children["LLM"]["attributes"]
        prompt, response = json.loads(llm["input.value"]), json.loads(llm["output.value"])
        assert llm["llm.model_name"] == "policy-7b"
        assert llm["llm.token_count.prompt"] == len(prompt["prompt_ids"]) == llm["gen_ai.usage.input_tokens"]
        assert llm["llm.token_count.completion"] == len(response["response_ids"]) == llm["gen_ai.usage.output_tokens"]
        assert llm["llm.token_count.total"] == llm["llm.token_count.prompt"] + llm["llm.token_count.completion"]
        tool = children["TOOL"]
        a = tool["attributes"]
        assert (a["tool.name"], a["tool.id"]) == ("calculator", json.loads(a["input.value"])["tool_call_id"])
        if tool["status_code"] == "ERROR":  # the call that raised: no output, its exception kept
            failed_tools += 1
            assert "output.value" not in a
            assert [e["attributes"]["exception.type"] for e in tool["events"]] == ["ZeroDivisionError"]
        else:
            assert json.loads(a["output.value"]) == 4.0
        assert json.loads(children["EVALUATOR"]["attributes"]["output.value"]) == root["attributes"]["rl.reward"]
    assert failed_tools == 1


def test_phoenix_sums_a_trajectorys_token_counts_on_its_agent_span(phoenix_run):
    r = phoenix_run
    (project,) = [p for p in r.phoenix.get("/v1/projects")["data"] if p["name"] == r.project]
    for t in r.captured["trajectories"]:
        llm = [s["attributes"] for s in r.spans
               if s["context"]["trace_id"] == t["trace_id"] and s["span_kind"] == "LLM"]
        root = r.phoenix.graphql(ROOT_SPAN, project=project["id"], trace=t["trace_id"])["node"]["trace"]["rootSpan"]
        assert (root["name"], root["spanKind"]) == ("rl.trajectory", "agent")
        assert root["cumulativeTokenCountPrompt"] == sum(a["llm.token_count.prompt"] for a in llm) > 0
        assert root["cumulativeTokenCountCompletion"] == sum(a["llm.token_count.completion"] for a in llm) > 0
        assert root["cumulativeTokenCountTotal"] == root["cumulativeTokenCountPrompt"] + root[
            "cumulativeTokenCountCompletion"]


def test_openinference_attributes_are_written_by_the_gateway_only_for_phoenix(phoenix_run):
    r = phoenix_run
    # what the Phoenix pipeline sent: the project, and each span's kind and attributes from otel-rl's
    assert {res.get(OI_PROJECT) for res, _, _ in r.inspected} == {r.project}
    stored = {s["context"]["span_id"]: s for s in r.spans}
    assert {s.span_id.hex() for _, _, s in r.inspected} == set(stored)
    for _, a, s in r.inspected:
        kind = KINDS[a.get("rl.span.kind")]
        assert a["openinference.span.kind"] == kind == stored[s.span_id.hex()]["span_kind"], s.name
        if "rl.op.inputs" in a:
            assert a["input.value"] == a["rl.op.inputs"]
        if "rl.op.output" in a:
            assert a["output.value"] == a["rl.op.output"]
        if kind == "LLM":
            assert a["llm.model_name"] == a["gen_ai.request.model"]
            assert (a["llm.token_count.prompt"], a["llm.token_count.completion"], a["llm.token_count.total"]) == (
                a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"],
                a["gen_ai.usage.input_tokens"] + a["gen_ai.usage.output_tokens"])
        if kind == "TOOL":
            assert (a["tool.name"], a["tool.id"]) == (a["gen_ai.tool.name"], a["gen_ai.tool.call.id"])
    # the trackers' path is untouched by the Phoenix pipeline's processors
    for res, a, s in r.sent:
        assert OI_PROJECT not in res and not any(k in a for k in OI_SPAN_KEYS), s.name


def test_phoenix_ui_shows_the_trajectory_tree(phoenix_run):
    from ui.browser import Browser, chromium_path

    _require(chromium_path() is not None, "chromium is not installed")
    r = phoenix_run
    (project,) = [p for p in r.phoenix.get("/v1/projects")["data"] if p["name"] == r.project]
    # the trajectory whose tool call raised
    (trace_id,) = {s["context"]["trace_id"] for s in r.spans
                   if s["span_kind"] == "TOOL" and s["status_code"] == "ERROR"}
    names = sorted({s["name"] for s in r.spans if s["context"]["trace_id"] == trace_id})
    with Browser() as b:
        b.goto(f"{r.phoenix.url}/projects/{project['id']}/traces/{trace_id}")
        check = (f"(() => {{ const t = document.body ? document.body.innerText : '';"
                 f" return {json.dumps([*names, trace_id])}.every(n => t.includes(n)); }})()")
        try:
            b.wait_for(check, timeout_s=60)
        finally:
            b.screenshot(r.root / "phoenix-trace.png")
        text = b.text()
    assert "agent" in text.split()
    assert names == ["chat policy-7b", "execute_tool calculator", "plan", "rl.trajectory", "score"]
