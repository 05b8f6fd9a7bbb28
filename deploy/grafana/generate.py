"""Generate the Grafana dashboards of deploy/ from Python: ``deploy/grafana/dashboards/*.json``.

    .venv/bin/python deploy/grafana/generate.py            # rewrite the committed JSON
    .venv/bin/python deploy/grafana/generate.py --check    # exit 1 if the committed JSON is stale
    .venv/bin/python deploy/grafana/generate.py --out DIR  # write elsewhere

Built with the Grafana Foundation SDK (PyPI distribution ``grafana-foundation-sdk``, import name
``grafana_foundation_sdk``): the only extra dependency, needed to regenerate, not to use the JSON.
``tests/deploy/test_dashboards.py`` regenerates into a temporary folder and fails when the committed files
drift, then runs every PromQL expression of every panel against a real Prometheus.

Metric names: the Prometheus names the OpenTelemetry exporters give otel-rl's instruments
(docs/metrics.md): a ``log()`` key ``actor/pg_loss`` is the gauge ``rl_train_actor_pg_loss``; histograms
have ``_bucket/_sum/_count`` and unit suffixes; counters ``_total``.  Every series of a training run carries
the run identity labels ``rl_project_name``, ``rl_experiment_name`` and ``rl_run_id`` — the three template
variables.  Series of ``otel-rl bridge``'s own endpoint have no ``rl_run_id`` label.

Datasources (provisioned in deploy/grafana/provisioning/datasources/datasources.yaml, fixed uids):
``prometheus`` and ``tempo``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.parse
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, stat, table, tempo, timeseries
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "dashboards")

PROMETHEUS_UID = "prometheus"
TEMPO_UID = "tempo"
PROMETHEUS = dm.DataSourceRef(type_val="prometheus", uid=PROMETHEUS_UID)
TEMPO = dm.DataSourceRef(type_val="tempo", uid=TEMPO_UID)

# the run identity of every training series, narrowed by the template variables
RUN = 'rl_project_name=~"$project", rl_experiment_name=~"$experiment", rl_run_id=~"$run"'
# series of the bridge's own endpoint: no run identity
BRIDGE = 'rl_run_id=""'
RATE = "$__rate_interval"
LEGEND_RUN = "{{rl_experiment_name}} {{rl_run_id}}"


def train(key: str) -> str:
    """The Prometheus name of a ``log()`` key (the exporter's rule: runs of other characters -> ``_``)."""
    return "rl_train_" + re.sub(r"[^A-Za-z0-9:]+", "_", key)


def gauge(key: str) -> str:
    return f"{train(key)}{{{RUN}}}"


# ----------------------------------------------------------------------------- trace links


def traceql(*conditions: str) -> str:
    """A TraceQL span set of one run (the variables) and the given conditions."""
    base = ['resource.rl.project.name =~ "${project:regex}"', 'resource.rl.experiment.name =~ "${experiment:regex}"',
            'resource.rl.run.id =~ "${run:regex}"']
    return "{ " + " && ".join(base + list(conditions)) + " }"


def explore_url(query: str) -> str:
    """A Grafana Explore URL running a TraceQL search on the Tempo datasource over the dashboard's time range.

    The JSON is percent-encoded except the ``${...}`` variables, which Grafana replaces when the link is
    followed.
    """
    pane = {"traces": {"datasource": TEMPO_UID, "queries": [
        {"refId": "A", "datasource": {"type": "tempo", "uid": TEMPO_UID}, "queryType": "traceql", "query": query,
         "limit": 20, "tableType": "traces"}], "range": {"from": "${__from}", "to": "${__to}"}}}
    text = json.dumps(pane, separators=(",", ":"), sort_keys=True)
    parts = re.split(r"(\$\{[^}]+\})", text)
    encoded = "".join(p if p.startswith("${") else urllib.parse.quote(p, safe="") for p in parts)
    return "/explore?schemaVersion=1&orgId=1&panes=" + encoded


def trace_link(title: str, query: str) -> db.DashboardLink:
    return db.DashboardLink(title).type(dm.DashboardLinkType.LINK).url(explore_url(query)).target_blank(True) \
        .tooltip("Search these trajectories in Tempo")


# ----------------------------------------------------------------------------- panels


class Builder:
    """Panels with sequential ids and refIds, laid out by the SDK (24 columns)."""

    def __init__(self) -> None:
        self.next_id = 1

    def row(self, title: str) -> db.Row:
        return db.Row(title).id(self._id())

    def _id(self) -> int:
        n = self.next_id
        self.next_id += 1
        return n

    @staticmethod
    def _targets(queries: list[tuple[str, str]], exemplar: bool = False,
                 fmt: pm.PromQueryFormat | None = None) -> list[prom.Dataquery]:
        out = []
        for i, (expr, legend) in enumerate(queries):
            q = prom.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i)).datasource(PROMETHEUS)
            q = q.range()  # range queries: a finished run still shows its last values
            if exemplar:
                q = q.exemplar(True)
            if fmt is not None:
                q = q.format(fmt)
            out.append(q)
        return out

    def ts(self, title: str, queries: list[tuple[str, str]], description: str, unit: str = "short",
           span: int = 8, stack: bool = False, links: list[db.DashboardLink] | None = None,
           exemplar: bool = False, min_val: float | None = None) -> timeseries.Panel:
        p = (timeseries.Panel().id(self._id()).title(title).description(description).datasource(PROMETHEUS)
             .targets(self._targets(queries, exemplar=exemplar)).unit(unit).height(8).span(span)
             .line_width(1).fill_opacity(10 if not stack else 60).show_points(common.VisibilityMode.NEVER)
             .span_nulls(True)
             .legend(cb.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE)))
        if stack:
            p = p.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL))
        if min_val is not None:
            p = p.min(min_val)
        if links:
            p = p.links(links)
        return p

    def stat(self, title: str, queries: list[tuple[str, str]], description: str, unit: str = "short",
             span: int = 4) -> stat.Panel:
        return (stat.Panel().id(self._id()).title(title).description(description).datasource(PROMETHEUS)
                .targets(self._targets(queries)).unit(unit).height(4).span(span)
                .graph_mode(common.BigValueGraphMode.NONE)
                .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))

    def heatmap(self, title: str, expr: str, description: str, unit: str = "s",
                links: list[db.DashboardLink] | None = None) -> heatmap.Panel:
        p = (heatmap.Panel().id(self._id()).title(title).description(description).datasource(PROMETHEUS)
             .targets(self._targets([(expr, "{{le}}")], fmt=pm.PromQueryFormat.HEATMAP)).height(8).span(24)
             .calculate(False).y_axis(heatmap.YAxisConfig().unit(unit))
             .color(heatmap.HeatmapColorOptions().mode(heatmap_models().HeatmapColorMode.SCHEME)
                    .scheme("Oranges").scale(heatmap_models().HeatmapColorScale.EXPONENTIAL).exponent(0.5))
             .cell_values(heatmap.CellValues().unit("short")))
        if links:
            p = p.links(links)
        return p

    def traces(self, title: str, query: str, description: str) -> table.Panel:
        return (table.Panel().id(self._id()).title(title).description(description).datasource(TEMPO)
                .with_target(tempo.TempoQuery().ref_id("A").datasource(TEMPO).query_type("traceql").query(query)
                             .limit(20))
                .show_header(True).cell_height(common.TableCellHeight.SM).height(9).span(12))


def heatmap_models() -> Any:
    from grafana_foundation_sdk.models import heatmap as hm

    return hm


def run_variables(d: db.Dashboard) -> db.Dashboard:
    """project -> experiment -> run, from ``target_info`` (one series per process, all resource attributes)."""
    specs = [
        ("project", "Project", "label_values(target_info, rl_project_name)"),
        ("experiment", "Experiment", 'label_values(target_info{rl_project_name=~"$project"}, rl_experiment_name)'),
        ("run", "Run", 'label_values(target_info{rl_project_name=~"$project", rl_experiment_name=~"$experiment"}, '
                       'rl_run_id)'),
    ]
    for name, label, query in specs:
        d = d.with_variable(
            db.QueryVariable(name).label(label).datasource(PROMETHEUS).query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".+")
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"])))
    return d


def quantiles(metric: str, selector: str, by: str = "", legend_prefix: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    label = " ".join("{{" + b.strip() + "}}" for b in by.split(",") if b.strip())
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
             f"{legend_prefix}p{int(q * 100)} {label}".strip()) for q in (0.5, 0.9, 0.99)]


# ----------------------------------------------------------------------------- dashboards


def training_dashboard() -> db.Dashboard:
    b = Builder()
    agent_traces = traceql('span.rl.span.kind = "AGENT"')
    failed_traces = traceql('span.rl.span.kind = "AGENT"', "status = error")
    failed_tools = traceql('span.rl.span.kind = "TOOL"', "status = error")
    d = (db.Dashboard("otel-rl · RL training").uid("otel-rl-training")
         .description("RL/RLHF training runs instrumented with otel-rl: verl metric names, rollouts, tools, "
                      "generation, step timing. Generated by deploy/grafana/generate.py; do not edit by hand.")
         .tags(["otel-rl", "rl"]).refresh("30s").time("now-3h", "now").timezone("browser").editable()
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .link(db.DashboardLink("Pipeline health").type(dm.DashboardLinkType.DASHBOARDS).tags(["otel-rl"])
               .as_dropdown(False).include_vars(True).keep_time(True)))
    d = run_variables(d)

    d = d.with_row(b.row("Reward"))
    d = d.with_panel(b.ts("Reward and score (train)", [
        (gauge("critic/score/mean"), "score " + LEGEND_RUN),
        (gauge("critic/rewards/mean"), "reward " + LEGEND_RUN)],
        "verl `critic/score/mean` (sequence score) and `critic/rewards/mean` (score plus in-reward penalties), "
        "last value per step.", span=9))
    d = d.with_panel(b.ts("Validation reward", [
        (f'{{__name__=~"rl_train_val_core_.+_reward_mean_.+", {RUN}}}', "{{__name__}} " + LEGEND_RUN)],
        "Every `val-core/<data source>/reward/mean@<n>` key (verl's validation metrics).", span=9))
    d = d.with_panel(b.stat("Global step", [
        (f'max by (rl_experiment_name, rl_run_id) ({gauge("training/global_step")})', LEGEND_RUN)],
        "Last `training/global_step` logged.", span=3))
    d = d.with_panel(b.stat("Trajectories finished", [
        (f"sum by (rl_experiment_name, rl_run_id) (rl_trajectories_total{{{RUN}}})", LEGEND_RUN)],
        "All trajectories of the run, sampled for tracing or not (`rl.trajectories`).", span=3))

    d = d.with_row(b.row("Policy"))
    d = d.with_panel(b.ts("KL", [(gauge("actor/kl_loss"), "kl_loss " + LEGEND_RUN),
                                 (gauge("actor/ppo_kl"), "ppo_kl " + LEGEND_RUN)],
                          "`actor/kl_loss` (KL to the reference policy, as a loss term) and `actor/ppo_kl` "
                          "(approximate KL between the rollout and the updated policy)."))
    d = d.with_panel(b.ts("Entropy", [(gauge("actor/entropy"), LEGEND_RUN)], "`actor/entropy` of the rollout policy."))
    d = d.with_panel(b.ts("Policy-gradient loss", [(gauge("actor/pg_loss"), LEGEND_RUN)], "`actor/pg_loss`."))
    d = d.with_panel(b.ts("Clip fraction", [(gauge("actor/pg_clipfrac"), "clipfrac " + LEGEND_RUN),
                                            (gauge("actor/pg_clipfrac_lower"), "clipfrac_lower " + LEGEND_RUN)],
                          "`actor/pg_clipfrac`: fraction of tokens where the PPO ratio was clipped; "
                          "`actor/pg_clipfrac_lower`: dual-clip on negative advantages.", unit="percentunit"))
    d = d.with_panel(b.ts("Gradient norm", [(gauge("actor/grad_norm"), LEGEND_RUN)],
                          "`actor/grad_norm` (before clipping)."))
    d = d.with_panel(b.ts("Learning rate", [(gauge("actor/lr"), LEGEND_RUN)], "`actor/lr`."))

    d = d.with_row(b.row("Rollouts"))
    d = d.with_panel(b.ts("Response and prompt length", [
        (gauge("response_length/mean"), "response mean " + LEGEND_RUN),
        (gauge("response_length/max"), "response max " + LEGEND_RUN),
        (gauge("prompt_length/mean"), "prompt mean " + LEGEND_RUN)],
        "`response_length/mean|max`, `prompt_length/mean` in tokens."))
    d = d.with_panel(b.ts("Turns and tool calls per trajectory", [
        (gauge("num_turns/mean"), "turns " + LEGEND_RUN),
        (gauge("tool_call_counts/mean"), "tool calls " + LEGEND_RUN)],
        "`num_turns/mean` and `tool_call_counts/mean` over the step's trajectories."))
    d = d.with_panel(b.ts("Tool error rate (traced calls)", [
        (f"(sum by (gen_ai_tool_name) (rate(rl_tool_errors_total{{{RUN}}}[{RATE}])) "
         f"or 0 * sum by (gen_ai_tool_name) (rate(rl_tool_calls_total{{{RUN}}}[{RATE}]))) / "
         f"sum by (gen_ai_tool_name) (rate(rl_tool_calls_total{{{RUN}}}[{RATE}]))", "{{gen_ai_tool_name}}")],
        "Failed / all traced tool calls per tool (`rl.tool.errors` / `rl.tool.calls`; 0 while none failed). "
        "Only traced calls are counted: calls of sampled trajectories, and the failed call of an unsampled "
        "trajectory that failed; with `max_samples_per_step_per_worker` set the rate reads high.",
        unit="percentunit", links=[trace_link("Failed tool calls in Tempo", failed_tools)]))
    d = d.with_panel(b.ts("Tool calls per second", [
        (f"sum by (gen_ai_tool_name) (rate(rl_tool_calls_total{{{RUN}}}[{RATE}]))", "{{gen_ai_tool_name}}")],
        "Traced tool calls per second, by tool.", unit="ops"))
    d = d.with_panel(b.ts("Trajectories per second", [
        (f"sum by (outcome, rl_validate) (rate(rl_trajectories_total{{{RUN}}}[{RATE}]))",
         "{{outcome}} validate={{rl_validate}}")],
        "Finished trajectories per second by outcome (ok/error) and validation flag; all trajectories, "
        "sampled or not.", unit="ops", links=[trace_link("Failed trajectories in Tempo", failed_traces)]))
    d = d.with_panel(b.ts("Trajectory latency (train)", quantiles(
        "rl_trajectory_duration_seconds", f'{RUN}, rl_validate="false"'),
        "Quantiles of the wall time of one trajectory (`rl.trajectory.duration`, buckets 5 ms .. 600 s). "
        "Exemplars, when the source attaches them, link to the trace in Tempo.", unit="s",
        exemplar=True, links=[trace_link("Trajectories in Tempo", agent_traces)]))
    d = d.with_panel(b.heatmap("Trajectory latency distribution",
                               f"sum by (le) (increase(rl_trajectory_duration_seconds_bucket{{{RUN}}}[{RATE}]))",
                               "Trajectories per duration bucket over time (train and validation).",
                               links=[trace_link("Trajectories in Tempo", agent_traces)]))

    d = d.with_row(b.row("Generation"))
    d = d.with_panel(b.ts("Generation throughput", [
        (gauge("perf/throughput"), "perf/throughput " + LEGEND_RUN),
        (f'sum by (rl_experiment_name, rl_run_id) (rate(gen_ai_client_token_usage_sum{{{RUN}, '
         f'gen_ai_token_type="output"}}[{RATE}]))', "traced output tokens/s " + LEGEND_RUN)],
        "`perf/throughput` (verl: tokens processed per second of the step) and the output tokens per second "
        "of traced generations (`gen_ai.client.token.usage`).", unit="short"))
    d = d.with_panel(b.ts("Generation latency (traced)", quantiles(
        "gen_ai_client_operation_duration_seconds", RUN, by="gen_ai_request_model"),
        "Quantiles of the wall time of one traced generation (`gen_ai.client.operation.duration`).", unit="s",
        exemplar=True))
    d = d.with_panel(b.ts("Tokens per generation (traced)", [
        (f"histogram_quantile(0.5, sum by (le, gen_ai_token_type) "
         f"(rate(gen_ai_client_token_usage_bucket{{{RUN}}}[{RATE}])))", "p50 {{gen_ai_token_type}}"),
        (f"histogram_quantile(0.9, sum by (le, gen_ai_token_type) "
         f"(rate(gen_ai_client_token_usage_bucket{{{RUN}}}[{RATE}])))", "p90 {{gen_ai_token_type}}")],
        "Input and output tokens per traced generation (buckets 1, 4, 16 .. 1M).", unit="short"))

    d = d.with_row(b.row("Step time"))
    d = d.with_panel(b.ts("Step time breakdown", [
        (f'label_replace({{__name__=~"rl_train_timing_s_.+", __name__!="rl_train_timing_s_step", {RUN}}}, '
         f'"phase", "$1", "__name__", "rl_train_timing_s_(.+)")', "{{phase}} {{rl_run_id}}")],
        "Every `timing_s/<phase>` of the step (verl: gen, reward, old_log_prob, ref, adv, update_actor, testing), "
        "stacked; `timing_s/step` is the whole step.", unit="s", span=16, stack=True))
    d = d.with_panel(b.ts("Step time", [(gauge("timing_s/step"), LEGEND_RUN)], "`timing_s/step`.", unit="s"))

    d = d.with_row(b.row("Traces (Tempo)"))
    d = d.with_panel(b.traces("Trajectories", agent_traces,
                              "Most recent trajectory traces of the selected runs (root span kind AGENT)."))
    d = d.with_panel(b.traces("Failed tool calls", failed_tools, "Tool spans that raised, with their trajectory."))
    return d


def pipeline_dashboard() -> db.Dashboard:
    b = Builder()
    d = (db.Dashboard("otel-rl · telemetry pipeline").uid("otel-rl-pipeline")
         .description("Health of otel-rl's exporters (in the trainers, per run) and of `otel-rl bridge`: queues, "
                      "retries, drops, on-disk spool. Generated by deploy/grafana/generate.py; do not edit by hand.")
         .tags(["otel-rl", "pipeline"]).refresh("30s").time("now-3h", "now").timezone("browser").editable()
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .link(db.DashboardLink("RL training").type(dm.DashboardLinkType.DASHBOARDS).tags(["otel-rl"])
               .as_dropdown(False).include_vars(True).keep_time(True)))
    d = run_variables(d)
    legend = "{{exporter}} " + LEGEND_RUN

    d = d.with_row(b.row("Trainer exporters (selected runs)"))
    d = d.with_panel(b.ts("Queued items", [(f"sum by (exporter, rl_experiment_name, rl_run_id) "
                                            f"(otel_rl_exporter_queued{{{RUN}}})", legend)],
                          "Items waiting in each exporter's delivery queue (memory and spool)."))
    d = d.with_panel(b.ts("Retried, failed, dropped", [
        (f"sum by (exporter, outcome, rl_run_id) "
         f'(rate(otel_rl_exporter_items_total{{{RUN}, outcome=~"retried|failed|dropped"}}[{RATE}]))',
         "{{exporter}} {{outcome}} {{rl_run_id}}")],
        "Items per second that needed a retry, failed an attempt, or were given up on (`dropped`: lost).",
        unit="ops"))
    d = d.with_panel(b.ts("Exported items per second", [
        (f'sum by (exporter, rl_run_id) (rate(otel_rl_exporter_items_total{{{RUN}, outcome="exported"}}[{RATE}]))',
         "{{exporter}} {{rl_run_id}}")], "Items delivered per second by each exporter.", unit="ops"))
    d = d.with_panel(b.ts("Spool size", [(f"sum by (exporter, rl_run_id) (otel_rl_exporter_spool_bytes{{{RUN}}})",
                                          "{{exporter}} {{rl_run_id}}")],
                          "Bytes of each exporter's on-disk spool (segment files); grows while a tracker is down.",
                          unit="bytes", span=12))
    d = d.with_panel(b.stat("Items dropped", [(f'sum(otel_rl_exporter_items_total{{{RUN}, outcome="dropped"}})',
                                               "dropped")],
                            "Items given up on by the trainers' exporters of the selected runs (since start).",
                            span=6))
    d = d.with_panel(b.stat("Items queued", [(f"sum(otel_rl_exporter_queued{{{RUN}}})", "queued")],
                            "Items waiting now.", span=6))

    d = d.with_row(b.row("otel-rl bridge"))
    d = d.with_panel(b.ts("Bridge requests per second", [
        (f"sum by (transport, signal, outcome, reason) (rate(otel_rl_bridge_requests_total[{RATE}]))",
         "{{transport}} {{signal}} {{outcome}} {{reason}}")],
        "OTLP requests received by `otel-rl bridge`, accepted or rejected (with the reason).", unit="reqps"))
    d = d.with_panel(b.ts("Bridge spans per second", [
        (f"sum by (outcome) (rate(otel_rl_bridge_spans_total[{RATE}]))", "{{outcome}}")],
        "Spans received by the bridge.", unit="ops"))
    d = d.with_panel(b.ts("Bridge backlog", [("sum(otel_rl_bridge_pipeline_backlog)", "backlog"),
                                             (f"sum by (exporter) (otel_rl_exporter_queued{{{BRIDGE}}})",
                                              "queued {{exporter}}")],
                          "Spans waiting for the bridge's pipeline plus its longest exporter queue; items queued per "
                          "exporter (`forward`: KiB). Near `--queue-size` the bridge answers 503 / UNAVAILABLE."))
    d = d.with_panel(b.ts("Bridge retried, failed, dropped", [
        (f'sum by (exporter, outcome) (rate(otel_rl_exporter_items_total{{{BRIDGE}, '
         f'outcome=~"retried|failed|dropped"}}[{RATE}]))', "{{exporter}} {{outcome}}"),
        (f"sum(rate(otel_rl_bridge_pipeline_dropped_total[{RATE}]))", "pipeline dropped")],
        "Per second, for each tracker exporter of the bridge.", unit="ops"))
    d = d.with_panel(b.ts("Bridge delivery latency", quantiles(
        "otel_rl_bridge_delivery_latency_seconds", "", by="exporter"),
        "From span end in the trainer to delivered by the bridge's exporter.", unit="s"))
    d = d.with_panel(b.stat("Runs seen by the bridge", [("sum(otel_rl_bridge_runs)", "runs")],
                            "Distinct run identities the bridge has received.", span=8))
    return d


DASHBOARDS = {"otel-rl-training.json": training_dashboard, "otel-rl-pipeline.json": pipeline_dashboard}


def render(build: Any) -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def write_all(out_dir: str = OUT_DIR) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, build in DASHBOARDS.items():
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(build))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT_DIR, help="output folder (default: deploy/grafana/dashboards)")
    ap.add_argument("--check", action="store_true", help="compare with the files in --out instead of writing")
    args = ap.parse_args(argv)
    if args.check:
        stale = []
        for name, build in DASHBOARDS.items():
            path = os.path.join(args.out, name)
            try:
                with open(path, encoding="utf-8") as f:
                    current = f.read()
            except FileNotFoundError:
                current = None
            if current != render(build):
                stale.append(path)
        for path in stale:
            print(f"stale: {path} (run: .venv/bin/python deploy/grafana/generate.py)", file=sys.stderr)
        return 1 if stale else 0
    for path in write_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
