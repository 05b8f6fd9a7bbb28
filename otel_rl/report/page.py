"""The report page: one HTML file with plotly.js embedded (opens without a network).

verl's metric names drive the layout (`LAYOUT`): reward and validation reward first, then the policy
(KL, entropy, loss, clip fraction), responses, tools, the ``timing_s/*`` breakdown as a stacked area
and throughput; every other key lands in a chart of its prefix (``actor/...``, ``critic/...``).
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
import re
from typing import Any

from .data import RunData, TrajectoryView

#: (section, [(chart title, [key patterns])]); a key goes to the first chart whose pattern matches it
LAYOUT: list[tuple[str, list[tuple[str, list[str]]]]] = [
    (
        "Reward",
        [
            ("Training reward (critic/score) and validation reward", [r"^critic/score/mean$", r"^val-core/.*reward.*"]),
            ("Training reward spread (critic/score)", [r"^critic/score/(max|min)$"]),
            ("Reward (critic/rewards)", [r"^critic/rewards/"]),
        ],
    ),
    (
        "Policy",
        [
            ("KL", [r"^actor/(ppo_kl|kl_loss)$", r"^critic/kl$", r"^actor/kl$"]),
            ("Entropy", [r"^actor/entropy$"]),
            ("Policy loss", [r"^actor/pg_loss$"]),
            ("Clip fraction", [r"^actor/(pg_clipfrac|pg_clipfrac_lower|ppo_clipfrac)$"]),
        ],
    ),
    (
        "Responses",
        [
            ("Response length", [r"^response_length/(mean|max|min)$"]),
            ("Response clip ratio", [r"^response_length/clip_ratio$"]),
            ("Prompt length", [r"^prompt_length/"]),
        ],
    ),
    (
        "Tools and turns",
        [
            ("Tool calls per trajectory", [r"^tool_call_counts/"]),
            ("Tool error rate", [r"tool.*error", r"error.*tool"]),
            ("Turns per trajectory", [r"^num_turns/"]),
        ],
    ),
    ("Validation", [("Validation metrics (val-core, val-aux)", [r"^val-(core|aux)/"])]),
    (
        "Time and throughput",
        [
            ("Time per step by stage (timing_s/*)", [r"^timing_s/"]),
            ("Throughput (tokens/s)", [r"^perf/throughput$"]),
            ("Time per step", [r"^perf/time_per_step$"]),
            ("Tokens per step", [r"^perf/total_num_tokens$"]),
        ],
    ),
]
STACKED = "Time per step by stage (timing_s/*)"
#: the stage total drawn over the stacked stages, not stacked itself
TIMING_TOTAL = "timing_s/step"
LINES_WITH_MARKERS = 60  # fewer points than this: markers on the lines


@dataclasses.dataclass
class Chart:
    section: str
    title: str
    keys: list[str]
    stacked: bool = False


def plan(metrics: dict[str, dict[int, Any]]) -> list[Chart]:
    """The charts for these metric series, in page order; no key is left out.

    A ``timing_s/*`` key is stacked when it was logged at a step that has ``timing_s/step`` (a stage of the
    step); one logged only at other steps (``timing_s/pretrain`` before training) gets a chart of its own.
    """
    left = list(metrics)
    total_steps = set(metrics.get(TIMING_TOTAL, {}))
    charts: list[Chart] = []
    for section, specs in LAYOUT:
        for title, patterns in specs:
            got = [k for k in left if any(re.search(p, k) for p in patterns)]
            apart = []
            if title == STACKED and total_steps:
                apart = [k for k in got if not total_steps & set(metrics[k])]
                got = [k for k in got if k not in apart]
            if got:
                left = [k for k in left if k not in got]
                charts.append(Chart(section, title, got, stacked=title == STACKED))
            if apart:
                left = [k for k in left if k not in apart]
                charts.append(Chart(section, "Other timings (timing_s/*, outside the training steps)", apart))
    groups: dict[str, list[str]] = {}
    for k in left:
        groups.setdefault(k.split("/", 1)[0] if "/" in k else "(no prefix)", []).append(k)
    for prefix in sorted(groups):
        charts.append(Chart("Other metrics", f"{prefix}/*" if prefix != "(no prefix)" else prefix, groups[prefix]))
    return charts


def figure(chart: Chart, data: RunData) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    if chart.stacked:
        stages = [k for k in chart.keys if k != TIMING_TOTAL]
        steps = sorted({s for k in stages for s in data.metrics[k]})
        for k in stages:
            series = data.metrics[k]
            fig.add_trace(
                go.Scatter(
                    x=steps,
                    y=[series.get(s) or 0.0 for s in steps],
                    name=k.split("/", 1)[1],
                    mode="lines",
                    stackgroup="timing",
                    meta=k,
                )
            )
        if TIMING_TOTAL in chart.keys:
            series = data.metrics[TIMING_TOTAL]
            fig.add_trace(
                go.Scatter(
                    x=sorted(series),
                    y=[series[s] for s in sorted(series)],
                    name="step (total)",
                    mode="lines",
                    line={"dash": "dot", "color": "black"},
                    meta=TIMING_TOTAL,
                )
            )
        fig.update_yaxes(title_text="seconds")
    else:
        for k in chart.keys:
            series = data.metrics[k]
            xs = sorted(series)
            mode = "lines+markers" if len(xs) < LINES_WITH_MARKERS else "lines"
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[series[s] for s in xs],
                    name=k,
                    mode=mode,
                    meta=k,
                    line={"dash": "dot"} if re.search(r"/(max|min)(@|_at_|$)", k) else None,
                )
            )
    fig.update_layout(
        title={"text": chart.title, "font": {"size": 14}},
        template="plotly_white",
        height=330,
        margin={"l": 50, "r": 10, "t": 40, "b": 40},
        hovermode="x unified",
        legend={"orientation": "h", "y": -0.2, "font": {"size": 10}},
    )
    fig.update_xaxes(title_text="step")
    return fig


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2937;color:#fff;padding:16px 24px}header h1{margin:0 0 4px;font-size:20px}
header p{margin:2px 0;font-size:13px;color:#d1d5db}nav{padding:8px 24px;background:#fff;border-bottom:1px solid #ddd}
nav a{margin-right:14px;font-size:13px;color:#2563eb;text-decoration:none}main{padding:0 24px 40px}
h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:12px}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:4px}
.wide{grid-column:1/-1}.headline{font-size:14px;margin:12px 0}
table{border-collapse:collapse;font-size:12px;width:100%}td,th{border:1px solid #e5e7eb;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f3f4f6}td.v{font-family:monospace;white-space:pre-wrap;
word-break:break-all;max-width:520px}.traj{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:8px;
margin:8px 0}.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px;margin-right:6px}
.best{background:#16a34a}.worst{background:#d97706}.failed{background:#dc2626}.err{color:#dc2626}
.note{color:#92400e;font-size:13px}
"""


def _headline(data: RunData) -> str:
    parts = [f"{len(data.steps)} steps logged, {len(data.metrics)} metric keys"]
    for key, label in (("critic/score/mean", "training reward"),):
        s = data.metrics.get(key)
        vals = [(st, v) for st, v in sorted(s.items()) if v is not None] if s else []
        if len(vals) > 1:
            parts.append(f"{label} {vals[0][1]:.3g} (step {vals[0][0]}) → {vals[-1][1]:.3g} (step {vals[-1][0]})")
    for key in sorted(k for k in data.metrics if re.search(r"^val-core/.*reward", k))[:1]:
        vals = [(st, v) for st, v in sorted(data.metrics[key].items()) if v is not None]
        if len(vals) > 1:
            parts.append(
                f"validation reward {vals[0][1]:.3g} (step {vals[0][0]}) → {vals[-1][1]:.3g} (step {vals[-1][0]})"
            )
    return "; ".join(parts)


def _trajectory(t: TrajectoryView) -> str:
    e = html.escape
    reward = "no reward" if t.reward is None else f"reward {t.reward:.4g}"
    head = (
        f'<span class="badge {e(t.label)}">{e(t.label)}</span><b>step {t.step}</b> · {reward} · sample '
        f"{e(t.sample_index)} · {e(t.status)} · <code>{e(t.trace_id)}</code>"
    )
    rows = "".join(
        f'<tr><td>{i}</td><td>{e(turn.kind)}</td><td>{e(turn.name)}</td><td class="v">{e(turn.inputs)}</td>'
        f'<td class="v">{e(turn.output)}</td><td class="{"err" if turn.status == "ERROR" else ""}">'
        f"{e(turn.status)}{('<br>' + e(turn.error)) if turn.error else ''}</td></tr>"
        for i, turn in enumerate(t.turns, 1)
    )
    table = (
        (
            "<table><tr><th>#</th><th>type</th><th>span</th><th>input / prompt</th><th>output / response</th>"
            f"<th>status</th></tr>{rows}</table>"
        )
        if rows
        else "<p>no child spans</p>"
    )
    err = f'<p class="err">failed: {e(t.error)}</p>' if t.error else ""
    return f'<div class="traj" data-trace-id="{e(t.trace_id)}" data-label="{e(t.label)}">{head}{err}{table}</div>'


def render(data: RunData) -> str:
    """The whole page as one string."""
    import plotly
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    e = html.escape
    charts = plan(data.metrics)
    sections: dict[str, list[str]] = {}
    for i, chart in enumerate(charts):
        div = pio.to_html(
            figure(chart, data),
            include_plotlyjs=False,
            full_html=False,
            div_id=f"chart-{i}",
            config={"displaylogo": False, "responsive": True},
        )
        wide = " wide" if i == 0 else ""
        sections.setdefault(chart.section, []).append(
            f'<div class="card{wide}" data-chart="{e(chart.title)}" data-keys="{e(json.dumps(chart.keys))}">{div}</div>'
        )
    body = []
    for name, cards in sections.items():
        body.append(
            f'<section id="{_anchor(name)}"><h2>{e(name)}</h2><div class="grid">{"".join(cards)}</div></section>'
        )
    traj = "".join(_trajectory(t) for t in data.trajectories) or (
        "<p>No trajectories: they come from the run's MLflow traces (give <code>--mlflow-run-id</code>).</p>"
    )
    body.append(f'<section id="trajectories"><h2>Sample trajectories (best, worst, failed)</h2>{traj}</section>')
    if data.config:
        rows = "".join(f'<tr><td>{e(k)}</td><td class="v">{e(str(v))}</td></tr>' for k, v in data.config.items())
        cfg = f"<table><tr><th>key</th><th>value</th></tr>{rows}</table>"
    else:
        cfg = "<p>No config recorded with this source.</p>"
    body.append(f'<section id="config"><h2>Config</h2>{cfg}</section>')
    nav = "".join(f'<a href="#{_anchor(n)}">{e(n)}</a>' for n in list(sections) + ["Trajectories", "Config"])
    notes = "".join(f'<p class="note">{e(n)}</p>' for n in data.notes)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>otel-rl report: {e(data.title)}'
        f'</title><meta name="generator" content="otel-rl report, plotly {e(plotly.__version__)}">'
        f"<style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>{e(data.title)}</h1><p>{e(data.source)}</p><p>written {now}</p></header><nav>{nav}</nav>"
        f'<main><p class="headline">{e(_headline(data))}</p>{notes}{"".join(body)}</main></body></html>'
    )


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
