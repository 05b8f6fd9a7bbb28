"""Static checks of deploy/: every YAML parses; collector pipelines reference only defined components and
every defined extension is enabled; ports and service names agree across compose, the collector configs,
Prometheus, Grafana and Kubernetes; dashboards use only provisioned datasources; secrets reach containers
only from Secrets; `promtool check config` accepts the Prometheus config; the committed dashboards are what
the generator writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml

from . import _stack as S

DEPLOY = S.DEPLOY
COLLECTOR = {name: DEPLOY / "collector" / f"{name}.yaml" for name in ("agent", "gateway")}
SECRETISH = re.compile(r"(TOKEN|PASSWORD|SECRET|API_KEY|_KEY$|CREDENTIAL)", re.I)


def _load(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def _compose() -> dict:
    return _load(DEPLOY / "compose.yaml")[0]


def _k8s() -> list[dict]:
    return [d for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in _load(p)]


def _k8s_get(kind: str, name: str) -> dict:
    found = [d for d in _k8s() if d.get("kind") == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"one {kind} {name!r} in deploy/k8s, found {len(found)}"
    return found[0]


def _env_default(value: str, env: dict[str, str]) -> str:
    """The collector's ``${env:NAME:-default}`` / ``${env:NAME}`` with `env` (a container's environment)."""
    def repl(m: re.Match) -> str:
        name, default = m.group(1), m.group(3)
        if name in env:
            return str(env[name])
        assert default is not None, f"${{env:{name}}} has no default and is not set"
        return default

    return re.sub(r"\$\{env:(\w+)(:-([^}]*))?\}", repl, value)


def _hostport(endpoint: str) -> tuple[str, int]:
    """host and port of 'http://host:port/path', 'host:port' or 'dns:///host:port'."""
    e = endpoint.replace("dns:///", "")
    if "://" not in e:
        e = "tcp://" + e
    u = urllib.parse.urlsplit(e)
    assert u.hostname and u.port, endpoint
    return u.hostname, u.port


def _arg(args: list[str], flag: str) -> str:
    args = [str(a) for a in args]
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def _compose_env(service: str) -> dict[str, str]:
    env = _compose()["services"][service].get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def _k8s_env(deployment: str) -> dict[str, str]:
    (c,) = _k8s_get("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "<secret>") for e in c.get("env", [])}


# ----------------------------------------------------------------------------- YAML and collector configs


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path):
    docs = _load(path)
    assert docs and all(isinstance(d, dict) for d in docs), path


@pytest.mark.parametrize("role", sorted(COLLECTOR))
def test_collector_pipelines_reference_defined_components(role):
    cfg = _load(COLLECTOR[role])[0]
    service = cfg["service"]
    defined = {kind: set(cfg.get(kind) or {}) for kind in ("receivers", "processors", "exporters", "extensions")}
    used = {kind: set() for kind in ("receivers", "processors", "exporters")}
    for name, p in service["pipelines"].items():
        assert name.split("/")[0] in ("traces", "metrics", "logs"), name
        assert p.get("receivers") and p.get("exporters"), f"{role}: pipeline {name} needs receivers and exporters"
        for kind in used:
            for comp in p.get(kind) or []:
                assert comp in defined[kind], f"{role}: pipeline {name} uses undefined {kind[:-1]} {comp!r}"
                used[kind].add(comp)
        procs = p.get("processors") or []
        assert procs and procs[0] == "memory_limiter", f"{role}: {name}: memory_limiter must come first"
        # batched by a processor, or (traces: acknowledged only once on disk) by every exporter from its queue
        batched = "batch" in procs or all(
            ((cfg["exporters"][e].get("sending_queue") or {}).get("batch") or {}).get("flush_timeout")
            for e in p["exporters"])
        assert batched, f"{role}: {name}: not batched"
        if name.startswith("traces"):
            assert "batch" not in procs, f"{role}: {name}: a batch processor holds acknowledged spans in memory"
    for kind in used:
        assert defined[kind] == used[kind], f"{role}: {kind} defined but unused: {defined[kind] - used[kind]}"
    enabled = service.get("extensions") or []
    assert set(enabled) == defined["extensions"], f"{role}: extensions defined vs enabled: {enabled}"
    # every queue is on disk and retried
    storages = {n for n in defined["extensions"] if n.split("/")[0] == "file_storage"}
    assert storages, f"{role}: no file_storage extension"
    for name, exp in cfg["exporters"].items():
        assert (exp.get("retry_on_failure") or {}).get("enabled"), f"{role}: {name} without retry_on_failure"
        if name.split("/")[0] in ("prometheus_remote_write", "prometheusremotewrite"):
            assert exp["wal"]["directory"], name  # no sending_queue there: its WAL is the disk buffer
            continue
        q = exp.get("sending_queue") or {}
        assert q.get("enabled") and q.get("storage") in storages, f"{role}: {name}: queue not persistent"


def test_gateway_fans_out_to_prometheus_tempo_and_the_bridge():
    cfg = _load(COLLECTOR["gateway"])[0]
    pipes = cfg["service"]["pipelines"]
    types = {p: {e.split("/")[0] for e in pipes[p]["exporters"]} for p in pipes}
    assert types["metrics"] == {"prometheus_remote_write"}
    assert types["traces"] == {"otlp_grpc", "otlp_http"}
    # the bridge rebuilds tracker calls from rl.log spans: nothing may sample spans away before it
    for p in pipes.values():
        assert not any(x.split("/")[0] in ("tail_sampling", "probabilistic_sampler", "filter")
                       for x in p.get("processors") or []), p
    stmts = " ".join(s for ms in cfg["processors"]["transform/run_identity"]["metric_statements"]
                     for s in ms["statements"])
    for key in ("rl.project.name", "rl.experiment.name", "rl.run.id"):
        assert f'set(attributes["{key}"], resource.attributes["{key}"])' in stmts, key


# ----------------------------------------------------------------------------- names and ports agree


def _bridge_http_port(args: list[str]) -> int:
    return _hostport(_arg(args, "--http-address"))[1]


def test_compose_wiring_agrees():
    c = _compose()
    services = c["services"]
    agent = _load(COLLECTOR["agent"])[0]
    gateway = _load(COLLECTOR["gateway"])[0]
    # agent -> gateway
    endpoint = agent["exporters"]["otlp_grpc/gateway"]["endpoint"]
    host, port = _hostport(_env_default(endpoint, _compose_env("otel-agent")))
    assert host == "otel-gateway" and host in services
    assert port == _hostport(gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])[1]
    # trainers reach the agent on the published OTLP ports
    published = {str(p).split(":")[0] for p in services["otel-agent"]["ports"]}
    assert published >= {str(_hostport(agent["receivers"]["otlp"]["protocols"][k]["endpoint"])[1])
                         for k in ("grpc", "http")}
    genv = _compose_env("otel-gateway")
    # gateway -> bridge: host:port == the bridge service and its --http-address port
    bridge = services["otel-rl-bridge"]
    host, port = _hostport(_env_default(gateway["exporters"]["otlp_http/bridge"]["endpoint"], genv))
    assert host == "otel-rl-bridge" and port == _bridge_http_port(bridge["command"])
    assert str(port) in [str(p) for p in bridge.get("expose", [])]
    assert _arg(bridge["command"], "--exporters") == "mlflow"
    assert bridge["environment"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    mlflow_port = int(_arg(services["mlflow"]["command"], "--port"))
    assert _hostport(bridge["environment"]["MLFLOW_TRACKING_URI"])[1] == mlflow_port
    assert _arg(bridge["command"], "--auth-token-env") in bridge["environment"]
    auth = gateway["exporters"]["otlp_http/bridge"]["auth"]["authenticator"]
    assert "OTEL_RL_BRIDGE_TOKEN" in genv and gateway["extensions"][auth]["token"] == "${env:OTEL_RL_BRIDGE_TOKEN}"
    # the bridge's spool on a volume
    spool = bridge["environment"]["OTEL_RL_SPOOL_DIR"]
    assert any(str(v).split(":")[1] == spool for v in bridge["volumes"]), bridge["volumes"]
    # gateway -> tempo
    tempo_cfg = _load(DEPLOY / "tempo" / "tempo.yaml")[0]
    host, port = _hostport(_env_default(gateway["exporters"]["otlp_grpc/tempo"]["endpoint"], genv))
    assert host == "tempo" and host in services
    assert port == _hostport(tempo_cfg["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])[1]
    # gateway -> prometheus remote write (the receiver is enabled)
    url = _env_default(gateway["exporters"]["prometheus_remote_write"]["endpoint"], genv)
    host, port = _hostport(url)
    assert host == "prometheus" and urllib.parse.urlsplit(url).path == "/api/v1/write"
    assert "--web.enable-remote-write-receiver" in services["prometheus"]["command"]
    assert f"{port}:{port}" in services["prometheus"]["ports"]
    # storage dirs of the collectors are volumes
    for svc, role in (("otel-agent", agent), ("otel-gateway", gateway)):
        d = _env_default(role["extensions"]["file_storage/queue"]["directory"], _compose_env(svc))
        assert any(str(v).split(":")[1] == d for v in services[svc]["volumes"]), (svc, d)
    # config files mounted where the command reads them
    for svc, role in (("otel-agent", "agent"), ("otel-gateway", "gateway")):
        path = services[svc]["command"][0].split("=", 1)[1]
        assert f"./collector/{role}.yaml:{path}:ro" in services[svc]["volumes"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    # Prometheus scrapes the bridge's own metrics port and the collectors' telemetry port
    prom = _load(DEPLOY / "prometheus" / "prometheus.yml")[0]
    targets = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in prom["scrape_configs"]}
    assert targets["otel-rl-bridge"] == [f"otel-rl-bridge:{_arg(bridge['command'], '--prometheus-port')}"]
    telemetry = gateway["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]["port"]
    assert sorted(targets["otel-collector"]) == [f"otel-agent:{telemetry}", f"otel-gateway:{telemetry}"]
    assert targets["tempo"] == [f"tempo:{tempo_cfg['server']['http_listen_port']}"]


def test_grafana_provisioning_agrees_with_compose_and_dashboards():
    services = _compose()["services"]
    ds = _load(DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yaml")[0]["datasources"]
    by_uid = {d["uid"]: d for d in ds}
    tempo_cfg = _load(DEPLOY / "tempo" / "tempo.yaml")[0]
    assert _hostport(by_uid["prometheus"]["url"]) == ("prometheus", 9090) and "prometheus" in services
    assert _hostport(by_uid["tempo"]["url"]) == ("tempo", tempo_cfg["server"]["http_listen_port"])
    assert by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "tempo"
    assert by_uid["tempo"]["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"
    # the dashboards' folder is mounted where the provider reads it
    provider = _load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml")[0]["providers"][0]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in services["grafana"]["volumes"]}
    assert mounts[provider["options"]["path"]] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).name in S.load_dashboards()
    # every datasource a dashboard uses is provisioned, with the same type
    assert S.load_dashboards(), "no generated dashboards"
    for name, d in S.load_dashboards().items():
        refs = [v["datasource"] for v in d["templating"]["list"]]
        for p in S.panels(d):
            refs.append(p["datasource"])
            refs += [t["datasource"] for t in p["targets"] if "datasource" in t]
        for ref in refs:
            assert ref["uid"] in by_uid, f"{name}: datasource uid {ref['uid']!r} is not provisioned"
            assert by_uid[ref["uid"]]["type"] == ref["type"], (name, ref)
        assert len({p["id"] for p in d["panels"]}) == len(d["panels"]), f"{name}: duplicate panel ids"


def test_k8s_wiring_agrees():
    gateway_cfg = _load(COLLECTOR["gateway"])[0]
    # the ConfigMap carries deploy/collector/gateway.yaml verbatim
    cm = _k8s_get("ConfigMap", "otel-gateway-config")
    assert cm["data"]["gateway.yaml"] == COLLECTOR["gateway"].read_text(), \
        "deploy/k8s/gateway.yaml's ConfigMap must embed deploy/collector/gateway.yaml verbatim (4-space indent)"
    dep = _k8s_get("Deployment", "otel-gateway")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cfg_path = _arg(c["args"], "--config") if "--config" in c["args"] else c["args"][0].split("=", 1)[1]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    cm_vol = next(n for n, v in vols.items() if v.get("configMap", {}).get("name") == "otel-gateway-config")
    assert cfg_path == f"{mounts[cm_vol]}/gateway.yaml"
    env = _k8s_env("otel-gateway")
    assert mounts["queue"] == _env_default(gateway_cfg["extensions"]["file_storage/queue"]["directory"], env)
    # gateway -> bridge Service name:port, and on to the bridge container's --http-address
    host, port = _hostport(_env_default(gateway_cfg["exporters"]["otlp_http/bridge"]["endpoint"], env))
    svc = _k8s_get("Service", host)
    (sport,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    bdep = _k8s_get("Deployment", "otel-rl-bridge")
    (bc,) = bdep["spec"]["template"]["spec"]["containers"]
    cports = {p["name"]: p["containerPort"] for p in bc["ports"]}
    assert cports[sport["targetPort"]] == _bridge_http_port(bc["args"])
    assert cports["metrics"] == int(_arg(bc["args"], "--prometheus-port"))
    assert svc["spec"]["selector"].items() <= bdep["spec"]["template"]["metadata"]["labels"].items()
    # gateway Service ports are the receiver's ports
    gsvc = _k8s_get("Service", "otel-gateway")
    gports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in gsvc["spec"]["ports"]:
        assert gports[p["targetPort"]] == p["port"]
    for proto in ("grpc", "http"):
        assert gports[f"otlp-{proto}"] == _hostport(gateway_cfg["receivers"]["otlp"]["protocols"][proto]["endpoint"])[1]
    assert gsvc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # HPA on the gateway Deployment, which has resource requests to scale on
    hpa = _k8s_get("HorizontalPodAutoscaler", "otel-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "otel-gateway"}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    # the bridge: one replica, its spool on the PVC
    assert bdep["spec"]["replicas"] == 1 and bdep["spec"]["strategy"]["type"] == "Recreate"
    bpod = bdep["spec"]["template"]["spec"]
    claim = next(v["persistentVolumeClaim"]["claimName"] for v in bpod["volumes"] if "persistentVolumeClaim" in v)
    _k8s_get("PersistentVolumeClaim", claim)
    spool_mount = next(m["mountPath"] for m in bc["volumeMounts"]
                       if next(v for v in bpod["volumes"] if v["name"] == m["name"]).get("persistentVolumeClaim"))
    assert _k8s_env("otel-rl-bridge")["OTEL_RL_SPOOL_DIR"] == spool_mount
    # same bearer token Secret on both sides
    def secret_ref(container: dict, name: str) -> dict:
        return next(e for e in container["env"] if e["name"] == name)["valueFrom"]["secretKeyRef"]
    token_env = _arg(bc["args"], "--auth-token-env")
    assert secret_ref(bc, token_env) == secret_ref(c, "OTEL_RL_BRIDGE_TOKEN")


def test_secrets_only_from_secret_refs():
    """Tracker keys and tokens reach containers through secretKeyRef; no ConfigMap or literal env holds one."""
    for d in _k8s():
        if d.get("kind") == "Secret":
            pytest.fail(f"deploy/k8s must not ship a Secret ({d['metadata']['name']}): create it with kubectl")
        if d.get("kind") == "ConfigMap":
            text = json.dumps(d["data"])
            assert not re.search(r"(api_key|password|secret)\s*[:=]\s*['\"]?\w", text, re.I), d["metadata"]["name"]
        if d.get("kind") == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if SECRETISH.search(e["name"]):
                        assert "secretKeyRef" in (e.get("valueFrom") or {}), f"{d['metadata']['name']}: {e['name']}"
    for name, svc in _compose()["services"].items():
        env = svc.get("environment") or {}
        for k, v in env.items():
            if SECRETISH.search(k):
                assert re.fullmatch(r"\$\{\w+(:-[^}]*)?\}", str(v)), f"compose {name}: {k} must come from the shell"
    for role, path in COLLECTOR.items():
        for m in re.finditer(r"(?i)(authorization|api[-_]?key|token|password)\s*:\s*(.+)", path.read_text()):
            assert "${env:" in m.group(2), f"{role}: {m.group(0)!r} must come from the environment"


# ----------------------------------------------------------------------------- Prometheus config, dashboards


def test_promtool_accepts_the_prometheus_config():
    cfg = DEPLOY / "prometheus" / "prometheus.yml"
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is required in CI (it ships with the prometheus package)")
        assert _load(cfg)[0]["scrape_configs"]
        pytest.skip("no promtool on PATH; YAML checked only")
    r = subprocess.run([promtool, "check", "config", "--syntax-only", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_committed_dashboards_are_what_the_generator_writes(tmp_path):
    """Regenerate with the real command into a temporary folder; the committed JSON must be identical."""
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("grafana-foundation-sdk is required in CI to check the dashboards (pip install "
                        "grafana-foundation-sdk)")
        pytest.skip("grafana-foundation-sdk not installed")
    r = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "generate.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in S.DASHBOARDS.glob("*.json")}
    assert sorted(fresh) == sorted(committed), (sorted(fresh), sorted(committed))
    stale = [n for n in fresh if fresh[n] != committed[n]]
    assert not stale, f"{stale} drifted from deploy/grafana/generate.py: run " \
                      ".venv/bin/python deploy/grafana/generate.py"
