"""Runs sharded over bridge replicas by `rl.run.id` (gateway.yaml + gateway-sharded.yaml, the `load_balancing`
exporter with `routing_key: attributes` on the resource attribute), all real processes on 127.0.0.1:

    8 trainer processes -> agent (spans spread over both gateways by trace id)
                        -> 2 gateways (load_balancing by rl.run.id) -> 3 bridges, each its own MLflow sqlite store

Every run's traces pass through both gateways, so a run that lands whole in one store shows that both gateways
route it to the same bridge. Then a bridge is removed mid-run: it is stopped and the gateways' static resolver
list is changed (config file rewritten, SIGHUP: the Collector reloads its configuration and keeps its persistent
queues). Its runs go on in another bridge's store from then on; nothing is lost or written twice.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest

from ._collector import (COLLECTOR_DIR, Collector, mlflow_snapshot, otelcol_available, start_bridge, store_mismatch,
                         trainer, wait_ok, wait_until)

if not otelcol_available():
    pytest.skip("otelcol-rl is not built (bash scripts/build-collector.sh)", allow_module_level=True)

pytestmark = pytest.mark.slow

LB = "load_balancing/bridges"
TRAINERS = 8


def gateway_extra(bridges: list[str]) -> dict:
    """Traces only to the bridges (no Tempo here), metrics to the debug exporter (no Prometheus here), the bridges
    listed in the file (a file can change under a running Collector; its environment cannot), backoff capped."""
    return {
        "exporters": {"debug": {"verbosity": "basic"},
                      LB: {"resolver": {"static": {"hostnames": bridges}},
                           "retry_on_failure": {"max_interval": "2s"}}},
        "service": {"pipelines": {
            "traces": {"receivers": ["otlp"], "processors": ["memory_limiter"], "exporters": [LB]},
            "metrics": {"receivers": ["otlp"], "processors": ["memory_limiter"], "exporters": ["debug"]}}},
    }


def agent_extra(gateways: list[str]) -> dict:
    """The agent spreads spans over both gateways by trace id (each run's traces go through both)."""
    return {
        "exporters": {"load_balancing/gateways": {
            "routing_key": "traceID",
            "protocol": {"otlp": {"tls": {"insecure": True}, "sending_queue": {"enabled": False},
                                  "retry_on_failure": {"enabled": False}}},
            "resolver": {"static": {"hostnames": gateways}},
            "sending_queue": {"enabled": True, "storage": "file_storage/queue"},
            "retry_on_failure": {"enabled": True, "initial_interval": "1s", "max_interval": "2s",
                                 "max_elapsed_time": 0}}},
        "service": {"pipelines": {"traces": {"exporters": ["load_balancing/gateways"]}}},
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from ._stack import free_port

    root = tmp_path_factory.mktemp("collector-sharding")
    token = uuid.uuid4().hex
    st = SimpleNamespace(root=root, token=token, bridges=[], stores=[], gateways=[], agent=None)
    try:
        for i in range(3):
            store = root / f"store-{i}"
            store.mkdir()
            st.stores.append(store)
            st.bridges.append(start_bridge(store, free_port(), token))
        hosts = [b.grpc for b in st.bridges]
        for i in range(2):
            st.gateways.append(Collector(root, f"gateway-{i}", [COLLECTOR_DIR / "gateway.yaml",
                                                                COLLECTOR_DIR / "gateway-sharded.yaml"],
                                         extra=gateway_extra(hosts), env={"OTEL_RL_BRIDGE_TOKEN": token}))
        st.agent = Collector(root, "agent", [COLLECTOR_DIR / "agent.yaml"],
                             extra=agent_extra([g.grpc for g in st.gateways]),
                             env={"OTEL_GATEWAY_ENDPOINT": st.gateways[0].grpc})  # metrics
        yield st
    finally:
        for c in [st.agent, *st.gateways]:
            if c is not None:
                c.stop()
        for b in st.bridges:
            b.kill()


def run_trainers(st, name: str, steps: int, step_pause_s: float) -> list[SimpleNamespace]:
    from bridge.helpers import clean_env

    project = f"{name}-{uuid.uuid4().hex[:6]}"
    runs = []
    for i in range(TRAINERS):
        run = SimpleNamespace(project=project, run_id=f"{name}-{i}", out=st.root / f"{name}-{i}.json")
        run.proc = trainer("http", f"http://{st.agent.http}", run.out, clean_env(), st.root, project, run.run_id,
                           steps=steps, samples=2, step_pause_s=step_pause_s)
        runs.append(run)
    return runs


def finish(runs: list[SimpleNamespace]) -> None:
    try:
        for run in runs:
            wait_ok(run.proc, run.run_id)
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.kill()
    for run in runs:
        run.cap = json.loads(run.out.read_text())


def merged(parts: list[dict]) -> dict | None:
    """One MLflow run rebuilt from its parts in several stores: metric points, spans and tables added up (a point
    or span stored twice stays twice)."""
    if not parts:
        return None
    out = {"params": {}, "metrics": {}, "tables": {}, "traces": {}}
    for p in parts:
        out["params"].update(p["params"])
        out["tables"].update(p["tables"])
        for k, points in p["metrics"].items():
            out["metrics"][k] = sorted(out["metrics"].get(k, []) + points)
        for tid, tr in p["traces"].items():
            have = out["traces"].setdefault(tid, {"tags": {}, "spans": []})
            have["tags"].update(tr["tags"])
            have["spans"] = sorted(have["spans"] + list(tr["spans"]))
    return out


def placement(st, runs) -> tuple[dict[str, list[int]], list[dict]]:
    """{run id: indexes of the stores that hold a part of it}, and the stores' snapshots."""
    snaps = [mlflow_snapshot(s, runs[0].project) for s in st.stores]
    return {r.run_id: [i for i, snap in enumerate(snaps) if r.run_id in snap] for r in runs}, snaps


def wait_complete(st, runs, timeout: float = 120):
    def check():
        where, snaps = placement(st, runs)
        for r in runs:
            bad = store_mismatch(merged([snaps[i][r.run_id] for i in where[r.run_id]]), r.cap)
            if bad:
                return f"{r.run_id} in stores {where[r.run_id]}: {bad}"
        return None

    assert wait_until(check, timeout, 1.0) is None, check()
    return placement(st, runs)[0]


def test_each_run_lands_whole_in_one_bridge_store(shards):
    runs = run_trainers(shards, "shard", steps=4, step_pause_s=0.0)
    finish(runs)
    where = wait_complete(shards, runs)
    assert all(len(stores) == 1 for stores in where.values()), where  # none split, none in two stores
    used = {stores[0] for stores in where.values()}
    assert len(used) >= 2, where  # the runs are spread over the bridges
    for g in shards.gateways:  # and every gateway carried spans of them
        assert g.metric("otelcol_receiver_accepted_spans") > 0, g.log()


def test_removing_a_bridge_mid_run_moves_its_runs_without_loss(shards):
    runs = run_trainers(shards, "move", steps=16, step_pause_s=0.3)
    try:
        # mid-run: the first bridge that has data of these runs is removed
        def first_with_data():
            return next((i for i, s in enumerate(shards.stores) if mlflow_snapshot(s, runs[0].project)), None)

        assert wait_until(lambda: None if first_with_data() is not None else "nothing", 90, 0.5) is None
        victim = first_with_data()
        assert any(r.proc.poll() is None for r in runs)
        shards.bridges[victim].terminate(60)  # what it acknowledged it writes before it exits
        hosts = [b.grpc for i, b in enumerate(shards.bridges) if i != victim]
        for g in shards.gateways:
            (g.cwd / f"{g.name}-extra.yaml").write_text(json.dumps(gateway_extra(hosts)))
            g.reload()
    finally:
        finish(runs)
    where = wait_complete(shards, runs)
    moved = {rid: stores for rid, stores in where.items() if victim in stores}
    stayed = {rid: stores for rid, stores in where.items() if victim not in stores}
    assert moved, where
    # the other bridges' runs stay where they were (consistent hashing); the removed bridge's runs go on in
    # exactly one other bridge's store
    assert all(len(s) == 1 for s in stayed.values()), where
    assert all(len(s) <= 2 for s in moved.values()), where
    for g in shards.gateways:
        assert "Config updated, restart service" in g.log_path.read_text(errors="replace"), g.log()
