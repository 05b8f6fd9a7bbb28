"""The demo's MLflow advice, checked for real: the `mlflow ui` command it prints is run as printed (in a
shell whose PATH does not hold the virtual environment), and the way it gives to see one step's traces
is followed in headless Chromium against that server (MLflow as installed, 3.17); the trace list there shows
each rollout's prompt, response, reward and step."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .browser import Browser, chromium_path

pytestmark = pytest.mark.slow

VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "MLFLOW_", "WANDB_", "SWANLAB_", "VERL_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "NO_PROXY": "127.0.0.1,localhost",
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def demo_ui(tmp_path_factory):
    """A quick demo run into MLflow, then the `mlflow ui` line it printed, run by a shell as printed."""
    root = tmp_path_factory.mktemp("demo_ui")
    out = subprocess.run([str(VENV_BIN / "otel-rl"), "demo", "--quick", "--no-progress", "--output-dir", str(root),
                          "trainer.logger=[mlflow]"], cwd=root, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (ui_line,) = [ln.strip() for ln in out.stdout.splitlines() if " ui --backend-store-uri " in ln]
    port = _free_port()
    # the printed line, in a shell that has not activated the virtual environment
    path = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                           if Path(p).resolve() != VENV_BIN.resolve())
    assert not any(Path(p, "mlflow").exists() for p in path.split(os.pathsep))
    server = subprocess.Popen(ui_line, shell=True, executable="/bin/sh", cwd=root, start_new_session=True,
                              env=_env(PATH=path, MLFLOW_PORT=str(port), MLFLOW_HOST="127.0.0.1", MLFLOW_WORKERS="1"),
                              stdout=open(root / "ui.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (root / "ui.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow ui did not answer /health"
            time.sleep(0.5)
        yield {"root": root, "stdout": out.stdout, "ui_line": ui_line, "url": url,
               "store": f"sqlite:///{root}/mlruns.db"}
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(30)


def test_printed_mlflow_ui_command_runs_as_printed_without_an_activated_venv(demo_ui):
    import json

    assert demo_ui["ui_line"].split()[0].endswith("mlflow")
    req = urllib.request.Request(demo_ui["url"] + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=otel_rl_demo")
    with urllib.request.urlopen(req, timeout=10) as r:
        exp = json.load(r)["experiment"]
    assert exp["name"] == "otel_rl_demo"  # the server reads the demo's store


def _step_trace_ids(store: str, step: int) -> tuple[str, set[str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("otel_rl_demo")
    traces = client.search_traces(locations=[exp.experiment_id], filter_string=f"tags.step = '{step}'",
                                  max_results=1000)
    return exp.experiment_id, {t.info.trace_id for t in traces}


def _row_ids(b: Browser) -> set[str]:
    labels = b.eval("""Array.from(document.querySelectorAll('[data-component-id="web-shared.traces-table.row-select"]'))
                       .map(e => e.getAttribute('aria-label'))""")
    return {m.group(1) for x in labels if (m := re.search(r"(tr-[0-9a-f]+)", x or ""))}


def _shown(b: Browser) -> int:
    m = re.search(r"\b(\d+) of (\d+)\b", b.text())
    return int(m.group(1)) if m else -1


def test_mlflow_ui_filters_control_shows_one_steps_traces(demo_ui, tmp_path):
    if chromium_path() is None and not os.environ.get("CI"):
        pytest.skip("chromium is not installed (scripts/bootstrap.sh --test installs it)")
    # what the demo tells users to do
    assert "Filters (the funnel button): Field 'Tag', key 'step', '=', value '3', Apply filters" in demo_ui["stdout"]
    exp_id, expected = _step_trace_ids(demo_ui["store"], 3)
    _, all_ids = _step_trace_ids(demo_ui["store"], 2)
    assert expected and len(expected) <= 25 and not expected & all_ids
    with Browser() as b:
        b.goto(f"{demo_ui['url']}/#/experiments/{exp_id}/traces")
        b.wait_for("document.body && /\\d+ of \\d+/.test(document.body.innerText)", 90)
        b.wait_for("""document.querySelectorAll('[data-component-id="web-shared.traces-table.row-select"]').length > 0""")
        unfiltered = _row_ids(b)
        assert unfiltered - expected  # other steps' traces are listed before filtering
        if b.eval("""!!document.querySelector('[data-component-id="mlflow.detect_issues.guidance.dismiss"]')"""):
            b.click('[data-component-id="mlflow.detect_issues.guidance.dismiss"]')
        # the search box is full text: the filter string typed there does not select a step
        b.click('[data-component-id="web-shared.traces-table.search"]')
        b.type("tags.step = '3'")
        b.key("Enter")
        b.pump(3)
        assert _row_ids(b) != expected
        b.goto(f"{demo_ui['url']}/#/experiments/{exp_id}/traces")
        b.wait_for("""document.querySelectorAll('[data-component-id="web-shared.traces-table.row-select"]').length > 0""")
        # Filters: Field "Tag", key "step", "=", value "3", Apply filters
        b.click('[data-component-id="web-shared.traces-table.filter.trigger"]')
        b.click('[data-component-id="web-shared.traces-table.filter.field"]')
        i = b.eval("""Array.from(document.querySelectorAll('[role=option]')).findIndex(e => e.innerText.trim() === 'Tag')""")
        assert i >= 0
        b.click("[role=option]", i)
        b.click('[data-component-id="web-shared.traces-table.filter.key"]')
        b.type("step")
        assert b.eval("""document.querySelector('[data-component-id="web-shared.traces-table.filter.operator"]').innerText""").strip() == "="
        b.click('[data-component-id="web-shared.traces-table.filter.value"]')
        b.type("3")
        sent = len(b.requests)
        b.click('[data-component-id="web-shared.traces-table.filter.apply"]')
        b.wait_for(f"""(() => {{ const ids = Array.from(document.querySelectorAll(
                       '[data-component-id="web-shared.traces-table.row-select"]')).map(e => e.getAttribute('aria-label'));
                       return ids.length === {len(expected)}; }})()""", 60)
        b.pump(1)
        shot = b.screenshot(tmp_path / "mlflow_traces_step3.png")
        assert shot.stat().st_size > 10_000
        assert _row_ids(b) == expected
        assert _shown(b) == len(expected)
        queries = [r["postData"] or "" for r in b.requests[sent:] if r["url"].endswith("/traces/search")]
        assert any("tags.step = '3'" in q for q in queries), queries


def _close_overlays(b: Browser) -> None:
    """The first visit's pop-ups (the Detect Issues guidance, the assistant panel) cover part of the table."""
    for component in ("mlflow.detect_issues.guidance.dismiss", "mlflow.assistant.chat_panel.close"):
        sel = f'[data-component-id="{component}"]'
        if b.eval(f"!!document.querySelector({sel!r})"):
            b.click(sel)


def _rows(b: Browser) -> dict[str, dict[str, str]]:
    """The trace list's rows as shown: trace id -> {column header: cell text}."""
    rows = b.eval("""(() => {
        const heads = Array.from(document.querySelectorAll('[data-component-id="web-shared.traces-table.header"]'))
            .map(e => e.innerText.trim());
        return Array.from(document.querySelectorAll('[role=row]')).flatMap(r => {
            const sel = r.querySelector('[data-component-id="web-shared.traces-table.row-select"]');
            if (!sel) return [];
            const cells = Array.from(r.querySelectorAll('[role=cell]')).slice(1).map(c => c.innerText.trim());
            return [[sel.getAttribute('aria-label'), Object.fromEntries(heads.map((h, i) => [h, cells[i]]))]];
        }); })()""")
    return {m.group(1): cells for label, cells in rows if (m := re.search(r"(tr-[0-9a-f]+)", label or ""))}


def test_mlflow_trace_list_shows_each_rollouts_prompt_response_reward_and_step(demo_ui, tmp_path):
    """The Traces page of the demo's experiment, as a user sees it: every row's Input is the rollout's prompt
    (decoded by token2text) with its step, sample_index, rollout_n and validate, its Output the final response
    and the reward; the Tags column's hover card shows the step, and clicking it lists that step's traces."""
    if chromium_path() is None and not os.environ.get("CI"):
        pytest.skip("chromium is not installed (scripts/bootstrap.sh --test installs it)")
    import json

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=demo_ui["store"])
    exp = client.get_experiment_by_name("otel_rl_demo")
    stored = {t.info.trace_id: t.info for t in client.search_traces(locations=[exp.experiment_id],
                                                                      max_results=1000)}
    with Browser() as b:
        b.goto(f"{demo_ui['url']}/#/experiments/{exp.experiment_id}/traces")
        b.wait_for("""document.querySelectorAll('[data-component-id="web-shared.traces-table.row-select"]').length > 0""", 90)
        b.pump(1)
        _close_overlays(b)
        rows = _rows(b)
        assert len(rows) == 25 and set(rows) <= set(stored)
        for tid, cells in rows.items():
            info = stored[tid]
            shown_in, shown_out = json.loads(cells["Input"]), json.loads(cells["Output"])
            assert shown_in["prompt"].startswith("<s>") and shown_in["prompt"].endswith("="), cells  # "<s>3+4="
            assert {k: str(shown_in[k]) for k in ("step", "sample_index", "rollout_n")} == \
                {k: info.tags[k] for k in ("step", "sample_index", "rollout_n")}
            assert str(shown_in["validate"]) == info.tags["validate"]  # a JSON true, tag "True"
            assert isinstance(shown_out["response"], str) and shown_out["response"]
            assert str(shown_out["reward"]) == info.tags["reward"]
        shot = b.screenshot(tmp_path / "mlflow_trace_list.png")
        assert shot.stat().st_size > 10_000
        # the Tags column shows as many tags as fit, then "+N": its hover card lists them all
        first = next(iter(rows))
        step = stored[first].tags["step"]
        box = b.eval("""(() => { const e = document.querySelector('[data-component-id="web-shared.traces-table.cell.tags"]');
            e.scrollIntoView({block: 'center', inline: 'center'}); const r = e.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; })()""")
        for dx in (-60, -2, 0):
            b.call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0] + dx, y=box[1])
            b.pump(0.2)
        pill = f'[role=button][aria-label="Filter by tag step: {step}"]'
        b.wait_for(f"document.querySelectorAll({pill!r}).length > 0", 10)
        b.screenshot(tmp_path / "mlflow_trace_tags.png")
        expected = {tid for tid, info in stored.items() if info.tags["step"] == step}
        sent = len(b.requests)
        b.click(pill, b.eval(f"document.querySelectorAll({pill!r}).length") - 1)  # the hover card's (last)
        b.wait_for(f"""(() => {{ const m = /\\b(\\d+) of (\\d+)\\b/.exec(document.body.innerText);
                       return m && +m[1] === {min(25, len(expected))}; }})()""", 60)
        b.pump(1)
        b.screenshot(tmp_path / "mlflow_trace_step_tag_clicked.png")
        assert set(_row_ids(b)) <= expected and len(_row_ids(b)) == min(25, len(expected))
        queries = [r["postData"] or "" for r in b.requests[sent:] if r["url"].endswith("/traces/search")]
        assert any(f"tags.step = '{step}'" in q or f"tags.`step` = '{step}'" in q for q in queries), queries


def test_mlflow_run_page_shows_the_training_commands_source_and_user(demo_ui, tmp_path):
    """The run was created in the export process, yet its page names what `mlflow.start_run` in the demo's
    own process would: the user, and the `otel-rl` command as its Source."""
    if chromium_path() is None and not os.environ.get("CI"):
        pytest.skip("chromium is not installed (scripts/bootstrap.sh --test installs it)")
    import getpass

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=demo_ui["store"])
    exp = client.get_experiment_by_name("otel_rl_demo")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.tags["mlflow.source.name"] == str(VENV_BIN / "otel-rl")  # the command the test ran
    with Browser() as b:
        b.goto(f"{demo_ui['url']}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}")
        b.wait_for("document.body && /Created by\\s/.test(document.body.innerText) && "
                   "/Source\\s/.test(document.body.innerText)", 90)
        b.pump(1)
        _close_overlays(b)
        text = b.text()
        b.screenshot(tmp_path / "mlflow_run_page.png")
    assert re.search(rf"Created by\s+{re.escape(getpass.getuser())}\s", text), text[:2000]
    assert re.search(r"Source\s+otel-rl\s", text), text[:2000]
