"""`otel-rl report`: the page renders in headless Chromium and every chart holds the run's values."""

from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

from otel_rl import cli
from otel_rl.report.data import read_jsonl
from otel_rl.report.page import STACKED, TIMING_TOTAL, plan

from .conftest import REPO, VENV_BIN, clean_env

CHROMIUM = [
    "chromium",
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(os.environ.get("OTEL_RL_SCREENSHOT_DIR", "/tmp/otel-rl-screenshots"))

# reads every chart's data from the live plotly graphs after they rendered, and what the SVG drew
PROBE = """<script>
window.addEventListener('load', function () { setTimeout(function () {
  var out = [];
  document.querySelectorAll('.js-plotly-plot').forEach(function (gd) {
    out.push({title: gd.layout.title.text, drawn: gd.querySelectorAll('.scatterlayer .trace').length,
      traces: gd.data.map(function (t) { return {meta: t.meta, x: Array.from(t.x), y: Array.from(t.y),
                                                  stacked: !!t.stackgroup}; })});
  });
  var pre = document.createElement('pre'); pre.id = 'otel-rl-probe'; pre.textContent = JSON.stringify({
    charts: out, trajectories: Array.from(document.querySelectorAll('.traj')).map(function (d) {
      return {trace: d.dataset.traceId, label: d.dataset.label, turns: d.querySelectorAll('tr').length - 1,
              error: (d.querySelector('p.err') || {textContent: ''}).textContent}; }),
    config_rows: document.querySelectorAll('#config tr').length - 1});
  document.body.appendChild(pre);
}, 300); });
</script>"""


def write_run(path: Path) -> dict[str, dict[int, object]]:
    """A verl-shaped JSONL run with awkward values; returns what each key should show (last value per step)."""
    lines, want = [], {}

    def log(step, data):
        lines.append(json.dumps({"step": step, "data": data}))
        for k, v in data.items():
            want.setdefault(k, {})[step] = v

    for s in range(1, 13):
        log(
            s,
            {
                "critic/score/mean": s / 12,
                "critic/score/max": 1.0,
                "critic/score/min": 0,
                "actor/ppo_kl": 0.01 * s,
                "actor/entropy": 2 - s / 10,
                "actor/pg_loss": (-1) ** s * 0.1,
                "actor/pg_clipfrac": 0.05,
                "response_length/mean": 10 + s,
                "tool_call_counts/mean": s % 3,
                "tool/error_rate": 0.5 / s,
                "timing_s/gen": 0.5,
                "timing_s/update_actor": 0.25 + s / 100,
                "timing_s/step": 0.8 + s / 100,
                "perf/throughput": 100.0 * s,
                "mylib/custom": True,
                "plainkey": s,
            },
        )
        if s % 4 == 0:
            log(s, {"val-core/arith/reward/mean@1": s / 16, "timing_s/testing": 0.3})
    log(5, {"actor/entropy": "NaN", "perf/throughput": "Infinity"})  # a second line for step 5: the last wins
    lines.insert(3, "not json at all")
    path.write_text("\n".join(lines) + "\n")
    return want


def external_resources(text: str) -> list[str]:
    """Every tag attribute that would load something (src, href to another document)."""
    from html.parser import HTMLParser

    found: list[str] = []

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for k, v in attrs:
                if k in ("src", "href") and v and not v.startswith("#"):
                    found.append(f"<{tag} {k}={v}>")

    P().feed(text)
    return found


def expected(v):
    if v == "NaN" or v == "Infinity":
        return None
    return float(v)


def render(page: Path, tmp_path: Path, shot: str) -> dict:
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    # no network: every host name fails to resolve, so the page renders from what it holds
    p = subprocess.run(
        [
            *CHROMIUM,
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=15000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r'<pre id="otel-rl-probe">(.*?)</pre>', p.stdout, re.S)
    assert m, p.stdout[-2000:] + p.stderr[-2000:]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            *CHROMIUM,
            "--window-size=1400,3000",
            "--virtual-time-budget=15000",
            f"--screenshot={SCREENSHOTS / shot}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
    )
    assert (SCREENSHOTS / shot).stat().st_size > 20_000
    return json.loads(html.unescape(m.group(1)))


def check_charts(got: dict, metrics: dict[str, dict[int, float | None]]) -> set[str]:
    """Every trace of every chart equals the run's series; returns the keys shown."""
    shown = set()
    for chart in got["charts"]:
        assert chart["drawn"] == len(chart["traces"]), chart["title"]
        stack_steps = sorted({s for t in chart["traces"] if t["stacked"] for s in metrics[t["meta"]]})
        for t in chart["traces"]:
            series = metrics[t["meta"]]
            if t["stacked"]:
                assert t["x"] == stack_steps
                assert t["y"] == [series.get(s) or 0.0 for s in stack_steps], t["meta"]
            else:
                assert t["x"] == sorted(series), t["meta"]
                assert t["y"] == [series[s] for s in sorted(series)], t["meta"]
            shown.add(t["meta"])
    return shown


def test_plan_puts_every_key_in_one_chart_verl_names_first():
    keys = [
        "zeta/a",
        "actor/entropy",
        "critic/score/mean",
        "timing_s/gen",
        "val-core/x/reward/mean@1",
        "alpha",
        "actor/grad_norm",
        "timing_s/step",
        "zeta/b",
        "timing_s/pretrain",
    ]
    metrics = {k: {0: 1.0} if k == "timing_s/pretrain" else {1: 1.0, 2: 2.0} for k in keys}
    charts = plan(metrics)
    placed = [k for c in charts for k in c.keys]
    assert sorted(placed) == sorted(keys)
    assert charts[0].keys == ["critic/score/mean", "val-core/x/reward/mean@1"]
    stacked = [c for c in charts if c.stacked]
    assert len(stacked) == 1 and stacked[0].title == STACKED and set(stacked[0].keys) == {"timing_s/gen", TIMING_TOTAL}
    assert [c.keys for c in charts if c.title.startswith("Other timings")] == [["timing_s/pretrain"]]
    other = {c.title: c.keys for c in charts if c.section == "Other metrics"}
    assert other == {"(no prefix)": ["alpha"], "actor/*": ["actor/grad_norm"], "zeta/*": ["zeta/a", "zeta/b"]}


def test_cli_writes_beside_the_run_and_prints_the_path(tmp_path, capsys):
    write_run(tmp_path / "run.jsonl")
    assert cli.main(["report", str(tmp_path / "run.jsonl")]) == 0
    page = tmp_path / "run.report.html"
    assert capsys.readouterr().out.strip() == str(page) and page.stat().st_size > 1_000_000  # plotly.js inside
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2
    assert cli.main(["report"]) == 2
    (tmp_path / "empty.jsonl").write_text("")
    assert cli.main(["report", str(tmp_path / "empty.jsonl")]) == 1
    assert "holds no metrics" in capsys.readouterr().err


def test_jsonl_values_last_per_step_and_gaps(tmp_path):
    want = write_run(tmp_path / "run.jsonl")
    data = read_jsonl(str(tmp_path / "run.jsonl"))
    assert data.metrics["actor/entropy"][5] is None and data.metrics["perf/throughput"][5] is None
    assert data.metrics["mylib/custom"][1] == 1.0 and data.metrics["plainkey"][7] == 7.0
    assert set(data.metrics) == set(want)
    assert data.notes and "1 line(s)" in data.notes[0]


@pytest.mark.slow
def test_page_renders_and_charts_hold_the_jsonl_values(tmp_path):
    want = write_run(tmp_path / "run.jsonl")
    out = tmp_path / "page.html"
    assert cli.main(["report", str(tmp_path / "run.jsonl"), "-o", str(out)]) == 0
    text = out.read_text()
    assert external_resources(text) == []  # self-contained: plotly.js is inside
    got = render(out, tmp_path, "report-synthetic.png")
    metrics = {k: {s: expected(v) for s, v in series.items()} for k, series in want.items()}
    assert check_charts(got, metrics) == set(want)
    assert got["charts"][0]["title"].startswith("Training reward")
    by_title = {c["title"]: [t["meta"] for t in c["traces"]] for c in got["charts"]}
    for title, keys in (
        ("KL", ["actor/ppo_kl"]),
        ("Entropy", ["actor/entropy"]),
        ("Policy loss", ["actor/pg_loss"]),
        ("Clip fraction", ["actor/pg_clipfrac"]),
        ("Response length", ["response_length/mean"]),
        ("Tool calls per trajectory", ["tool_call_counts/mean"]),
        ("Tool error rate", ["tool/error_rate"]),
        ("Throughput (tokens/s)", ["perf/throughput"]),
    ):
        assert by_title[title] == keys, (title, by_title)
    stacked = next(c for c in got["charts"] if c["title"] == STACKED)
    assert {t["meta"] for t in stacked["traces"] if t["stacked"]} == {
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/testing",
    }
    assert got["trajectories"] == [] and got["config_rows"] == -1


@pytest.mark.slow
def test_demo_ends_with_a_report_of_its_run(tmp_path):
    from mlflow import MlflowClient

    env = clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", str(REPO)))
    p = subprocess.run(
        [
            str(VENV_BIN / "otel-rl"),
            "demo",
            "--quick",
            "--no-progress",
            "--output-dir",
            str(tmp_path),
            "trainer.total_training_steps=5",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("  report (open in a browser): ")
    page = Path(last.split(": ", 1)[1])
    assert page == tmp_path / "otel_rl_demo" / "grpo_arith_seed0.report.html"
    got = render(page, tmp_path, "report-demo.png")
    metrics = read_jsonl(str(tmp_path / "otel_rl_demo" / "grpo_arith_seed0.jsonl")).metrics
    assert check_charts(got, metrics) == set(metrics)
    client = MlflowClient("sqlite:///" + str(tmp_path / "mlruns.db"))
    exp = client.get_experiment_by_name("otel_rl_demo")
    (run,) = client.search_runs([exp.experiment_id])
    assert got["config_rows"] == len(run.data.params)
    shown = got["trajectories"]
    assert {t["label"] for t in shown} >= {"best", "worst"}
    for t in shown:
        trace = client.get_trace(t["trace"])
        step = trace.info.tags["step"]
        assert trace.info.tags["validate"] == "False" and t["turns"] == len(trace.data.spans) - 1
        same_step = client.search_traces(
            locations=[exp.experiment_id], filter_string=f"tags.step = '{step}' AND tags.validate = 'False'"
        )
        rewards = [s.attributes["rl.reward"] for tr in same_step for s in tr.data.spans if s.parent_id is None]
        mine = next(s.attributes["rl.reward"] for s in trace.data.spans if s.parent_id is None)
        if t["label"] == "best":
            assert math.isclose(mine, max(rewards))
        elif t["label"] == "worst":
            assert math.isclose(mine, min(rewards))


@pytest.mark.slow
def test_mlflow_run_report_has_best_worst_and_failed_trajectories(store, tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from otel_rl.report.data import load

    from .conftest import FAILED, PROJECT, SAMPLES, STEPS

    uri = f"sqlite:///{store}"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    data = load(mlflow_run_id=run.info.run_id, tracking_uri=uri)
    assert data.metrics["critic/score/mean"] == {n: n / STEPS for n in range(1, STEPS + 1)}
    by_step: dict[int, dict[str, list]] = {}
    for t in data.trajectories:
        by_step.setdefault(t.step, {}).setdefault(t.label, []).append(t)
    assert sorted(by_step) == [1, STEPS // 2 + 1, STEPS]  # first, middle, last traced training step
    for step, got in by_step.items():
        ok = [i for i in range(SAMPLES) if (step, i) not in FAILED]
        assert got["best"][0].reward == max(ok) / 2 and got["worst"][0].reward == min(ok) / 2
        assert [t.sample_index for t in got.get("failed", [])] == [
            str(i) for i in range(SAMPLES) if (step, i) in FAILED
        ]
        assert all(t.status == "ERROR" for t in got.get("failed", []))
        assert [t.error for t in got.get("failed", [])] == [f"RuntimeError: tool crashed at step {step}"] * len(
            got.get("failed", [])
        )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the tracking URI as the trainer has it
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", "--mlflow-run-id", run.info.run_id]) == 0
    page = tmp_path / f"mlflow-{run.info.run_id}.report.html"
    assert capsys.readouterr().out.strip() == str(page)
    got = render(page, tmp_path, "report-mlflow.png")
    assert check_charts(got, data.metrics) == set(data.metrics)
    assert [t["label"] for t in got["trajectories"]] == [t.label for t in data.trajectories]
    assert "failed" in [t["label"] for t in got["trajectories"]]
    for shown, view in zip(got["trajectories"], data.trajectories):  # why it failed, on the page
        assert shown["error"] == (f"failed: {view.error}" if view.label == "failed" else "")
