"""`otel_rl.integrations.verl.install()` with the real verl 0.9.1 package.

verl is installed in the venv with ``pip install --no-deps verl==0.9.1`` plus the light packages
``verl.utils.tracking`` / ``verl.utils.rollout_trace`` / ``verl.tools.base_tool`` import
(tensordict and pyvers with --no-deps, transformers, ray); see docs/verl.md.  Without verl these
tests skip.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import textwrap

import pytest

import otel_rl
from otel_rl import semconv as sc
from otel_rl.compat import verl as cv
from otel_rl.integrations import verl as iv


def _verl():
    try:
        return (importlib.import_module("verl.utils.tracking"), importlib.import_module("verl.utils.rollout_trace"),
                importlib.import_module("verl.tools.base_tool"))
    except Exception as exc:  # not installed, or a dependency missing
        pytest.skip(f"verl is not importable: {exc!r}")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith(("OTEL_", "VERL_FILE_LOGGER")) or k in ("RANK", "LOCAL_RANK"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_RL_BATCH_DELAY_S", "0.05")
    monkeypatch.chdir(tmp_path)
    cv.RolloutTraceConfig.reset()
    yield
    iv.uninstall()
    cv.RolloutTraceConfig.reset()
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def _user_module(tmp_path, monkeypatch, name: str):
    """A trainer's own module that imported verl's names with `from ... import` (a real file)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from verl.utils.tracking import Tracking, ValidationGenerationsLogger
        from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

        class MyAgent:
            @rollout_trace_op
            async def run(self, x):
                return x * 2
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_install_replaces_everywhere_is_idempotent_and_uninstall_restores(tmp_path, monkeypatch):
    vt, vrt, bt = _verl()
    before = _user_module(tmp_path, monkeypatch, "trainer_before_install")
    originals = {n: getattr(vt, n) for n in iv.NAMES[iv.TRACKING]} | {n: getattr(vrt, n) for n in iv.NAMES[iv.ROLLOUT_TRACE]}
    execute = bt.BaseTool.__dict__["execute"]
    run = before.MyAgent.__dict__["run"]
    assert before.Tracking is originals["Tracking"]
    assert not hasattr(execute, "__otel_rl_rollout_trace_op__")

    iv.install()
    assert iv.installed()
    for mod in (vt, vrt, before, bt):
        for name, orig in originals.items():
            if hasattr(mod, name):
                assert getattr(mod, name) is getattr(cv, name), (mod.__name__, name)
    # methods that verl's decorator wrapped at import time now go through otel-rl's
    for cls, attr in ((bt.BaseTool, "execute"), (before.MyAgent, "run")):
        fn = cls.__dict__[attr]
        assert fn.__otel_rl_rollout_trace_op__ and asyncio.iscoroutinefunction(fn)
    assert bt.BaseTool.execute.__wrapped__ is execute.__wrapped__
    # a module imported after install() gets otel-rl's names from verl
    after = _user_module(tmp_path, monkeypatch, "trainer_after_install")
    assert after.Tracking is cv.Tracking and after.MyAgent.run.__otel_rl_rollout_trace_op__
    run_id = os.environ[sc.ENV_RUN_ID]  # one run id for the job, given to Ray workers too
    replaced = len(iv._state.replaced)

    iv.install()  # again: nothing more
    assert len(iv._state.replaced) == replaced

    iv.uninstall()
    assert not iv.installed()
    for mod in (vt, vrt, before):
        for name, orig in originals.items():
            if hasattr(mod, name):
                assert getattr(mod, name) is orig
    assert bt.BaseTool.__dict__["execute"] is execute and before.MyAgent.__dict__["run"] is run
    assert sc.ENV_RUN_ID not in os.environ and run_id
    iv.uninstall()  # again: fine


def test_verls_tracking_name_prints_and_writes_verls_bytes(tmp_path, monkeypatch, capsys):
    vt, _, _ = _verl()
    from omegaconf import OmegaConf

    calls = [({"actor/pg_loss": 0.25, "actor/entropy": 1e-6, "n": 2}, 1, None),
             ({"val-core/gsm8k/acc/mean@1": 0.5}, 1, ["file"]),
             ({"timing_s/step": 3.000001, "flag": False}, 2, "console")]
    config = {"trainer": {"project_name": "p", "experiment_name": "e", "logger": ["console", "file"]}}

    def run(path):
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
        # as verl's RayPPOTrainer.fit makes it: a ListConfig of names, the resolved config as a dict
        logger = vt.Tracking(project_name="p", experiment_name="e",
                             default_backend=OmegaConf.create({"l": ["console", "file"]}).l, config=config)
        for data, step, backend in calls:
            logger.log(data=data, step=step, backend=backend)
        logger.finish(exit_code=0)
        return type(logger)

    capsys.readouterr()
    assert run(tmp_path / "verl.jsonl") is not cv.Tracking
    verl_out = capsys.readouterr().out
    iv.install(ray_workers=False)
    assert run(tmp_path / "ours.jsonl") is cv.Tracking
    ours_out = capsys.readouterr().out
    assert (tmp_path / "ours.jsonl").read_bytes() == (tmp_path / "verl.jsonl").read_bytes()
    assert ours_out.replace("ours.jsonl", "X") == verl_out.replace("verl.jsonl", "X")
    assert [ln for ln in ours_out.splitlines() if ln.startswith("step:")] == [
        "step:1 - actor/pg_loss:0.25 - actor/entropy:1e-06 - n:2", "step:2 - timing_s/step:3.000001 - flag:False"]


def test_verl_tool_traced_inside_verls_rollout_trace_attr():
    vt, vrt, bt = _verl()
    from verl.tools.schemas import OpenAIFunctionToolSchema

    iv.install(ray_workers=False)
    vrt.RolloutTraceConfig.init("p", "e", "memory")  # as verl's AgentLoopWorker does, by verl's name
    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "calc", "description": "adds",
                                          "parameters": {"type": "object", "properties": {}, "required": []}}})
    tool = bt.BaseTool({}, schema)

    async def agent_loop():
        with vrt.rollout_trace_attr(step=1, sample_index=0, rollout_n=1, name="agent_loop") as t:
            out = await tool.execute("inst-1", {"a": 1})
            t.set_reward(out[1])
        return out

    response, reward, metrics = asyncio.run(agent_loop())
    assert response.text == "Updated the tool state." and reward == 0.0
    mem = next(e for e in otel_rl.current().exporters if e.name == "memory").collect()
    (traj,) = mem.trajectories(step=1)
    assert (traj.sample_index, traj.rollout_n, traj.name) == (0, 1, "agent_loop")
    (span,) = traj.root.children
    assert span.name == "BaseTool.execute"
    assert span.inputs == '{"instance_id": "inst-1", "parameters": {"a": 1}}'
    assert '"text": "Updated the tool state."' in span.output


def test_a_verl_rollout_trace_config_initialised_before_install_is_carried_over():
    _, vrt, _ = _verl()
    vrt.RolloutTraceConfig.reset()
    try:
        vrt.RolloutTraceConfig.init("carried", "over", "memory", False, 3)  # verl's own: no client for "memory"
        iv.install(ray_workers=False)
        inst = vrt.RolloutTraceConfig.get_instance()  # now otel-rl's class
        assert isinstance(inst, cv.RolloutTraceConfig) and inst._initialized
        assert (inst.project_name, inst.backend, inst.max_samples) == ("carried", "memory", 3)
        assert otel_rl.current().config.max_samples == 3
    finally:
        iv.uninstall()
        vrt.RolloutTraceConfig.reset()


def test_job_runtime_env_merges_and_chains():
    out = iv.job_runtime_env({"env_vars": {"A": "1", sc.ENV_RUN_ID: "explicit"}, "working_dir": None,
                              "worker_process_setup_hook": "mypkg.setup"})
    assert out["worker_process_setup_hook"] == iv.SETUP_HOOK and out["working_dir"] is None
    env = out["env_vars"]
    assert env["A"] == "1" and env[sc.ENV_RUN_ID] == "explicit" and env[iv.ENV_CHAINED_HOOK] == "mypkg.setup"
    assert env[iv.ENV_INSTALLED] == "1"
    h = otel_rl.init(project="proj", exporters=["console"], otlp_endpoint="http://127.0.0.1:4318")
    env = iv.job_runtime_env(None)["env_vars"]
    assert env[sc.ENV_RUN_ID] == h.run_id and env["OTEL_RL_PROJECT"] == "proj"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4318"


class Probe:
    """A Ray actor like verl's AgentLoopWorker: uses verl's names, starts rollout tracing."""

    def check(self):
        import verl.utils.rollout_trace as vrt
        import verl.utils.tracking as vt

        from otel_rl.compat import verl as compat

        vrt.RolloutTraceConfig.init("p", "e", "memory")
        h = otel_rl.current()
        out = {"tracking_is_ours": vt.Tracking is compat.Tracking, "run_id": h.run_id, "rank": h.config.rank,
               "actor_name": h.resource.attributes.get("ray.actor.name"), "pid": os.getpid()}
        h.shutdown()
        return out


@pytest.mark.slow
def test_ray_workers_install_themselves_and_share_the_run_id(monkeypatch):
    _verl()
    ray = pytest.importorskip("ray")
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    iv.install()
    run_id = os.environ[sc.ENV_RUN_ID]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)  # the wrapped init
    try:
        actors = [ray.remote(num_cpus=0.5)(Probe).options(name=f"agent_loop_worker_{i}").remote() for i in (0, 1)]
        got = ray.get([a.check.remote() for a in actors], timeout=120)
    finally:
        ray.shutdown()
    assert [g["tracking_is_ours"] for g in got] == [True, True]
    assert [g["run_id"] for g in got] == [run_id, run_id]
    assert [g["rank"] for g in got] == [0, 1] and [g["actor_name"] for g in got] == ["agent_loop_worker_0",
                                                                                   "agent_loop_worker_1"]
    assert len({g["pid"] for g in got} | {os.getpid()}) == 3
    iv.uninstall()
    assert ray.init.__name__ == "init" and not hasattr(ray.init, "__otel_rl_original__")


def test_agent_loop_batches_are_registered_with_the_deterministic_sampler(tmp_path, monkeypatch):
    """verl's agent loop computes each batch's trajectory info with a module-level
    `get_trajectory_info(step, index, validate)`; once rollout tracing starts, install() makes it
    register the batch's samples.  verl's agent_loop module itself needs hydra-core (not installed
    here), so a module of the same shape stands in for it."""
    _verl()
    from otel_rl import sampling

    (tmp_path / "agent_loop_like.py").write_text(textwrap.dedent("""
        async def get_trajectory_info(step, index, validate):
            return [{"step": step, "sample_index": i, "rollout_n": 0, "validate": validate} for i in index]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("agent_loop_like")
    original = mod.get_trajectory_info
    monkeypatch.setattr(iv, "AGENT_LOOP_MODULES", ("agent_loop_like",))
    iv.install(ray_workers=False)
    assert mod.get_trajectory_info is original  # only when rollout tracing starts
    cv.RolloutTraceConfig.init("p", "e", "memory", max_samples_per_step_per_worker=2)
    assert mod.get_trajectory_info is not original
    info = asyncio.run(mod.get_trajectory_info(5, [3, 4, 5, 6, 7], False))
    assert [i["sample_index"] for i in info] == [3, 4, 5, 6, 7]
    h = otel_rl.current()
    want = sampling.choose(h.run_id, 5, [3, 4, 5, 6, 7], 2)
    assert {i for i in (3, 4, 5, 6, 7) if h.sampler.decide(5, i)} == want
    iv.uninstall()
    assert mod.get_trajectory_info is original
