"""deploy/'s Collector configs run by the project's Collector build (otelcol-rl), end to end on 127.0.0.1.

- every config in deploy/collector (and each add-on merged over the gateway) passes `otelcol-rl validate`;
- one trainer process writes the same workload twice: in-process to MLflow sqlite store *A*, and over OTLP to
  the agent Collector (agent.yaml) -> gateway Collector (gateway.yaml) -> `otel-rl bridge` -> MLflow sqlite
  store *B*; A and B are compared field by field (metric histories, params, tags, tables, traces);
- the gateway's metrics go by Prometheus remote write into a real Prometheus, and every PromQL query of every
  dashboard panel returns data for the run from that path alone (no scrape of the trainer);
- the gateway authenticates to the bridge with the bearertokenauth extension; a gateway with a wrong token is
  refused and nothing of its run reaches the store.

No Tempo runs here: the gateway's traces pipeline is narrowed to the bridge exporter by a merged config.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from types import SimpleNamespace

import pytest

from . import _stack as S
from ._collector import (COLLECTOR_DIR, Collector, mlflow_snapshot, otelcol_available, trainer, validate,
                         wait_for_store, wait_ok)

if not otelcol_available():
    pytest.skip("otelcol-rl is not built (bash scripts/build-collector.sh)", allow_module_level=True)

CONFIGS = {
    "agent": [COLLECTOR_DIR / "agent.yaml"],
    "gateway": [COLLECTOR_DIR / "gateway.yaml"],
    "gateway+sharded": [COLLECTOR_DIR / "gateway.yaml", COLLECTOR_DIR / "gateway-sharded.yaml"],
    "gateway+phoenix": [COLLECTOR_DIR / "gateway.yaml", COLLECTOR_DIR / "phoenix.yaml"],
    "gateway+sharded+phoenix": [COLLECTOR_DIR / "gateway.yaml", COLLECTOR_DIR / "gateway-sharded.yaml",
                                COLLECTOR_DIR / "phoenix.yaml"],
}
BRIDGE_ONLY = {"service": {"pipelines": {"traces": {"receivers": ["otlp"], "processors": ["memory_limiter"],
                                                    "exporters": ["otlp_http/bridge"]}}}}


def test_every_collector_config_is_covered():
    on_disk = {p.name for p in COLLECTOR_DIR.glob("*.yaml")}
    assert on_disk == {p.name for paths in CONFIGS.values() for p in paths}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_validates_with_the_pinned_collector(name):
    r = validate(*CONFIGS[name], env={"OTEL_RL_BRIDGE_TOKEN": "t"})
    assert r.returncode == 0, f"{name}: {r.stdout}\n{r.stderr}"


def test_gateway_does_not_start_without_the_bridge_token():
    r = validate(COLLECTOR_DIR / "gateway.yaml")
    assert r.returncode != 0 and "no bearer token" in r.stderr + r.stdout


def test_validate_refuses_an_unknown_component(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((COLLECTOR_DIR / "agent.yaml").read_text().replace("otlp_grpc/gateway", "otlp_grcp/gateway"))
    r = validate(bad, env={"OTEL_RL_BRIDGE_TOKEN": "t"})
    assert r.returncode != 0 and "otlp_grcp" in r.stderr + r.stdout


# ----------------------------------------------------------------------------- trainer -> agent -> gateway -> bridge


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from bridge.helpers import BridgeProcess, clean_env, tracker_env

    binary = S.find_prometheus()
    if binary is None:
        pytest.fail("the prometheus binary is required (apt-get install prometheus)")
    import otel_rl

    root = tmp_path_factory.mktemp("collector-chain")
    a, b = root / "in-process", root / "bridge"
    a.mkdir()
    b.mkdir()
    token = uuid.uuid4().hex
    procs: list = []
    handle = None
    try:
        bridge = BridgeProcess(["--exporters", "mlflow", "--trace-backend", "mlflow", "--batch-delay", "0.05",
                                "--prometheus-port", "0", "--auth-token-env", "OTEL_RL_BRIDGE_TOKEN"],
                               clean_env(**tracker_env(b), OTEL_RL_BRIDGE_TOKEN=token), b)
        procs.append(bridge)
        prom = S.Prometheus(binary, root, {"otel-rl-bridge": bridge.prometheus},
                            extra_args=("--web.enable-remote-write-receiver",))
        procs.append(prom)
        gateway = Collector(root, "gateway", [COLLECTOR_DIR / "gateway.yaml"], extra=BRIDGE_ONLY, env={
            "OTEL_RL_BRIDGE_ENDPOINT": f"http://{bridge.http}", "OTEL_RL_BRIDGE_TOKEN": token,
            "PROMETHEUS_REMOTE_WRITE_ENDPOINT": f"{prom.url}/api/v1/write"})
        procs.append(gateway)
        agent = Collector(root, "agent", [COLLECTOR_DIR / "agent.yaml"], env={"OTEL_GATEWAY_ENDPOINT": gateway.grpc})
        procs.append(agent)
        eq = SimpleNamespace(project=f"chain-{uuid.uuid4().hex[:6]}", run_id="chain-run-1")
        p = trainer("both", f"http://{agent.http}", root / "both.json", clean_env(**tracker_env(a)), a, eq.project,
                    eq.run_id)
        t0 = time.time()
        # the dashboards' workload, in this process, with OTLP to the agent (its own /metrics is not scraped)
        with pytest.MonkeyPatch.context() as mp:
            for k in list(os.environ):
                if k.startswith("OTEL_") or k.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
                    mp.delenv(k, raising=False)
            mp.setenv("NO_PROXY", "127.0.0.1,localhost")
            handle = S.run_workload(S.free_port(), f"http://{agent.http}", None, step_pause_s=0.3)
        wait_ok(p, "the in-process + OTLP trainer")
        want = mlflow_snapshot(a, eq.project)
        got = wait_for_store(b, eq.project, want)
        # Prometheus has the workload's last step by remote write
        q = f'rl_train_training_global_step{{rl_run_id="{handle.run_id}"}} == {S.STEPS}'
        deadline = time.monotonic() + 60
        while not prom.api("query", query=q)["result"]:
            assert time.monotonic() < deadline, "no remote-written final step:\n" + gateway.log()
            time.sleep(0.5)
        time.sleep(1.0)
        yield SimpleNamespace(root=root, a=a, b=b, bridge=bridge, prom=prom, gateway=gateway, agent=agent, eq=eq,
                              want=want, got=got, token=token, handle=handle, t0=t0, t1=time.time())
    finally:
        if handle is not None:
            handle.shutdown(10)
        elif otel_rl.current() is not None:
            otel_rl.current().shutdown(5)
        for x in reversed(procs):
            if isinstance(x, BridgeProcess):
                x.kill()
            elif isinstance(x, Collector):
                x.stop()
            else:
                x.close()


@pytest.mark.slow
def test_store_through_agent_gateway_bridge_equals_in_process(chain):
    want, got = chain.want, chain.got
    assert list(want) == [chain.eq.run_id], want.keys()
    run = want[chain.eq.run_id]
    assert run["metrics"] and len(run["traces"]) == 6 and len(run["tables"]) == 2
    assert list(got) == list(want), chain.gateway.log()
    for key in ("name", "params", "tags", "metrics", "tables"):
        assert got[chain.eq.run_id][key] == run[key], key
    assert set(got[chain.eq.run_id]["traces"]) == set(run["traces"])
    for tid, trace in run["traces"].items():
        assert got[chain.eq.run_id]["traces"][tid] == trace, tid


@pytest.mark.slow
def test_remote_write_answers_every_dashboard_panel(chain):
    """Every PromQL target of every panel, with the variables set to the workload's run, returns data from the
    series the gateway remote-wrote (plus the bridge's own, scraped)."""
    from .test_dashboards import _finite, _regex

    values = {"project": _regex(S.PROJECT), "experiment": _regex(S.EXPERIMENT), "run": _regex(chain.handle.run_id)}
    empty, asked = [], 0
    for name, dashboard in S.load_dashboards().items():
        for panel in S.panels(dashboard):
            for target in panel["targets"]:
                if (target.get("datasource") or panel.get("datasource") or {}).get("type") != "prometheus":
                    continue  # Tempo panels: test_dashboards.py
                expr = S.substitute(target["expr"], values)
                if "spool_bytes" in expr:
                    continue  # the workload here has no spooled exporter
                asked += 1
                result = chain.prom.api("query_range", query=expr, start=chain.t0, end=chain.t1, step=1)["result"]
                if not _finite(result):
                    empty.append(f"{name}:{panel['title']}: {expr}")
    assert asked > 40
    assert not empty, "no data by remote write for:\n" + "\n".join(empty)


@pytest.mark.slow
def test_wrong_bridge_token_is_refused(chain, tmp_path):
    from bridge.helpers import clean_env

    gw = Collector(tmp_path, "gateway-wrong-token", [COLLECTOR_DIR / "gateway.yaml"], extra=BRIDGE_ONLY, env={
        "OTEL_RL_BRIDGE_ENDPOINT": f"http://{chain.bridge.http}", "OTEL_RL_BRIDGE_TOKEN": "not-" + chain.token,
        "PROMETHEUS_REMOTE_WRITE_ENDPOINT": f"{chain.prom.url}/api/v1/write"})
    try:
        project = f"wrong-{uuid.uuid4().hex[:6]}"
        wait_ok(trainer("http", f"http://{gw.http}", tmp_path / "t.json", clean_env(), tmp_path, project, "w-1"),
                "trainer to the wrong-token gateway")
        deadline = time.monotonic() + 30
        while "HTTP Status Code 401" not in gw.log():
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.5)
        # refused for good (a 401 is not retried), nothing of the run in the bridge's store
        assert re.search(r"not retryable error.*401, Message=missing or wrong bearer token", gw.log()), gw.log()
        time.sleep(2)
        assert mlflow_snapshot(chain.b, project) == {}
    finally:
        gw.stop()
