"""The pytest plugin of `otel_rl.testing`: the `otel_rl_capture` fixture.

It is registered through the ``pytest11`` entry point of the installed
package, so users get it without a conftest.  The last tests prove that by
running a separate pytest session, in a directory that knows nothing about
this repository, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import otel_rl
from otel_rl import semconv as sc
from otel_rl.testing import CaptureExporter

_ran_with_fixture: list = []


@otel_rl.op
def _plugin_probe(x, scale=2):
    return x * scale


def test_fixture_gives_running_capture(otel_rl_capture, request):
    cap = otel_rl_capture
    assert request.config.pluginmanager.has_plugin("otel_rl")  # the entry-point name
    assert isinstance(cap, CaptureExporter)
    assert cap.handle is not None and otel_rl.current() is cap.handle and not cap.handle.closed
    assert cap.handle.tracing
    _ran_with_fixture.append(cap.handle)

    with otel_rl.step(3):
        otel_rl.log({"actor/pg_loss": 0.25}, step=3)
        with otel_rl.trajectory(sample_index=1) as t:
            assert t.sampled
            assert _plugin_probe(21) == 42
    assert cap.collect() is cap

    assert cap.metrics_by_step()[3] == {"actor/pg_loss": 0.25}
    assert cap.metric_series("actor/pg_loss") == [(3, 0.25)]
    (traj,) = cap.trajectories(step=3, sample_index=1)
    assert [n.name for n in traj.root.children] == ["_plugin_probe"]
    assert json.loads(traj.root.children[0].inputs) == {"x": 21, "scale": 2}
    assert cap.span_tree(traj.trace_id) is traj.root
    assert len(cap.spans_named(sc.SPAN_STEP)) == 1
    assert [p.value for p in cap.metric_points("rl.train.actor/pg_loss")] == [0.25]
    assert len(cap.run_starts()) == 1


def test_fixture_shuts_down_its_pipeline():
    # runs right after the test above in file order (no fixture here); alone it checks nothing
    for h in _ran_with_fixture:
        assert h.closed
    if _ran_with_fixture:
        assert otel_rl.current() is None


def test_fixture_is_fresh_and_previous_one_was_shut_down(otel_rl_capture):
    # runs after the test above in file order; if run alone there is nothing to compare
    for h in _ran_with_fixture:
        assert h.closed and h is not otel_rl_capture.handle
    cap = otel_rl_capture.collect()
    assert cap.trajectories() == [] and cap.metrics_by_step() == {}


USER_TEST = textwrap.dedent('''
    import otel_rl

    handles = []

    @otel_rl.op
    def my_tool(q):
        return q.upper()

    def test_uses_fixture(otel_rl_capture):
        handles.append(otel_rl_capture.handle)
        with otel_rl.trajectory(step=1, sample_index=0):
            assert my_tool("hi") == "HI"
        otel_rl.log({"reward": 1.5}, step=1)
        cap = otel_rl_capture.collect()
        assert cap.metrics_by_step() == {1: {"reward": 1.5}}
        (t,) = cap.trajectories(step=1, sample_index=0)
        assert [c.name for c in t.root.children] == ["my_tool"]

    def test_shut_down_after():
        assert handles and handles[0].closed
        assert otel_rl.current() is None
''')


def _run_pytest(tmp_path, *extra):
    (tmp_path / "test_user_code.py").write_text(USER_TEST)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra,
                           "test_user_code.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_plugin_is_auto_registered_for_users(tmp_path):
    assert not (tmp_path / "conftest.py").exists()
    proc = _run_pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_fixture_comes_from_the_plugin(tmp_path):
    # control: with the entry-point plugin disabled the same file cannot find the fixture
    proc = _run_pytest(tmp_path, "-p", "no:otel_rl")
    assert proc.returncode != 0
    assert "fixture 'otel_rl_capture' not found" in proc.stdout



def _train_with_own_init(steps: int) -> None:
    """A trainer as the README teaches it: it starts (and ends) its own pipeline."""
    with otel_rl.init(["trainer.project_name=own_init", "trainer.logger=[console]"]):
        for n in range(1, steps + 1):
            with otel_rl.step(n):
                with otel_rl.trajectory(sample_index=0):
                    _plugin_probe(n)
                otel_rl.log({"actor/pg_loss": 1.0 / n}, step=n)


def test_fixture_captures_from_init_inside_code_under_test(otel_rl_capture, capsys):
    _train_with_own_init(3)
    cap = otel_rl_capture.collect()
    assert cap.metric_series("actor/pg_loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert cap.run_starts()[-1].run.project == "own_init"
    (t,) = cap.trajectories(step=2, sample_index=0)
    assert [c.name for c in t.root.children] == ["_plugin_probe"]
    assert cap.metric_points("rl.train.actor/pg_loss")  # the OTel instruments of that pipeline too
    assert "step:3 - actor/pg_loss:0.3333333333333333" in capsys.readouterr().out  # its own exporters still run


def test_fixture_shuts_down_a_pipeline_left_running_by_the_code(otel_rl_capture):
    left = otel_rl.init(logger=[])
    otel_rl.log({"x": 1}, step=1)
    assert otel_rl_capture.collect().metrics_by_step() == {1: {"x": 1}}
    _left_running.append(left)


_left_running: list = []


def test_pipeline_left_running_was_shut_down_after_its_test():
    assert _left_running and _left_running[-1].closed
