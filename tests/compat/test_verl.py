"""`otel_rl.compat.verl` against verl 0.9.1's own code.

verl's `tracking.py` and `aggregate_logger.py` are run side by side with ours: from the installed
verl package when it imports, else loaded from the wheel (``pip download verl==0.9.1 --no-deps -d
/tmp/verlwheel``, or OTEL_RL_VERL_WHEEL) as tests/test_exporters.py does; without either, those
comparisons skip.  The MLflow part uses a real sqlite store.
"""

from __future__ import annotations

import asyncio
import glob
import importlib
import importlib.util
import os
import uuid
import warnings
import zipfile

import pytest

import otel_rl
from otel_rl import sampling
from otel_rl import semconv as sc
from otel_rl.compat.verl import (
    RolloutTraceConfig,
    Tracking,
    ValidationGenerationsLogger,
    rollout_trace_attr,
    rollout_trace_op,
)
from otel_rl.records import Generations, StepMetrics
from otel_rl.testing import CaptureExporter

CALLS = [  # (data, step, backend) as a verl trainer makes them
    ({"actor/pg_loss": 0.123456789, "actor/lr": 1e-6, "n": 3, "flag": True}, 0, None),
    ({"critic/vf_loss": 2.5e-05, "big": 2**63, "neg": -1.5e300}, 0, ["file"]),
    ({"val-core/gsm8k/reward/mean@4": 0.75, "réponse/長さ": 12, "tiny": 5e-324, "zero": -0.0}, 1, None),
    ({"timing_s/gen": 12.000000001, "ints": -(2**63)}, 7, "console"),
    ({"only/console": 1.0}, 8, "console,wandb"),  # a string: verl matches substrings
    ({"nobody": 1.0}, 9, ["wandb"]),
]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "VERL_FILE_LOGGER", "MLFLOW_")):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_RL_BATCH_DELAY_S", "0.05")
    monkeypatch.chdir(tmp_path)
    RolloutTraceConfig.reset()
    yield
    RolloutTraceConfig.reset()
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


# ----------------------------------------------------------------------------- verl's own code


def _verl_wheel() -> str | None:
    cands = [os.environ.get("OTEL_RL_VERL_WHEEL", "")] + sorted(glob.glob("/tmp/verlwheel/verl-*.whl"))
    return next((c for c in cands if c and os.path.isfile(c)), None)


def _from_wheel(member: str, dest, name: str):
    wheel = _verl_wheel()
    if wheel is None:
        pytest.skip("verl is not importable and there is no verl wheel "
                    "(pip download verl==0.9.1 --no-deps -d /tmp/verlwheel)")
    with zipfile.ZipFile(wheel) as z:
        target = dest / os.path.basename(member)
        target.write_bytes(z.read(member))
    spec = importlib.util.spec_from_file_location(name, target)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def verl_tracking_module(tmp_path):
    """verl's tracking.py: the installed one (whole Tracking usable) or the wheel's (file logger only)."""
    try:
        return importlib.import_module("verl.utils.tracking"), True
    except Exception:
        pytest.importorskip("packaging")
        return _from_wheel("verl/utils/tracking.py", tmp_path, "_verl_tracking_w"), False


def verl_aggregate_module(tmp_path):
    try:
        return importlib.import_module("verl.utils.logger.aggregate_logger")
    except Exception:
        pytest.importorskip("torch")
        return _from_wheel("verl/utils/logger/aggregate_logger.py", tmp_path, "_verl_aggregate_w")


def _run_ours(calls, backends, path):
    os.environ["VERL_FILE_LOGGER_PATH"] = str(path)
    try:
        t = Tracking("p", "e", backends)
        for data, step, backend in calls:
            t.log(data=dict(data), step=step, backend=backend)
        t.finish()
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]


def test_console_and_file_bytes_are_verls(tmp_path, capsys, monkeypatch):
    trk, whole = verl_tracking_module(tmp_path)
    verl_path, ours_path = tmp_path / "verl.jsonl", tmp_path / "ours.jsonl"
    capsys.readouterr()
    if whole:  # verl's whole Tracking with the same calls
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(verl_path))
        t = trk.Tracking("p", "e", ["console", "file"])
        for data, step, backend in CALLS:
            t.log(data=dict(data), step=step, backend=backend)
        t.finish()
        monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    else:  # the wheel's FileLogger and LocalLogger, dispatched as verl's Tracking.log does
        agg = verl_aggregate_module(tmp_path)
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(verl_path))
        loggers = {"console": agg.LocalLogger(print_to_console=True), "file": trk.FileLogger("p", "e")}
        for data, step, backend in CALLS:
            for name, lg in loggers.items():
                if backend is None or name in backend:
                    lg.log(data=dict(data), step=step)
        loggers["file"].finish()
        monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    verl_out = capsys.readouterr().out
    _run_ours(CALLS, ["console", "file"], ours_path)
    ours_out = capsys.readouterr().out
    assert ours_path.read_bytes() == verl_path.read_bytes()
    assert ours_out.replace(str(ours_path), "PATH") == verl_out.replace(str(verl_path), "PATH")
    assert verl_out.startswith("Creating file logger at ")
    assert "step:8 - only/console:1.0" in ours_out and "nobody" not in ours_out


def test_backend_validation_like_verl(tmp_path):
    trk, _ = verl_tracking_module(tmp_path)
    for name in ("bogus", "tensorboard_x"):
        with pytest.raises(AssertionError) as verl_exc:
            trk.Tracking("p", "e", ["console", name])
        with pytest.raises(AssertionError) as ours:
            Tracking("p", "e", ["console", name])
        assert str(ours.value) == str(verl_exc.value) == f"{name} is not supported"
    # verl names otel-rl has no exporter for (private services): rejected the same way (verl would start them)
    for name in ("vemlp_wandb", "rl_insight"):
        with pytest.raises(AssertionError, match=f"^{name} is not supported$"):
            Tracking("p", "e", name)
    assert otel_rl.current() is None  # nothing started


def test_tracking_alias_warns_like_verl(monkeypatch, tmp_path):
    pytest.importorskip("otel_rl_wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    trk, _ = verl_tracking_module(tmp_path)
    source = open(trk.__file__).read()
    with pytest.warns(DeprecationWarning) as rec:
        t = Tracking("p", "e", "tracking")
    msg = str(rec[0].message)
    assert msg == "`tracking` logger is deprecated. use `wandb` instead." and f'"{msg}"' in source
    assert rec[0].filename == __file__  # stacklevel=2: the caller's line, as verl's
    assert list(t.logger) == ["wandb"] and [e.name for e in t.handle.exporters] == ["wandb"]
    t.finish()


def test_joins_a_running_pipeline_and_routes_to_its_own_backends(capsys):
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], project="p", experiment="e", batch_delay_s=0.05)
    t = Tracking("p", "e", ["console", "memory"])  # console added to the running pipeline
    assert t.handle is h and set(t.logger) == {"console", "memory"}
    mem = next(e for e in h.exporters if e.name == "memory")
    otel_rl.log({"direct": 1.0}, step=0)  # otel_rl.log: every exporter
    t.log({"a": 1.0}, 1)  # Tracking.log: its backends only
    t.log({"b": 2.0}, 2, backend=["memory"])
    t.logger["console"].log({"c": 3.0}, 3)
    t.finish()
    assert not h.closed  # not ours to shut down
    assert t.finish() is None  # once
    h.flush()
    assert capsys.readouterr().out == "step:0 - direct:1.0\nstep:1 - a:1.0\nstep:3 - c:3.0\n"
    assert [(m.step, m.values) for m in mem.step_metrics()] == [(0, {"direct": 1.0}), (1, {"a": 1.0}),
                                                                (2, {"b": 2.0})]
    assert [m.step for m in cap.step_metrics()] == [0]
    assert len(mem.run_starts()) == 1  # an exporter added later still gets the run start


def test_owned_pipeline_ends_with_finish_or_del(capsys):
    t = Tracking("p", "e", "console")
    h = t.handle
    t.log({"x": 1}, 5)
    del t  # verl's __del__ finishes
    assert h.closed and otel_rl.current() is None
    assert capsys.readouterr().out == "step:5 - x:1\n"


def test_validation_generations_go_to_the_listed_loggers():
    t = Tracking("p", "e", ["console", "memory"], config={"trainer": {"log_val_generations": 1}})
    mem = t.logger and next(e for e in t.handle.exporters if e.name == "memory")
    samples = [("q1", "a1", 1.0), ("q2", "a2", 0.0)]
    ValidationGenerationsLogger("p", "e").log(["console", "memory"], samples, 3)
    ValidationGenerationsLogger("p", "e").log(["console"], samples, 4)  # console has no table: nothing
    ValidationGenerationsLogger().log("memory", samples[:1], 5)  # a string, as verl's `in`
    t.finish()
    gens = [(g.step, g.rows) for g in mem.of_type(Generations)]
    # every row given is kept (verl's trainer already cut them to trainer.log_val_generations)
    assert gens == [(3, [("q1", "a1", 1.0), ("q2", "a2", 0.0)]), (5, [("q1", "a1", 1.0)])]
    assert mem.of_type(StepMetrics) == []


# ----------------------------------------------------------------------------- rollout traces


class Agent:
    tokenizer = None

    @rollout_trace_op
    async def generate(self, prompt_ids, sampling_params=None):
        await asyncio.sleep(0)
        return {"prompt_ids": prompt_ids, "response_ids": [7, 8]}

    @rollout_trace_op
    def call_tool(self, name, **kwargs):
        if name == "boom":
            raise RuntimeError("tool failed")
        return f"{name}:{kwargs}"


async def _rollout(agent, step, i, trace=True, fail=False, validate=False):
    with rollout_trace_attr(sample_index=i, step=step, rollout_n=0, name="agent_loop", validate=validate,
                            trace=trace) as t:
        out = await agent.generate([1, 2, 3], sampling_params={"t": 1.0})
        agent.call_tool("calc", x=i)
        if fail:
            agent.call_tool("boom")
        if t is not None:
            t.set_reward(1.0)
        return out


def _memory():
    return next(e for e in otel_rl.current().exporters if e.name == "memory")


def test_singleton_api_like_verls():
    try:  # verl's own class side by side when verl imports (rollout_trace.py needs the verl package)
        verl_rt = importlib.import_module("verl.utils.rollout_trace")
    except Exception:
        verl_rt = None
    classes = [RolloutTraceConfig] + ([verl_rt.RolloutTraceConfig] if verl_rt else [])
    for cls in classes:
        cls.reset()
        assert cls() is cls.get_instance() is cls()
        assert cls.get_backend() is None and cls.get_client() is None and cls.enable_token2text() is False
        cls.init("p", "e", None, token2text=True, max_samples_per_step_per_worker=None)
        cls.init("p2", "e2", "mlflow")  # later calls are ignored
        inst = cls.get_instance()
        assert (inst.project_name, inst.experiment_name, inst.backend, inst.token2text) == ("p", "e", None, True)
        cls.reset()
        assert cls.get_instance() is not inst and cls.get_instance()._initialized is False
    assert otel_rl.current() is None  # no backend: nothing started


def test_no_backend_is_a_pass_through():
    cap = CaptureExporter()
    otel_rl.init(exporters=[cap], tracing=True, batch_delay_s=0.05)
    RolloutTraceConfig.init("p", "e", None)
    agent = Agent()
    assert asyncio.run(_rollout(agent, 1, 0)) == {"prompt_ids": [1, 2, 3], "response_ids": [7, 8]}
    with rollout_trace_attr(step=1) as t:
        assert t is None
    with pytest.raises(RuntimeError):
        agent.call_tool("boom")
    cap.collect()
    assert cap.trajectories() == [] and [s.name for s in cap.spans] == [sc.SPAN_RUN]  # the run start only


def test_rollouts_become_trajectories_with_op_spans():
    RolloutTraceConfig.init("proj", "exp", "memory")
    h = otel_rl.current()
    assert RolloutTraceConfig.get_client() is h and h.config.trace_backend == "memory"
    assert (h.config.project, h.config.experiment) == ("proj", "exp")
    agent = Agent()

    async def main():
        with otel_rl.step(2):
            await asyncio.gather(_rollout(agent, 2, 0), _rollout(agent, 2, 1, trace=False),
                                 _rollout(agent, 2, 2, validate=True))
            with pytest.raises(RuntimeError):
                await _rollout(agent, 2, 3, fail=True)

    asyncio.run(main())
    mem = _memory().collect()
    trajs = {t.sample_index: t for t in mem.trajectories(step=2)}
    assert sorted(trajs) == [0, 2, 3]  # trace=False: nothing
    t0 = trajs[0]
    assert t0.name == "agent_loop" and t0.rollout_n == 0 and not t0.validate and trajs[2].validate
    assert t0.root.attributes["rl.reward"] == 1.0
    assert [c.name for c in t0.root.children] == ["Agent.generate", "Agent.call_tool"]
    gen, tool = t0.root.children
    assert '"prompt_ids": [1, 2, 3]' in gen.inputs and "self" not in gen.inputs
    assert gen.output == '{"prompt_ids": [1, 2, 3], "response_ids": [7, 8]}'
    assert tool.inputs == '{"name": "calc", "x": 0}'
    failed = trajs[3]
    assert failed.status == "ERROR" and failed.root.children[-1].status == "ERROR"
    assert failed.root.children[-1].events[0]["attributes"]["exception.type"] == "RuntimeError"


def test_trace_backend_added_to_a_running_pipeline_and_token2text():
    class Tok:
        def batch_decode(self, ids_list, **kw):
            return [" ".join(f"t{i}" for i in ids) for ids in ids_list]

    t = Tracking("proj", "exp", ["console"])
    h = t.handle
    assert not h.tracing  # console alone: no spans
    agent = Agent()
    agent.tokenizer = Tok()
    RolloutTraceConfig.init("proj", "exp", "memory", token2text=True)
    assert h.tracing and h.config.trace_backend == "memory" and h.config.token2text
    assert RolloutTraceConfig.enable_token2text() is True
    asyncio.run(_rollout(agent, 1, 0))
    (traj,) = _memory().collect().trajectories()
    assert '"response_text": "t7 t8"' in traj.root.children[0].output
    t.finish()


def test_deterministic_sampling_replaces_verls_random_choice():
    RolloutTraceConfig.init("p", "e", "memory", max_samples_per_step_per_worker=1)
    inst = RolloutTraceConfig.get_instance()
    # verl's agent loop reads this attribute: None, so it passes trace=True for every sample
    assert inst.max_samples_per_step_per_worker is None and inst.max_samples == 1
    h = otel_rl.current()
    assert h.config.max_samples == 1
    chosen = otel_rl.select_samples(3, [10, 11, 12])  # what the installed integration registers per batch
    assert chosen == sampling.choose(h.run_id, 3, [10, 11, 12], 1)
    agent = Agent()

    async def main():
        await asyncio.gather(*(_rollout(agent, 3, i) for i in (10, 11, 12)))
        unchosen = next(i for i in (10, 11, 12) if i not in chosen)
        with pytest.raises(RuntimeError):
            await _rollout(agent, 3, unchosen, fail=True)
        return unchosen

    unchosen = asyncio.run(main())
    trajs = _memory().collect().trajectories(step=3)
    kept = sorted((t.sample_index, t.status) for t in trajs)
    assert kept == sorted([(next(iter(chosen)), "UNSET"), (unchosen, "ERROR")])  # a failure is always kept


def test_verls_own_sampling_when_asked(monkeypatch):
    monkeypatch.setattr(RolloutTraceConfig, "deterministic_sampling", False)
    RolloutTraceConfig.init("p", "e", "memory", max_samples_per_step_per_worker=2)
    assert RolloutTraceConfig.get_instance().max_samples_per_step_per_worker == 2
    assert otel_rl.current().config.max_samples is None


def test_unknown_trace_backend_does_not_stop_training(caplog):
    RolloutTraceConfig.init("p", "e", "rl_insight")  # no otel-rl exporter
    assert RolloutTraceConfig.get_backend() == "rl_insight"
    assert otel_rl.current() is not None and not otel_rl.current().tracing
    assert asyncio.run(_rollout(Agent(), 1, 0))["response_ids"] == [7, 8]
    assert any("rl_insight" in r.getMessage() for r in caplog.records)
    otel_rl.shutdown()
    # the same key in a verl config given to Tracking: metrics still start
    t = Tracking("p", "e", ["memory"], config={"actor_rollout_ref": {"rollout": {"trace": {"backend": "rl_insight"}}}})
    assert [e.name for e in t.handle.exporters] == ["memory"]
    t.finish()


# ----------------------------------------------------------------------------- MLflow


def test_mlflow_traces_by_step_tag_and_linked_to_the_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("otel_rl_mlflow")
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    project = f"verl-compat-{uuid.uuid4().hex[:6]}"
    config = {"trainer": {"project_name": project, "experiment_name": "grpo", "logger": ["console", "mlflow"]},
              "actor_rollout_ref": {"rollout": {"trace": {"backend": "mlflow"}}}}
    t = Tracking(project, "grpo", ["console", "mlflow"], config=config)
    RolloutTraceConfig.init(project, "grpo", "mlflow")
    agent = Agent()

    async def main():
        for step in (1, 2):
            with otel_rl.step(step):
                await asyncio.gather(*(_rollout(agent, step, i) for i in range(2)))
            t.log({"actor/pg_loss": 0.5 / step}, step)

    asyncio.run(main())
    t.finish()
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(project)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "grpo"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [0.5, 0.25]
    # as verl documents it: the experiment is the project, traces filtered by their step tag
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(project)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step1 = mlflow.search_traces(filter_string="tags.step = '1'", return_type="list")
        linked = mlflow.search_traces(run_id=run.info.run_id, return_type="list")
    assert sorted(tr.info.tags["sample_index"] for tr in step1) == ["0", "1"]
    assert {tr.info.tags["experiment_name"] for tr in step1} == {"grpo"}
    assert {tr.info.tags["mlflow.traceName"] for tr in step1} == {"agent_loop"}
    # unlike verl: every trace is linked to the training run
    assert len(linked) == 4
    names = sorted(s.name for s in step1[0].data.spans)
    assert names == ["Agent.call_tool", "Agent.generate", "agent_loop"]
