"""The Grafana dashboards of deploy/ against real data.

A real Prometheus server (127.0.0.1, 0.5 s scrapes) scrapes, at the same time:

- ``otel-rl demo --prometheus-port`` — a real GRPO training on CPU (60 steps, a few seconds), logging verl's
  metric names (when ``otel_rl.demo`` is installed);
- a short in-test GRPO-shaped workload through ``otel_rl``'s API that logs the same names and also has what the
  demo never produces: tool calls that raise, failed trajectories kept while unsampled, a spooled exporter;
- the endpoint of a real ``otel-rl bridge`` that receives both runs' OTLP and forwards it to a sink here.

Then EVERY PromQL expression of EVERY panel of the generated dashboards runs through Prometheus's HTTP API
(``query_range`` over the runs) with the template variables set to each run's identity and to "All", and must
return data — a panel without data fails by name.  Tempo panels and trace links are checked against the spans
the bridge forwarded.  docs/metrics.md must name every series the endpoints really serve.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest

from . import _stack as S

DASHBOARDS = S.load_dashboards()
PANELS = [(name, p) for name, d in DASHBOARDS.items() for p in S.panels(d)]
PANEL_IDS = [f"{name.removesuffix('.json')}:{p['title']}" for name, p in PANELS]
LINKS = [(name, p, link) for name, p in PANELS for link in p.get("links") or []]
LINK_IDS = [f"{name.removesuffix('.json')}:{p['title']}:{link['title']}" for name, p, link in LINKS]


@dataclass
class Live:
    prom: S.Prometheus
    sink: S.OtlpSink
    handle: Any
    bridge: S.Bridge
    run_id: str
    t0: float
    t1: float
    spool: bool
    trainer_url: str
    demo: S.Demo | None
    demo_keys: set


def _spool_supported() -> bool:
    from otel_rl import semconv as sc
    from otel_rl.config import Config

    return hasattr(sc, "METRIC_EXPORT_SPOOL_BYTES") and "spool_dir" in Config.__dataclass_fields__


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Prometheus scraping (every 0.5 s) the in-test workload's endpoint, `otel-rl demo`'s endpoint (when the
    demo exists) and the bridge's; both workloads send OTLP to the bridge, which forwards it to the sink."""
    binary = S.find_prometheus()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("the prometheus binary is required in CI (apt-get install prometheus)")
        pytest.skip("no prometheus binary on PATH (apt-get install prometheus)")
    import otel_rl

    tmp = tmp_path_factory.mktemp("deploy")
    sink = S.OtlpSink()
    bridge = prom = handle = demo = None
    with pytest.MonkeyPatch.context() as mp:
        for k in list(os.environ):
            if k.startswith("OTEL_") or k.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
                mp.delenv(k, raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        mp.setenv("no_proxy", "127.0.0.1,localhost")
        try:
            bridge = S.Bridge(tmp, sink.url)
            trainer_port, demo_port = S.free_port(), S.free_port()
            targets = {"otel-rl-trainer": f"127.0.0.1:{trainer_port}", "otel-rl-bridge": bridge.prometheus}
            if S.demo_available():
                targets["otel-rl-demo"] = f"127.0.0.1:{demo_port}"
            prom = S.Prometheus(binary, tmp, targets)
            spool = _spool_supported()
            t0 = time.time()
            if "otel-rl-demo" in targets:  # runs while the in-test workload runs
                # Prometheus's first scrape comes seconds after its start, and the demo's endpoint closes
                # with its run (a few seconds of --quick steps): start the demo once Prometheus scrapes
                deadline = time.monotonic() + 60
                while prom.targets_up().get("otel-rl-bridge") != "up":
                    assert time.monotonic() < deadline, "Prometheus never scraped the bridge:\n" + prom.log()
                    time.sleep(0.2)
                demo = S.Demo(tmp, demo_port, bridge.http)
            handle = S.run_workload(trainer_port, bridge.http, str(tmp / "spool") if spool else None)
            run_id = handle.run_id
            demo_keys: set = set()
            if demo is not None:
                rc = demo.wait(300)
                assert rc == 0, "otel-rl demo failed:\n" + demo.log()
                demo_keys = demo.logged_keys()
            # until Prometheus has scraped the final state of the endpoints still up
            want = f'rl_train_training_global_step{{rl_run_id="{run_id}"}} == {S.STEPS}'
            deadline = time.monotonic() + 30
            while not prom.api("query", query=want)["result"] or \
                    not prom.api("query", query="otel_rl_bridge_spans_total > 0")["result"]:
                assert time.monotonic() < deadline, "Prometheus never scraped the final step:\n" + prom.log()
                time.sleep(0.5)
            time.sleep(1.5)
            yield Live(prom, sink, handle, bridge, run_id, t0, time.time(), spool, f"http://127.0.0.1:{trainer_port}",
                       demo, demo_keys)
        finally:
            if handle is not None:
                handle.shutdown(10)
            elif otel_rl.current() is not None:
                otel_rl.current().shutdown(5)
            for x in (demo, prom, bridge):
                if x is not None:
                    x.close()
            sink.close()


RUNS = ["workload", "demo", "all"]
# panels and links that show failures only: `otel-rl demo`'s calculator never raises
FAILURES_ONLY = {"Failed tool calls", "Failed tool calls in Tempo", "Failed trajectories in Tempo"}


def _values(live: Live, run: str, dashboard: dict) -> dict[str, str]:
    if run == "all":
        return {v["name"]: v.get("allValue") or ".*" for v in dashboard["templating"]["list"]}
    if run == "demo":
        if live.demo is None:
            pytest.skip("otel_rl.demo is not installed: the in-test workload stands in for it")
        from otel_rl.demo.config import build_config

        cfg = build_config([])
        return {"project": _regex(cfg["trainer"]["project_name"]),
                "experiment": _regex(cfg["trainer"]["experiment_name"]), "run": _regex(S.DEMO_RUN_ID)}
    return {"project": _regex(S.PROJECT), "experiment": _regex(S.EXPERIMENT), "run": _regex(live.run_id)}


def _regex(value: str) -> str:
    """A variable value as Grafana puts it into a quoted regex matcher: regex-escaped, then string-escaped."""
    return re.escape(value).replace("\\", "\\\\")


def _finite(result: list[dict]) -> bool:
    for series in result:
        points = series.get("values") or ([series["value"]] if "value" in series else [])
        if any(math.isfinite(float(v)) for _, v in points):
            return True
    return False


# ----------------------------------------------------------------------------- the endpoints


@pytest.mark.slow
def test_the_endpoints_are_scraped_healthy(live):
    up = live.prom.targets_up()
    assert up["otel-rl-trainer"] == up["otel-rl-bridge"] == "up", (up, live.prom.log())
    if live.demo is not None:  # its endpoint closed with the run; it was scraped while it ran
        got = live.prom.api("query_range", query='up{job="otel-rl-demo"} == 1', start=live.t0, end=live.t1, step=1)
        assert _finite(got["result"]), "Prometheus never scraped otel-rl demo:\n" + live.demo.log()


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS[:2])
@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_template_variables_list_the_run(live, name, run):
    """Each variable's ``label_values(selector, label)`` (with the variables before it set) lists the run's
    value, through the same API Grafana uses."""
    values = _values(live, run, DASHBOARDS[name])
    for var in DASHBOARDS[name]["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
        assert m, var["query"]
        selector, label = S.substitute(m.group(1), values), m.group(2)
        got = live.prom.api(f"label/{label}/values", **{"match[]": selector, "start": live.t0, "end": live.t1})
        want = re.sub(r"\\(.)", r"\1", values[var["name"]])  # the string literal's value: the regex
        assert any(re.fullmatch(want, g) for g in got), (var["name"], selector, got)
        assert var["allValue"] == ".+", "'All' must not match series without the label (the bridge's)"


@pytest.mark.slow
@pytest.mark.parametrize("name,panel", PANELS, ids=PANEL_IDS)
@pytest.mark.parametrize("run", RUNS)
def test_every_panel_query_returns_data(live, name, panel, run):
    values = _values(live, run, DASHBOARDS[name])
    for target in panel["targets"]:
        ds = (target.get("datasource") or panel.get("datasource") or {}).get("type")
        if ds == "tempo":
            query = S.substitute(target["query"], values)
            if run == "demo" and panel["title"] in FAILURES_ONLY:
                pytest.skip("otel-rl demo's calculator never fails")
            assert matching_spans(query, live.sink.spans()), \
                f"panel {panel['title']!r}: no forwarded span matches the TraceQL {query}"
            continue
        assert ds == "prometheus", (panel["title"], target)
        assert not target.get("instant"), "range queries only: a finished run must still show"
        expr = S.substitute(target["expr"], values)
        result = live.prom.api("query_range", query=expr, start=live.t0, end=live.t1, step=1)["result"]
        if not _finite(result) and "spool_bytes" in expr and not live.spool:
            pytest.skip("this otel-rl has no on-disk spool (otel_rl.exporter.spool.bytes)")
        assert _finite(result), f"panel {panel['title']!r} ({name}, {run}): no data for {expr}\n{result}"


# ----------------------------------------------------------------------------- traces


def _traceql_conditions(query: str) -> list[tuple[str, str, str, str]]:
    """The subset of TraceQL the dashboards use: ``{ a && b && ... }`` with ``resource.x|span.x op "v"`` and
    ``status = error|ok``; returns [(scope, attribute, op, value)]."""
    m = re.fullmatch(r"\s*\{(.*)\}\s*(\|.*)?", query, re.S)
    assert m, f"not a span set: {query}"
    out = []
    for part in m.group(1).split("&&"):
        part = part.strip()
        c = re.fullmatch(r'(resource|span)\.([\w.]+)\s*(=~|!=|=)\s*"((?:[^"\\]|\\.)*)"', part)
        if c:
            out.append((c.group(1), c.group(2), c.group(3), re.sub(r"\\(.)", r"\1", c.group(4))))
            continue
        c = re.fullmatch(r"status\s*=\s*(error|ok|unset)", part)
        assert c, f"unsupported TraceQL condition {part!r} in {query}"
        out.append(("status", "", "=", c.group(1)))
    return out


def matching_spans(query: str, spans: list) -> list:
    conds = _traceql_conditions(query)
    status_names = {0: "unset", 1: "ok", 2: "error"}
    out = []
    for res, attrs, span in spans:
        ok = True
        for scope, key, op, want in conds:
            if scope == "status":
                ok = status_names.get(span.status.code) == want
            else:
                got = (res if scope == "resource" else attrs).get(key)
                got = None if got is None else str(got)
                if op == "=":
                    ok = got == want
                elif op == "!=":
                    ok = got != want
                else:
                    ok = got is not None and re.fullmatch(want, got) is not None
            if not ok:
                break
        if ok:
            out.append(span)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,panel,link", LINKS, ids=LINK_IDS)
@pytest.mark.parametrize("run", RUNS)
def test_trace_links_find_the_runs_spans(live, name, panel, link, run):
    """Panel links open a TraceQL search in Grafana Explore on the Tempo datasource; the search finds spans."""
    url = urllib.parse.urlsplit(link["url"])
    assert url.path == "/explore"
    raw = urllib.parse.parse_qs(url.query)["panes"][0]
    panes = json.loads(raw)
    (pane,) = panes.values()
    (query,) = pane["queries"]
    assert pane["datasource"] == query["datasource"]["uid"] == "tempo" and query["queryType"] == "traceql"
    assert pane["range"] == {"from": "${__from}", "to": "${__to}"}
    traceql = S.substitute(query["query"], _values(live, run, DASHBOARDS[name]))
    if run == "demo" and link["title"] in FAILURES_ONLY:
        pytest.skip("otel-rl demo's calculator never fails")
    assert matching_spans(traceql, live.sink.spans()), f"{panel['title']!r} link {link['title']!r}: {traceql}"


# ----------------------------------------------------------------------------- the metrics contract


def _scrape(url: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


@pytest.mark.slow
def test_docs_metrics_names_every_series_the_endpoints_serve(live):
    """docs/metrics.md is checked against the real exporter: each series name of the trainer's and the bridge's
    endpoints is in it (``rl_train_*`` by its rule), and no series carries a step or sample label."""
    doc = (S.ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`([a-z_:][a-z0-9_:]*)(?:\{[^`]*\})?`", doc))
    samples = _scrape(live.trainer_url) + _scrape("http://" + live.bridge.prometheus)
    names = {n for n, _, _ in samples}
    fixed = {n for n in names if not n.startswith("rl_train_")}
    missing = sorted(n for n in fixed if n not in documented)
    assert not missing, f"docs/metrics.md does not name: {missing}"
    # the rule for log() keys, applied to the workload's keys (the exporter's own sanitising)
    logged = live.handle.exporters[[e.name for e in live.handle.exporters].index("memory")].metrics_by_step()
    keys = {k for d in logged.values() for k in d}
    for key in keys:
        assert "rl_train_" + re.sub(r"[^A-Za-z0-9:]+", "_", key) in names, key
    if live.demo is not None:  # every key `otel-rl demo` logged (its JSONL file) by the same rule
        assert live.demo_keys, live.demo.log()
        got = {s["__name__"] for s in live.prom.api("series", **{"match[]": f'{{rl_run_id="{S.DEMO_RUN_ID}"}}',
                                                                     "start": live.t0, "end": live.t1})}
        missing = sorted(k for k in live.demo_keys if "rl_train_" + re.sub(r"[^A-Za-z0-9:]+", "_", k) not in got)
        assert not missing, f"demo keys without their series: {missing}"
    bad = {lab for _, labels, _ in samples for lab in labels} & {"step", "rl_step", "sample_index", "rl_sample_index",
                                                                 "rollout_n", "rl_rollout_n", "trace_id", "span_id"}
    assert not bad, f"per-step/per-sample labels would explode cardinality: {bad}"
    # run identity on every training series of the trainer
    for name, labels, _ in _scrape(live.trainer_url):
        if name != "target_info":
            assert {"rl_project_name", "rl_experiment_name", "rl_run_id"} <= set(labels), (name, labels)


@pytest.mark.slow
def test_histogram_buckets_are_the_documented_ones(live):
    from otel_rl._instruments import SECONDS_BUCKETS, TOKEN_BUCKETS

    doc = (S.ROOT / "docs" / "metrics.md").read_text()
    samples = _scrape(live.trainer_url)

    def les(name: str) -> list[float]:
        return sorted({float(lab["le"]) for n, lab, _ in samples if n == name + "_bucket"})

    assert les("rl_trajectory_duration_seconds") == [*SECONDS_BUCKETS, math.inf]
    assert les("gen_ai_client_operation_duration_seconds") == [*SECONDS_BUCKETS, math.inf]
    assert les("gen_ai_client_token_usage") == [*TOKEN_BUCKETS, math.inf]
    from otel_rl.bridge.core import LATENCY_BUCKETS

    bridge = _scrape("http://" + live.bridge.prometheus)
    assert sorted({float(lab["le"]) for n, lab, _ in bridge if n == "otel_rl_bridge_delivery_latency_seconds_bucket"}) \
        == [*LATENCY_BUCKETS, math.inf]
    for buckets in (SECONDS_BUCKETS, TOKEN_BUCKETS, LATENCY_BUCKETS):
        text = ", ".join(str(int(b)) if float(b).is_integer() else f"{b:g}" for b in buckets)
        assert text in doc, f"docs/metrics.md should list the buckets {text}"


@pytest.mark.slow
def test_tool_series_name_the_tool_also_for_failed_unsampled_trajectories(live):
    """A failed tool call of an unsampled trajectory is re-emitted with its span kind only; its counters still
    carry the tool's name (from the span name ``execute_tool <name>``), not an empty label."""
    spans = live.sink.spans()
    kept = [a for r, a, s in spans if r.get("rl.run.id") == live.run_id and a.get("rl.sampled") is False]
    assert kept, "the workload should have failed unsampled trajectories"
    series = [lab for n, lab, _ in _scrape(live.trainer_url) if n in ("rl_tool_calls_total", "rl_tool_errors_total")]
    assert series and {lab["gen_ai_tool_name"] for lab in series} == {"calculator"}, series
