"""The export process (otel_rl/export_process/): tracker exporters in a child process of the trainer.

Real parts only: a real MLflow sqlite store, real offline wandb run files and real offline
SwanLab logs, read back with the trackers' own readers and compared exactly.  Real processes:
the export process is started, SIGKILLed and SIGINTed for real; trainers run as subprocesses
where the test needs a fresh interpreter (``export_process=auto`` decides on `sys.modules`, and
the pytest process imports mlflow, wandb and swanlab for the read-back), is killed, or crashes.

Delivery after the export process died is *at least once*: the batches it had not confirmed
are delivered again by the trainer, so a step around the kill may be in the store twice
(MLflow keeps equal points once per call); no step may be missing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("otel_rl_mlflow")
pytest.importorskip("wandb")
pytest.importorskip("otel_rl_wandb")
pytest.importorskip("swanlab")
pytest.importorskip("otel_rl_swanlab")

from mlflow import MlflowClient  # noqa: E402
from spool.spool_helpers import LineProcess, clean_env, wait_for  # noqa: E402  (tests/ is on sys.path)
from trackers.test_mlflow import (  # noqa: E402
    CONFIG,
    check_metrics,
    check_params,
    check_tables,
    check_traces,
    get_run,
    sqlite_uri,  # noqa: F401  (module-scoped fixture: one sqlite database for this module)
    calculator,
    generate,
    plan,
    traces_of,
    workload,
)
from trackers.test_swanlab import _only_run, swan_env  # noqa: E402,F401  (swan_env: fixture)
from trackers.test_wandb import (  # noqa: E402
    VERL_CONFIG,
    _assert_rows,
    _expected,
    _metric_rows,
    _one_run,
    _step_values,
    wandb_dir,  # noqa: F401  (fixture)
)

import otel_rl  # noqa: E402
import otel_rl_mlflow  # noqa: E402
from otel_rl import semconv as sc  # noqa: E402
from otel_rl.config import resolve  # noqa: E402
from otel_rl.export_process.client import RemoteExporter  # noqa: E402
from otel_rl.export_process.frames import read_frame, write_frame  # noqa: E402
from otel_rl.export_process.protocol import Done, Stop, Stopped  # noqa: E402
from otel_rl.redact import scrub_secrets  # noqa: E402
from otel_rl.testing import CaptureExporter  # noqa: E402
from otel_rl_mlflow import MlflowExporter  # noqa: E402
import otel_rl_wandb  # noqa: E402
from otel_rl_wandb import WandbExporter  # noqa: E402

NAN = float("nan")
_started: list = []  # the export processes (Popen) started in this process by the tests of this module


# ----------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def store(sqlite_uri):  # noqa: F811
    MlflowClient(sqlite_uri).search_experiments()  # create the schema once (MLflow's migrations take seconds)
    return sqlite_uri


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    """No otel-rl / MLflow settings from outside; the sqlite store's artifacts under tmp_path; afterwards
    the current pipeline is shut down and no export process started here is left running."""
    for k in list(os.environ):
        if k.startswith("OTEL_RL_") or k in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    # these tests read the stores right after shutdown(): give the export process (idle scheduling class,
    # slow to get the CPU on a busy machine) all the time it needs rather than the default 10 s budget
    monkeypatch.setenv("OTEL_RL_SHUTDOWN_TIMEOUT_S", "120")
    monkeypatch.chdir(tmp_path)
    yield
    try:
        for proc in _started:  # a test that failed while its export process was SIGSTOPped
            if proc.poll() is None and proc_state(proc.pid) == "T":
                proc.kill()
        h = otel_rl.current()
        if h is not None:
            h.shutdown(10)
    finally:
        while _started:
            proc = _started.pop()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def start(**kw) -> otel_rl.Handle:
    """otel_rl.init(); the export process's pid is remembered for the cleanup.

    The export process runs at nice 0 in the normal scheduling class unless a test asks otherwise: at the
    defaults (+19, SCHED_IDLE) it gets almost no CPU while other processes keep the cores busy."""
    kw.setdefault("export_process_nice", 0)
    kw.setdefault("export_process_idle", False)
    h = otel_rl.init(**kw)
    if h._export_process is not None:
        _started.append(h._export_process.proc)
    return h


def proc_state(pid: int) -> str | None:
    """The state letter of proc(5) (R, S, T, Z ...), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie may wait for a non-reaping pid 1)."""
    return proc_state(pid) not in (None, "Z", "X")


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_pid(pid: int) -> None:
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_gone(pid, 10)


def nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)


def project(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def points(uri: str, name: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point of metric `key` in the (single) run of experiment `name`; [] when the
    experiment or run does not exist yet."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id])
    if not runs:
        return []
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key))


def step_values(n: int) -> dict:
    return {"n": n, "half": n / 2, "nan": NAN, "neg": -0.1 * n}


def assert_steps(uri: str, name: str, steps: range, *, exactly_once: bool = True) -> None:
    """Every step of `steps` (logged with `step_values`) is in the store with its exact values."""
    for key in ("n", "half", "nan", "neg"):
        got = points(uri, name, key)
        if exactly_once:
            assert [s for s, _ in got] == list(steps), (key, got)
        else:
            assert sorted(set(s for s, _ in got)) == list(steps), (key, got)
        for s, v in got:
            want = float(step_values(s)[key])
            assert (math.isnan(v) and math.isnan(want)) or v == want, (key, s, v, want)


# ----------------------------------------------------------------------------- 1. same data either way


def _mlflow_view(uri: str, name: str) -> dict:
    """What is in the store for one project, without ids and times that differ between two runs."""
    client = MlflowClient(uri)
    exp, run = get_run(client, name)
    metrics = {k: sorted(((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)),
                         key=lambda p: (p[0], repr(p[1])))
               for k in run.data.metrics}
    traces = {}
    for tr in traces_of(exp.experiment_id, run_id=run.info.run_id):
        tags = {k: v for k, v in tr.info.tags.items() if k != "mlflow.artifactLocation"}  # names the trace id
        key = (tr.info.tags["step"], tr.info.tags["sample_index"])
        assert key not in traces
        traces[key] = (tags, sorted((s.name, s.status.status_code.value) for s in tr.data.spans), tr.info.state.value)
    return {"metrics": metrics, "params": dict(run.data.params), "status": run.info.status,
            "name": run.info.run_name, "traces": traces}


def test_out_of_process_and_in_process_exports_are_equal(store, monkeypatch):
    """The same workload (metrics with ints/floats/NaN/±Inf, trajectories of op/generate/tool spans,
    generations) through the export process and in-process: the same MLflow data, and in both
    stores exactly what the core recorded."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    names = {}
    for mode in ("true", "false"):
        name = names[mode] = project(f"equal-{mode}")
        cap = CaptureExporter()
        h = start(config=CONFIG, project=name, experiment="grpo-1", exporters=["mlflow", cap],
                  trace_backend="mlflow", batch_delay_s=0.05, export_process=mode)
        cap.handle = h
        mlflow_exp = next(e for e in h.exporters if getattr(e, "tracker_name", None) == "mlflow")
        if mode == "true":
            assert isinstance(mlflow_exp, RemoteExporter) and mlflow_exp.remote and h._export_process is not None
            assert mlflow_exp.wants_trajectories  # trace_backend=mlflow: trajectories go to the export process
        else:
            assert isinstance(mlflow_exp, MlflowExporter) and h._export_process is None
        workload(steps=3, samples=2)
        assert h.flush(120), (mode, h.stats())
        stats = h.stats()["exporters"]["mlflow"]
        h.shutdown()
        assert stats["dropped"] == 0 and stats["failed_attempts"] == 0 and stats["exported"] > 0, stats
        if mode == "true":
            assert h._export_process.proc.wait(10) == 0  # it ends right after shutdown() returns
        # each store holds exactly what the core recorded (values, timestamps, params, traces, tables)
        client = MlflowClient(store)
        exp, run = get_run(client, name)
        assert run.info.status == "FINISHED" and run.data.tags[otel_rl_mlflow.RUN_ID_TAG] == h.run_id
        check_params(run, CONFIG)
        check_metrics(client, run, cap)
        check_traces(run, exp.experiment_id, cap)
        check_tables(client, run, exp.experiment_id)
        inf = json.loads(run.data.tags[otel_rl_mlflow.INF_METRICS_TAG])
        assert inf == {"inf/pos": {"count": 2, "+inf_steps": [1, 3]}, "inf/neg": {"count": 1, "-inf_steps": [2]}}

    remote, local = _mlflow_view(store, names["true"]), _mlflow_view(store, names["false"])
    assert set(remote["metrics"]) == set(local["metrics"]) and {"timing_s/gen", "nan/metric"} <= set(local["metrics"])
    for key, want in local["metrics"].items():
        got = remote["metrics"][key]
        assert len(got) == len(want), key
        if key.startswith(sc.TIMING_PREFIX):  # wall-clock durations: the same steps, values differ per run
            assert [g[0] for g in got] == [w[0] for w in want]
            continue
        assert all(g[0] == w[0] and (g[1] == w[1] or (math.isnan(g[1]) and math.isnan(w[1])))
                   for g, w in zip(got, want)), (key, got, want)
    assert any(math.isnan(v) for _, v in remote["metrics"]["nan/metric"])
    assert remote["params"] == local["params"] and len(remote["params"]) > 10
    assert (remote["status"], remote["name"]) == (local["status"], local["name"]) == ("FINISHED", "grpo-1")
    assert len(remote["traces"]) == len(local["traces"]) == 6
    assert remote["traces"] == local["traces"]
    tags, spans, state = remote["traces"][("2", "0")]  # the trajectory with the failed tool call
    assert ("execute_tool calculator", "ERROR") in spans and state == "OK"
    assert [n for n, _ in spans] == sorted([tags["mlflow.traceName"], "plan", "chat policy-7b",
                                            "execute_tool calculator", "score"])
    assert {k: tags[k] for k in ("step", "sample_index")} == {"step": "2", "sample_index": "0"}


# ----------------------------------------------------------------------------- 2. flush and stats


def test_flush_waits_for_the_export_process_and_stats_come_from_it(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("flush")
    h = start(project=name, experiment="e", exporters=["mlflow"], batch_delay_s=0.05, export_process="true",
              export_process_nice=3)
    child = h._export_process.proc
    assert [type(e) for e in h.exporters] == [RemoteExporter]
    for n in range(1, 6):
        otel_rl.log(step_values(n), step=n)
    assert h.flush(60) is True
    # its run open, the child lowered its priority (export_process_nice) before it answered the flush
    assert nice_of(child.pid) == min(19, os.nice(0) + 3)
    assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER  # export_process_idle=False
    # delivered before shutdown: the run is still open in the export process
    assert_steps(store, name, range(1, 6))
    client = MlflowClient(store)
    assert get_run(client, name)[1].info.status == "RUNNING"
    stats = h.stats()["exporters"]["mlflow"]  # the export process's figures, as of its flush reply
    assert stats["exported"] == 6 and stats["queued"] == 0 and stats["in_memory"] == 0, stats  # run start + 5 steps
    assert stats["dropped"] == 0 and stats["failed_attempts"] == 0, stats

    otel_rl.log(step_values(6), step=6)
    assert h.flush(60) is True
    assert_steps(store, name, range(1, 7))
    assert h.stats()["exporters"]["mlflow"]["exported"] == 7
    assert child.poll() is None
    h.shutdown()
    # shutdown() returned once the export process said it was done; it ends right after, on its own
    assert child.wait(10) == 0 and not pid_alive(child.pid)
    assert get_run(client, name)[1].info.status == "FINISHED"
    assert_steps(store, name, range(1, 7))


# ----------------------------------------------------------------------------- trainer subprocesses


TRAINER = textwrap.dedent("""
    import json, os, sys, time
    mode = sys.argv[1]
    if mode == "imports-mlflow":
        import mlflow  # the trainer uses MLflow itself: auto keeps the exporter in this process
    import otel_rl

    h = otel_rl.init(project=os.environ["PROJECT"], experiment="e", exporters=["mlflow"], batch_delay_s=0.05)
    print(json.dumps({"event": "init", "exporters": [type(e).__name__ for e in h.exporters],
                      "sidecar_pid": h._export_process.pid if h._export_process is not None else None,
                      "mlflow_imported": "mlflow" in sys.modules}), flush=True)
    steps = int(os.environ["STEPS"])

    def log_steps(first, last):
        for n in range(first, last + 1):
            otel_rl.log({"n": n, "half": n / 2, "nan": float("nan"), "neg": -0.1 * n}, step=n)

    log_steps(1, steps)
    if mode in ("auto", "imports-mlflow"):
        assert h.flush(60)
        child_nice = child_policy = None
        if h._export_process is not None:
            with open(f"/proc/{h._export_process.pid}/stat") as f:
                child_nice = int(f.read().rsplit(")", 1)[1].split()[16])
            child_policy = os.sched_getscheduler(h._export_process.pid)
        print(json.dumps({"event": "flushed", "own_nice": os.nice(0), "child_nice": child_nice,
                          "child_policy": child_policy, "own_policy": os.sched_getscheduler(0)}), flush=True)
        log_steps(steps + 1, 2 * steps)  # delivered at exit
    if mode == "sigkill":
        time.sleep(0.5)  # > batch_delay_s: every step was handed to the export process
        print(json.dumps({"event": "ready"}), flush=True)
        time.sleep(300)  # killed here
    if mode == "dies-during-shutdown":
        import signal, threading
        assert h.flush(60)
        pid = h._export_process.pid
        os.kill(pid, signal.SIGSTOP)  # the export process gets the next steps but cannot deliver them
        log_steps(steps + 1, 2 * steps)
        time.sleep(0.5)  # > batch_delay_s: handed to the export process
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()  # it dies while shutdown() waits for it
        h.shutdown()
        print(json.dumps({"event": "shutdown"}), flush=True)
    # the other modes end without shutdown(): otel-rl's atexit hook stops the pipeline
""")


def _trainer(tmp_path: Path, mode: str, name: str, steps: int, uri: str) -> LineProcess:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER, encoding="utf-8")
    env = clean_env(MLFLOW_TRACKING_URI=uri, PROJECT=name, STEPS=str(steps))
    assert not any(k.startswith("OTEL_RL_") for k in env)  # default settings: export_process=auto
    return LineProcess([sys.executable, str(script), mode], env, tmp_path, f"trainer-{mode}")


def test_auto_runs_mlflow_in_the_export_process_unless_the_trainer_imported_mlflow(store, tmp_path):
    for mode in ("auto", "imports-mlflow"):
        name = project(mode)
        t = _trainer(tmp_path, mode, name, 4, store)
        try:
            init = t.wait_event(lambda e: e.get("event") == "init", 60)
            flushed = t.wait_event(lambda e: e.get("event") == "flushed", 120)
            assert t.wait(120) == 0, t.stderr()[-3000:]
        finally:
            t.kill()
        if mode == "auto":
            # the trainer never imported mlflow; the exporter ran in the export process, which has ended
            assert init == {"event": "init", "exporters": ["RemoteExporter"], "sidecar_pid": init["sidecar_pid"],
                            "mlflow_imported": False}
            assert isinstance(init["sidecar_pid"], int) and wait_gone(init["sidecar_pid"], 10)
            # ... at a lower priority than the trainer (export_process_nice, by default)
            default_nice = resolve(env={}).export_process_nice
            assert flushed["child_nice"] == min(19, flushed["own_nice"] + default_nice) > flushed["own_nice"]
            # ... in the idle scheduling class (export_process_idle); the trainer keeps its own
            assert flushed["child_policy"] == os.SCHED_IDLE and flushed["own_policy"] == os.SCHED_OTHER
        else:
            assert init == {"event": "init", "exporters": ["MlflowExporter"], "sidecar_pid": None,
                            "mlflow_imported": True}
            assert flushed["child_nice"] is None
        assert_steps(store, name, range(1, 9))  # 1..4 delivered by flush(), 5..8 by the exit hook
        exp, run = get_run(MlflowClient(store), name)
        assert run.info.status == "FINISHED"


def test_trainer_sigkilled_export_process_delivers_what_it_received_and_exits(store, tmp_path):
    name, steps = project("trainer-killed"), 30
    t = _trainer(tmp_path, "sigkill", name, steps, store)
    child = None
    try:
        init = t.wait_event(lambda e: e.get("event") == "init", 60)
        assert init["exporters"] == ["RemoteExporter"] and not init["mlflow_imported"]
        child = init["sidecar_pid"]
        t.wait_event(lambda e: e.get("event") == "ready", 60)
        before = points(store, name, "n")
        os.kill(t.proc.pid, signal.SIGKILL)  # the trainer only: the export process sees EOF on its pipe
        assert t.wait(30) == -signal.SIGKILL
        # the export process was still importing MLflow / writing when the trainer died ...
        assert len(before) < steps, before
        # ... and delivers everything it had received, then exits on its own
        deadline = time.monotonic() + 60
        while len(points(store, name, "n")) < steps and time.monotonic() < deadline:
            time.sleep(0.2)
        assert wait_gone(child, 60), "the export process did not exit after the trainer died"
        assert_steps(store, name, range(1, steps + 1))
        exp, run = get_run(MlflowClient(store), name)
        # nothing said how the trainer ended: its run is left RUNNING, as with MLflow in the trainer itself
        assert run.info.status == "RUNNING"
    finally:
        t.kill()  # the trainer's process group: also an export process still running
        if child is not None:
            kill_pid(child)


def test_export_process_dying_during_shutdown_loses_nothing(store, tmp_path):
    """The trainer (MLflow not imported there: auto) calls shutdown(); the export process dies while shutdown()
    waits for it.  The trainer takes the exporter back, so every step must be in the store and the run ended."""
    name, steps = project("shutdown-death"), 3
    t = _trainer(tmp_path, "dies-during-shutdown", name, steps, store)
    try:
        t.wait_event(lambda e: e.get("event") == "shutdown", 90)
        assert t.wait(60) == 0, t.stderr()[-3000:]
    finally:
        t.kill()
    assert_steps(store, name, range(1, 2 * steps + 1), exactly_once=False)
    exp, run = get_run(MlflowClient(store), name)
    assert run.info.status == "FINISHED"


# ----------------------------------------------------------------------------- 5. the export process dies


def test_export_process_sigkilled_exporters_continue_in_the_trainer(store, monkeypatch, caplog):
    """Batches the export process had received but not delivered (it is SIGSTOPped, then SIGKILLed) are
    delivered again by the trainer, which recreates the exporter in-process; nothing is lost."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("child-killed")
    h = start(project=name, experiment="e", exporters=["mlflow"], batch_delay_s=0.05, export_process="true")
    client_ = h._export_process
    for n in range(1, 6):
        otel_rl.log(step_values(n), step=n)
    assert h.flush(60)
    assert_steps(store, name, range(1, 6))
    os.kill(client_.pid, signal.SIGSTOP)  # the export process can no longer deliver (nor confirm)
    for n in range(6, 11):
        otel_rl.log(step_values(n), step=n)
    time.sleep(0.5)  # > batch_delay_s: steps 6..10 were handed to the export process (its pipe)
    assert_steps(store, name, range(1, 6))  # ... and not delivered by it
    os.kill(client_.pid, signal.SIGKILL)
    for n in range(11, 14):  # logged while the trainer may not have noticed the death yet
        otel_rl.log(step_values(n), step=n)
    assert h.flush(60)  # waits for the takeover and the re-delivery
    assert client_.proc.returncode == -signal.SIGKILL and not client_.alive
    (mlflow_exp,) = h.exporters
    assert isinstance(mlflow_exp, MlflowExporter) and not getattr(mlflow_exp, "remote", False)
    assert "export process ended unexpectedly" in caplog.text
    assert_steps(store, name, range(1, 14), exactly_once=False)  # delivered by the trainer before shutdown
    for n in range(14, 16):  # after the takeover: straight to the in-process exporter
        otel_rl.log(step_values(n), step=n)
    assert h.flush(60)
    stats = h.stats()["exporters"]["mlflow"]
    assert stats["exported"] > 0 and stats["queued"] == 0 and stats["dropped"] == 0, stats
    h.shutdown()
    # at least once: every step is there; a batch the export process delivered but had not confirmed yet
    # would be there twice (not the case here: it was stopped before it could deliver)
    assert_steps(store, name, range(1, 16), exactly_once=False)
    exp, run = get_run(MlflowClient(store), name)  # one run: the trainer's exporter re-attached to it
    assert run.info.status == "FINISHED" and run.data.tags[otel_rl_mlflow.RUN_ID_TAG] == h.run_id


def test_trajectories_in_flight_when_the_export_process_dies_arrive_whole(store, monkeypatch, caplog):
    """The export process builds trajectories from the spans it is sent.  Spans it holds for a trajectory
    whose root has not ended are not settled: when it dies they are sent again, with the rest of that
    trajectory, to the exporter that takes over in the trainer, which stores the trajectory whole."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("traj-death")
    h = start(project=name, experiment="e", exporters=["mlflow"], trace_backend="mlflow", batch_delay_s=0.05,
              export_process="true")
    pid = h._export_process.pid
    with otel_rl.step(1):
        with otel_rl.trajectory(sample_index=0, rollout_n=0):  # A: delivered by the export process
            plan("a")
            generate([1, 2, 3])
    assert h.flush(60)
    with otel_rl.step(2):
        with otel_rl.trajectory(sample_index=0, rollout_n=0):  # B: started before the death, ended after
            plan("b")
            generate([4, 5])
            time.sleep(0.3)  # > batch_delay_s: these two spans are in the export process, held for B
            assert h.flush(60)  # delivered everything it could; B's spans are not settled
            os.kill(pid, signal.SIGKILL)
            assert wait_gone(pid, 10)
            calculator("2+2", tool_call_id="c-b")
        with otel_rl.trajectory(sample_index=1, rollout_n=0):  # C: after the death
            plan("c")
    assert h.flush(60)
    assert "export process ended unexpectedly" in caplog.text
    h.shutdown()
    exp, run = get_run(MlflowClient(store), name)
    found = {(tr.info.tags["step"], tr.info.tags["sample_index"]): sorted(s.name for s in tr.data.spans)
             for tr in traces_of(exp.experiment_id, run_id=run.info.run_id)}
    assert found == {
        ("1", "0"): sorted(["rl.trajectory", "plan", "chat policy-7b"]),
        ("2", "0"): sorted(["rl.trajectory", "plan", "chat policy-7b", "execute_tool calculator"]),
        ("2", "1"): sorted(["rl.trajectory", "plan"]),
    }


def _t2t_outputs(store: str, name: str) -> dict[tuple[str, str], list[dict]]:
    """(step, sample_index) -> the outputs of the trace's LLM spans, in start order."""
    exp, run = get_run(MlflowClient(store), name)
    out = {}
    for tr in traces_of(exp.experiment_id, run_id=run.info.run_id):
        spans = sorted((s for s in tr.data.spans if s.name.startswith("chat")), key=lambda s: s.start_time_ns)
        out[(tr.info.tags["step"], tr.info.tags["sample_index"])] = [s.outputs for s in spans]
    return out


@pytest.mark.parametrize("travels", [True, False])
def test_token2text_decodes_where_the_trajectories_are_built(store, monkeypatch, travels):
    """token2text with the trackers in the export process: a tokenizer that can be pickled goes there once
    and the ids are decoded there (the trainer's tokenizer object is never called); one that cannot be
    pickled decodes in the trainer's pipeline thread.  The stored outputs are the same either way."""
    from t2t_tokenizers import CountingTokenizer, LockedTokenizer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("t2t-remote" if travels else "t2t-local")
    tok = CountingTokenizer() if travels else LockedTokenizer()
    h = start(project=name, experiment="e", exporters=["mlflow"], trace_backend="mlflow", token2text=True,
              tokenizer=tok, batch_delay_s=0.05, export_process="true")
    assert h._export_process is not None
    for step in (1, 2):
        with otel_rl.step(step):
            for i in range(3):
                with otel_rl.trajectory(sample_index=i, rollout_n=0):
                    generate([i, 1, 2])
                    generate([3, i])
    assert h.flush(60)
    h.shutdown()
    assert (tok.calls == 0) if travels else (tok.calls > 0)
    found = _t2t_outputs(store, name)
    assert set(found) == {(str(s), str(i)) for s in (1, 2) for i in range(3)}
    for (_, i), outputs in found.items():
        i = int(i)
        assert outputs == [
            {"prompt_ids": [i, 1, 2], "response_ids": [7, 8, 9], "text": "x = 4",
             "prompt_text": chr(97 + i) + "bc", "response_text": "hij"},
            {"prompt_ids": [3, i], "response_ids": [7, 8, 9], "text": "x = 4",
             "prompt_text": "d" + chr(97 + i), "response_text": "hij"},
        ]


def test_token2text_tokenizer_that_does_not_load_in_the_export_process(store, monkeypatch):
    """A tokenizer that pickles but fails to load in the export process: the trajectories are stored whole,
    their outputs keep the ids without texts (the export process warns), and the trainer goes on."""
    from t2t_tokenizers import HomeboundTokenizer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("t2t-noload")
    tok = HomeboundTokenizer()
    h = start(project=name, experiment="e", exporters=["mlflow"], trace_backend="mlflow", token2text=True,
              tokenizer=tok, batch_delay_s=0.05, export_process="true")
    for step in (1, 2):
        with otel_rl.step(step):
            with otel_rl.trajectory(sample_index=0, rollout_n=0):
                generate([0, 1])
        otel_rl.log({"x": float(step)}, step=step)
    assert h.flush(60)
    h.shutdown()
    assert tok.calls == 0
    assert _t2t_outputs(store, name) == {
        (str(s), "0"): [{"prompt_ids": [0, 1], "response_ids": [7, 8, 9], "text": "x = 4"}] for s in (1, 2)}
    assert points(store, name, "x") == [(1, 1.0), (2, 2.0)]


def test_token2text_after_the_export_process_died_decodes_in_the_trainer(store, monkeypatch, caplog):
    """The ids shipped with spans the export process never confirmed are decoded by the takeover in the
    trainer, with the trainer's own tokenizer; so are those of spans that come after the death."""
    from t2t_tokenizers import CountingTokenizer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("t2t-death")
    tok = CountingTokenizer()
    h = start(project=name, experiment="e", exporters=["mlflow"], trace_backend="mlflow", token2text=True,
              tokenizer=tok, batch_delay_s=0.05, export_process="true")
    pid = h._export_process.pid
    with otel_rl.step(1):
        with otel_rl.trajectory(sample_index=0, rollout_n=0):
            generate([0, 1])
    assert h.flush(60) and tok.calls == 0  # decoded in the export process
    os.kill(pid, signal.SIGSTOP)  # it receives step 2 but can neither deliver nor confirm it
    with otel_rl.step(2):
        with otel_rl.trajectory(sample_index=0, rollout_n=0):
            generate([2, 3])
    time.sleep(0.3)  # > batch_delay_s: shipped
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid, 10)
    with otel_rl.step(3):
        with otel_rl.trajectory(sample_index=0, rollout_n=0):
            generate([4])
    assert h.flush(60)
    assert "export process ended unexpectedly" in caplog.text
    h.shutdown()
    assert tok.calls > 0
    found = _t2t_outputs(store, name)
    assert {k: [(o["prompt_text"], o["response_text"]) for o in v] for k, v in found.items()} == {
        ("1", "0"): [("ab", "hij")], ("2", "0"): [("cd", "hij")], ("3", "0"): [("e", "hij")]}


def _three_steps_delivered(store: str, monkeypatch: Any, label: str) -> tuple[Any, str]:
    """An MLflow exporter in the export process that has delivered steps 1..3 (flushed)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project(label)
    h = start(project=name, experiment="e", exporters=["mlflow"], batch_delay_s=0.05, export_process="true")
    for n in range(1, 4):
        otel_rl.log(step_values(n), step=n)
    assert h.flush(60)
    return h, name


def test_flush_in_progress_when_the_export_process_dies_waits_for_the_takeover(store, monkeypatch):
    h, name = _three_steps_delivered(store, monkeypatch, "flush-death")
    pid = h._export_process.pid
    os.kill(pid, signal.SIGSTOP)  # steps 4..6 reach it but are not delivered
    for n in range(4, 7):
        otel_rl.log(step_values(n), step=n)
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))  # dies while flush() waits for it
    killer.start()
    try:
        ok = h.flush(60)
    finally:
        killer.join()
    assert ok, "flush() returned False although the trainer re-delivers the batches in-process"
    assert_steps(store, name, range(1, 7), exactly_once=False)


# ----------------------------------------------------------------------------- 6. crash -> SwanLab crashed


SWAN_CRASH = textwrap.dedent("""
    import json, sys, otel_rl
    h = otel_rl.init(project="crash", experiment="remote", exporters=["swanlab"], batch_delay_s=5.0)
    print(json.dumps({"exporters": [type(e).__name__ for e in h.exporters], "sidecar_pid": h._export_process.pid,
                      "swanlab_imported": "swanlab" in sys.modules}), flush=True)
    for n in range(1, 4):
        with otel_rl.step(n):
            otel_rl.log({"x": float(n), "i": n, "nan": float("nan")}, step=n)
        if n == 1:
            otel_rl.flush()  # the SwanLab run is open in the export process before the failure
    otel_rl.log_generations([("in", "out", 0.5)], step=3)
    raise RuntimeError("boom")  # steps 2, 3 and the generations are still queued (batch delay 5 s)
""")


def test_uncaught_exception_in_the_trainer_marks_the_swanlab_run_crashed(swan_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SWAN_CRASH, encoding="utf-8")
    env = clean_env(SWANLAB_LOG_DIR=str(swan_env), SWANLAB_ROOT=str(tmp_path / "swanroot"))
    t = LineProcess([sys.executable, str(script)], env, tmp_path, "swan-crash")
    try:
        info = t.wait_event(lambda e: "exporters" in e, 60)
        assert t.wait(120) == 1
    finally:
        t.kill()
    assert info["exporters"] == ["RemoteExporter"] and info["swanlab_imported"] is False
    assert wait_gone(info["sidecar_pid"], 10)
    assert "RuntimeError: boom" in t.stderr()
    r = _only_run(swan_env)
    assert r.state == "RUN_STATE_CRASHED"
    assert set(r.scalars) == {1, 2, 3}
    for n in (1, 2, 3):
        row = r.scalars[n]
        assert set(row) == {"x", "i", "nan"} and row["x"] == float(n) and row["i"] == float(n), row
        assert math.isnan(row["nan"])
    assert r.table(sc.VAL_GENERATIONS_KEY, 3)["rows"] == [[3, "in", "out", 0.5]]


# ----------------------------------------------------------------------------- 7. wandb


def test_wandb_through_the_export_process(wandb_dir):  # noqa: F811
    h = start(config=VERL_CONFIG, project="otel-rl-test", experiment="remote", exporters=["wandb"],
              batch_delay_s=0.05, export_process="true")
    (wb,) = h.exporters
    assert isinstance(wb, RemoteExporter) and wb.exporter_class is WandbExporter
    child = h._export_process.proc
    expected = {}
    for n in (1, 2, 3):
        first, second = _step_values(n)
        otel_rl.log(first, step=n)
        otel_rl.log(second, step=n)
        expected[n] = _expected(n)
        assert h.flush(60)
    otel_rl.log_generations([("问题", "答案", 1.0), ("q2", "a2", 0.5)], step=3)
    h.shutdown()
    assert child.wait(10) == 0
    stats = h.stats()["exporters"]["wandb"]
    assert stats["exported"] > 0 and stats["dropped"] == 0 and stats["failed_attempts"] == 0, stats

    data = _one_run(wandb_dir, h.run_id)
    assert (data.project, data.display_name) == ("otel-rl-test", "remote")
    assert data.config == scrub_secrets(VERL_CONFIG)
    assert [r[otel_rl_wandb.STEP_METRIC] for r in _metric_rows(data)] == [1, 2, 3]  # one row per step
    _assert_rows(data, expected)
    table = data.table(sc.VAL_GENERATIONS_KEY)
    assert table["data"] == [[3, "问题", "答案", 1, "q2", "a2", 0.5]]


CONSOLE_TRAINER = textwrap.dedent("""
    import json, logging, sys, otel_rl
    h = otel_rl.init(project="otel-rl-test", experiment="console", exporters=["wandb", "swanlab"],
                     batch_delay_s=0.05, export_process="true")
    print(json.dumps({"exporters": [type(e).__name__ for e in h.exporters],
                      "imported": [m for m in ("wandb", "swanlab") if m in sys.modules]}), flush=True)
    print("before the runs open: line 1")  # the runs open at the first delivery: kept until then
    for n in range(1, 4):
        otel_rl.log({"x": float(n)}, step=n)
        print(f"step {n}: 训练 reward={n / 4}")
        sys.stderr.write(f"warning at step {n}\\n")
        if n == 2:
            assert h.flush(120)
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s")
    logging.getLogger("trainer").warning("from logging")
    sys.stdout.write("no newline yet, ")
    sys.stdout.write("then one\\n")
    h.shutdown()
    print("after shutdown: stays in this process")
""")


@pytest.mark.parametrize("setting", ["on", "off", "runs without a console"])
def test_the_training_processs_console_goes_to_the_wandb_and_swanlab_runs(wandb_dir, swan_env, tmp_path,
                                                                          setting):
    """wandb and SwanLab record the console of the process that opens their run; run in the export process
    they get the training process's (forward_console), as when they run in it -- unless forward_console is
    off, or the runs are set to record no console."""
    forward = setting == "on"
    from otel_rl_wandb.reader import find_run_dirs
    from trackers.test_wandb import _wandb_env

    script = tmp_path / "console_trainer.py"
    script.write_text(CONSOLE_TRAINER, encoding="utf-8")
    env = clean_env(SWANLAB_LOG_DIR=str(swan_env), SWANLAB_ROOT=str(tmp_path / "swanroot"), OTEL_RL_RUN_ID="console01",
                    **_wandb_env(wandb_dir))
    if setting == "off":
        env["OTEL_RL_FORWARD_CONSOLE"] = "false"
    elif setting == "runs without a console":
        env.update(WANDB_CONSOLE="off", SWANLAB_TERMINAL_PROXY_TYPE="none")
    t = LineProcess([sys.executable, str(script)], env, tmp_path, "console")
    try:
        info = t.wait_event(lambda e: "exporters" in e, 60)
        assert t.wait(180) == 0, t.stderr()[-3000:]
    finally:
        t.kill()
    assert info == {"exporters": ["RemoteExporter", "RemoteExporter"], "imported": []}  # both in the export process
    # the terminal gets every line once, as written
    printed = ["before the runs open: line 1", "step 1: 训练 reward=0.25", "step 2: 训练 reward=0.5",
               "step 3: 训练 reward=0.75", "no newline yet, then one", "after shutdown: stays in this process"]
    assert [line for line in t.lines if line in printed] == printed  # (the export process prints there too)
    err = t.stderr()
    for n in (1, 2, 3):
        assert err.count(f"warning at step {n}\n") == 1
    assert err.count("WARNING from logging") == 1
    trainer_lines = ["before the runs open: line 1", "step 1: 训练 reward=0.25", "warning at step 1",
                     "step 2: 训练 reward=0.5", "warning at step 2", "step 3: 训练 reward=0.75", "warning at step 3",
                     "WARNING from logging", "no newline yet, then one"]

    # wandb: the run's output.log (what its Logs tab shows), written by wandb from the console records
    data = _one_run(wandb_dir, "console01")
    _assert_rows(data, {n: {"x": float(n)} for n in (1, 2, 3)})
    (run_dir,) = find_run_dirs(wandb_dir, run_id="console01")
    log_file = Path(run_dir) / "files" / "output.log"
    if forward:
        wb_lines = [line.rstrip("\r") for line in log_file.read_text(encoding="utf-8").splitlines()]
        found = [line for line in wb_lines if line in trainer_lines]
        assert found == trainer_lines, wb_lines  # every line of the training process, in order
        assert "after shutdown: stays in this process" not in wb_lines
    else:
        text = log_file.read_text(encoding="utf-8") if log_file.exists() else ""
        assert not any(line in text for line in trainer_lines), text

    # SwanLab: the run's console log records
    r = _only_run(swan_env)
    assert set(r.scalars) == {1, 2, 3}
    swan_lines = [line for _, line in r.logs]
    if forward:
        found = [line for line in swan_lines if line in trainer_lines]
        # stdout and stderr are two streams there, each in order
        assert [x for x in found if not x.startswith(("warning", "WARNING"))] == [
            x for x in trainer_lines if not x.startswith(("warning", "WARNING"))], swan_lines
        assert [x for x in found if x.startswith(("warning", "WARNING"))] == [
            x for x in trainer_lines if x.startswith(("warning", "WARNING"))], swan_lines
        assert dict((line, level) for level, line in r.logs)["warning at step 1"] in ("LOG_LEVEL_INFO",
                                                                                         "LOG_LEVEL_ERROR")
    else:
        assert not any(line in trainer_lines for line in swan_lines), swan_lines


# ----------------------------------------------------------------------------- 8. config


@pytest.mark.parametrize("given,want", [
    ("auto", "auto"), ("AUTO", "auto"), (" Auto ", "auto"), ("true", "true"), ("TRUE", "true"), ("1", "true"),
    ("yes", "true"), ("Yes", "true"), (True, "true"), ("false", "false"), ("False", "false"), ("0", "false"),
    ("no", "false"), ("NO", "false"), (False, "false"),
])
def test_export_process_setting_is_parsed(given, want):
    assert resolve(export_process=given).export_process == want
    if isinstance(given, str):
        assert resolve(env={"OTEL_RL_EXPORT_PROCESS": given}).export_process == want
        other = "false" if want != "false" else "true"
        assert resolve(env={"OTEL_RL_EXPORT_PROCESS": given}, export_process=other).export_process == other


def test_export_process_settings_defaults_errors_and_nice():
    cfg = resolve(env={})
    # auto by default; by default the export process runs at a lower priority (the niceness it really gets is
    # checked in test_auto_runs_mlflow_in_the_export_process_unless_the_trainer_imported_mlflow)
    assert cfg.export_process == "auto"
    assert type(cfg.export_process_nice) is int and 0 < cfg.export_process_nice <= 19
    assert resolve(export_process_nice="3").export_process_nice == 3
    assert resolve(env={"OTEL_RL_EXPORT_PROCESS_NICE": "15"}).export_process_nice == 15
    assert resolve(env={"OTEL_RL_EXPORT_PROCESS_NICE": "15"}, export_process_nice=0).export_process_nice == 0
    for bad in ("maybe", "2", "sometimes"):
        with pytest.raises(otel_rl.ConfigError, match="export_process"):
            resolve(export_process=bad)
        with pytest.raises(otel_rl.ConfigError, match="export_process \\(from env OTEL_RL_EXPORT_PROCESS\\)"):
            resolve(env={"OTEL_RL_EXPORT_PROCESS": bad})
    assert cfg.export_process_idle is True
    assert resolve(env={"OTEL_RL_EXPORT_PROCESS_IDLE": "false"}).export_process_idle is False
    assert resolve(export_process_idle="0").export_process_idle is False
    with pytest.raises(otel_rl.ConfigError, match="export_process_idle"):
        resolve(env={"OTEL_RL_EXPORT_PROCESS_IDLE": "lazy"})
    with pytest.raises(otel_rl.ConfigError, match="export_process_nice"):
        resolve(export_process_nice="high")
    with pytest.raises(otel_rl.ConfigError, match="export_process_nice"):
        resolve(env={"OTEL_RL_EXPORT_PROCESS_NICE": "x"})
    # init() validates before anything starts: no pipeline, no export process
    with pytest.raises(otel_rl.ConfigError, match="export_process"):
        otel_rl.init(exporters=["mlflow"], export_process="perhaps")
    assert otel_rl.current() is None


def test_export_process_starts_at_the_trainers_priority_then_idles_once_its_run_is_open(store, monkeypatch):
    """While its tracker starts, the export process runs at the training process's priority (the tracker run
    opens during the first steps, not in shutdown()); once the run is open, every thread of it goes to the idle
    class at its niceness, and so do the threads it starts later."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    h = start(project=project("prio"), experiment="e", exporters=["mlflow"], export_process="true",
              export_process_nice=5, export_process_idle=True)
    try:
        pid = h._export_process.pid
        # (MLflow's import alone takes longer than this look: its run cannot be open yet)
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER and nice_of(pid) == os.nice(0)
        otel_rl.log({"x": 1.0}, step=1)
        assert h.flush(60)  # delivered: the run is open, and the child settled before it answered
        tids = os.listdir(f"/proc/{pid}/task")
        assert len(tids) > 1
        checked = 0
        for tid in tids:
            try:  # (a thread that has just ended, such as the one that answered the flush, is gone)
                policy, nice = os.sched_getscheduler(int(tid)), nice_of(int(tid))
            except (ProcessLookupError, FileNotFoundError):
                continue
            assert policy == os.SCHED_IDLE and nice == min(19, os.nice(0) + 5)
            checked += 1
        assert checked > 1
        otel_rl.log({"x": 2.0}, step=2)
        assert h.flush(60)
        later = set(os.listdir(f"/proc/{pid}/task")) - set(tids)  # e.g. the thread answering this flush
        for tid in later:
            try:
                assert os.sched_getscheduler(int(tid)) == os.SCHED_IDLE
            except (ProcessLookupError, FileNotFoundError):
                continue
    finally:
        h.shutdown()


def test_export_process_setting_decides_where_the_exporter_runs(store, monkeypatch):
    """From the environment and from kwargs; the pytest process has mlflow imported, so auto keeps it here."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert "mlflow" in sys.modules
    cases = [({"OTEL_RL_EXPORT_PROCESS": "Yes"}, {}, True),
             ({"OTEL_RL_EXPORT_PROCESS": "yes"}, {"export_process": "0"}, False),  # the kwarg wins
             ({}, {}, False),  # auto, and mlflow is imported here
             ({"OTEL_RL_EXPORT_PROCESS": "off"}, {}, False)]
    for env, kw, remote in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        name = project("where")
        h = start(project=name, experiment="e", exporters=["mlflow"], batch_delay_s=0.05, **kw)
        (e,) = h.exporters
        assert isinstance(e, RemoteExporter if remote else MlflowExporter), (env, kw)
        assert (h._export_process is not None) == remote
        otel_rl.log(step_values(1), step=1)
        h.shutdown()
        assert_steps(store, name, range(1, 2))
        for k in env:
            monkeypatch.delenv(k)


# ----------------------------------------------------------------------------- 9. SIGINT


def test_export_process_ignores_sigint(store, monkeypatch):
    h, name = _three_steps_delivered(store, monkeypatch, "sigint")
    child = h._export_process.proc
    os.kill(child.pid, signal.SIGINT)  # what a Ctrl-C in the terminal sends to the whole process group
    time.sleep(0.5)
    assert child.poll() is None and pid_alive(child.pid)
    for n in range(4, 7):
        otel_rl.log(step_values(n), step=n)
    assert h.flush(60)
    assert_steps(store, name, range(1, 7))  # delivered by the same export process: exactly once
    assert child.poll() is None and h._export_process.alive
    assert [type(e) for e in h.exporters] == [RemoteExporter]  # no takeover happened
    h.shutdown()
    assert child.wait(10) == 0


class _RunsExporter:
    """What `Server._settle` looks at: a tracker exporter's open runs (and its queue's failures)."""

    name = "runs"
    wants_records = True
    wants_spans = False
    wants_trajectories = False

    def __init__(self) -> None:
        self.runs: dict = {}

    def export_records(self, records: Any) -> None:
        self.runs.setdefault("run", object())

    def export_spans(self, spans: Any) -> None:
        pass


def test_export_process_gc_waits_for_the_runs_then_freezes_them():
    """The export process collects nothing while its trackers import their libraries and open their runs;
    once every run is open (or the time is up) it freezes what there is (without a collection: the
    import-time cycles stay) and turns the GC on."""
    import gc
    import weakref

    class Cycle:
        pass

    from otel_rl._delivery import DeliveryQueue
    from otel_rl.export_process.server import Server

    r, w = os.pipe()
    server = Server(os.fdopen(r, "rb"), os.fdopen(w, "wb"))
    exp = _RunsExporter()
    q = DeliveryQueue(exp, 100)
    server.queues["runs"] = q
    was_enabled = gc.isenabled()
    try:
        gc.disable()
        server._start_by = time.monotonic() + 60.0
        server._gc_off = True
        server._settle()
        assert not gc.isenabled() and server._start_by is not None  # no run open yet
        q.put([], ["a record"])
        assert q.wait_idle(5.0) and exp.runs
        frozen_before = gc.get_freeze_count()
        garbage = Cycle()
        garbage.me = garbage
        garbage_ref = weakref.ref(garbage)
        del garbage
        server._settle()
        assert gc.isenabled() and server._start_by is None
        assert gc.get_freeze_count() > frozen_before
        gc.collect()
        assert garbage_ref() is not None  # frozen with the rest, not collected
        after = Cycle()
        after.me = after
        after_ref = weakref.ref(after)
        del after
        gc.collect()
        assert after_ref() is None  # later garbage is collected as usual

        # the time limit: a run that never opens does not keep the GC off
        gc.unfreeze()
        gc.disable()
        exp.runs.clear()
        server._start_by = time.monotonic() - 1.0
        server._gc_off = True
        server._settle()
        assert gc.isenabled() and server._start_by is None
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()
        q.stop(2.0)
        server.r.close()
        server.w.close()


class _GatedExporter:
    """Delivers one batch per permit (`allow`); remembers what it got."""

    wants_records = True
    wants_spans = False
    wants_trajectories = False

    def __init__(self, name: str, permits: int = 10**6) -> None:
        self.name = name
        self.got: list = []
        self._permits = threading.Semaphore(permits)

    def allow(self, n: int) -> None:
        for _ in range(n):
            self._permits.release()

    def export_records(self, records: Any) -> None:
        self._permits.acquire()
        self.got.extend(records)

    def export_spans(self, spans: Any) -> None:
        pass


def test_export_process_settles_each_batch_once_every_queue_has_delivered_it():
    """What the export process tells the training process it may forget (`Server.settled`): the batches
    below each queue's oldest one held only in memory.  A queue that is behind holds back the batches it
    has not delivered, a queue that is ahead does not hold back the others'; a batch on its way to the
    spool, or spans held for a trajectory still open, hold back theirs."""
    from otel_rl._delivery import DeliveryQueue
    from otel_rl.export_process.server import Server

    r, w = os.pipe()
    server = Server(os.fdopen(r, "rb"), os.fdopen(w, "wb"))
    fast, slow = _GatedExporter("fast"), _GatedExporter("slow", permits=0)
    server.queues["fast"] = DeliveryQueue(fast, 1000)
    server.queues["slow"] = DeliveryQueue(slow, 1000)
    try:
        assert server.settled() == 0
        for seq in range(1, 5):
            server.put(seq, [f"r{seq}"], ("fast", "slow"))
        assert server.queues["fast"].wait_idle(5.0) and fast.got == ["r1", "r2", "r3", "r4"]
        assert server.settled() == 0  # "slow" has not delivered batch 1
        slow.allow(2)
        assert wait_for(lambda: len(slow.got) == 2, 10.0)
        assert wait_for(lambda: server.settled() == 2, 10.0)  # 1 and 2 delivered by both; 3 in flight in "slow"
        server.put(5, ["r5"], ("fast",))  # only for "fast": delivered at once, but behind 3 and 4
        assert server.queues["fast"].wait_idle(5.0)
        assert server.settled() == 2
        slow.allow(2)
        assert server.queues["slow"].wait_idle(5.0) and slow.got == ["r1", "r2", "r3", "r4"]
        assert server.settled() == 5
        server.queues["slow"]._spilling = 1  # a spill in progress: its batches are in neither place
        server.put(6, ["r6"], ("fast",))
        assert server.queues["fast"].wait_idle(5.0)
        assert server.settled() == 0
        server.queues["slow"]._spilling = 0
        assert server.settled() == 6
    finally:
        slow.allow(100)
        for q in server.queues.values():
            q.stop(2.0)
        server.r.close()
        server.w.close()


class _ClosingExporter(_GatedExporter):
    """A gated exporter whose `shutdown` notes when it ran (its tracker run closed)."""

    def __init__(self, name: str, permits: int = 10**6) -> None:
        super().__init__(name, permits)
        self.shut_at: float | None = None
        self.flushed = False

    def flush(self, timeout_s: float = 0.0) -> bool:
        self.flushed = True
        return True

    def shutdown(self) -> None:
        self.shut_at = time.monotonic()


def test_export_process_stop_finishes_each_exporter_without_waiting_for_the_others():
    """At the end, each exporter of the export process gets its last delivery, its flush and its shutdown
    on its own: one still delivering does not hold back another's run from closing.  The process reports
    "stopped" once all of them are done, with everything delivered."""
    from otel_rl._delivery import DeliveryQueue
    from otel_rl.export_process.server import Server

    r, w = os.pipe()
    reader = os.fdopen(r, "rb")
    server = Server(reader, os.fdopen(w, "wb"))
    fast, slow = _ClosingExporter("fast"), _ClosingExporter("slow", permits=0)
    server.queues["fast"] = DeliveryQueue(fast, 1000)
    server.queues["slow"] = DeliveryQueue(slow, 1000)
    stopper = threading.Thread(target=server.stop, args=(30.0,))
    try:
        for seq in range(1, 4):
            server.put(seq, [f"r{seq}"], ("fast", "slow"))
        stopper.start()
        # "slow" cannot deliver yet: "fast" is delivered, flushed and shut down all the same
        assert wait_for(lambda: fast.shut_at is not None, 10.0)
        assert fast.got == ["r1", "r2", "r3"] and fast.flushed
        assert slow.shut_at is None and slow.got == [] and stopper.is_alive()
        assert not server.stop_event.is_set()
        slow.allow(100)
        stopper.join(10.0)
        assert not stopper.is_alive()
        assert slow.got == ["r1", "r2", "r3"] and slow.flushed and slow.shut_at is not None
        assert slow.shut_at > fast.shut_at
        assert server.stop_event.is_set()
        msg = read_frame(reader)
        assert type(msg) is Stopped and msg.stats["slow"]["exported"] == 3 and msg.stats["fast"]["exported"] == 3
    finally:
        slow.allow(100)
        stopper.join(10.0)
        server.r.close()
        server.w.close()


def test_training_process_forgets_what_a_gathering_exporter_has_delivered(store, monkeypatch):
    """The MLflow exporter gathers batches (export_interval_s), so under a steady stream its queue in the
    export process is never empty.  The training process's copies of the batches sent (kept to send again
    should the export process die) must still go once delivered, not pile up until its cap."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("settle")
    h = start(project=name, experiment="e", exporters=["mlflow"], batch_delay_s=0.02, export_process="true",
              export_interval_s=1.0)
    client = h._export_process
    try:
        otel_rl.log(step_values(1), step=1)
        assert h.flush(60)  # the export process is up, its run open: what follows is the steady state
        sent = 1
        first = client._settled
        settled_seen = set()
        t0 = time.monotonic()
        while time.monotonic() < t0 + 6.0:  # a batch every ~20 ms: the queue gathers for 1 s, never empty
            sent += 1
            otel_rl.log(step_values(sent), step=sent)
            settled_seen.add(client._settled)
            time.sleep(0.01)
        seq = client._seq
        assert seq - first >= 100, (first, seq)
        # the confirmations follow the stream, each delivery (about one a second) settling what it took
        advanced = settled_seen - {first}
        assert len(advanced) >= 3, (first, sorted(settled_seen))
        lag = seq - client._settled
        assert lag < (seq - first) // 2, (client._settled, seq)
        assert len(client._unsettled) <= lag, (len(client._unsettled), lag)
        assert h.flush(60)
    finally:
        h.shutdown()
    assert_steps(store, name, range(1, sent + 1))


def test_a_batch_that_cannot_be_pickled_is_dropped_counted_and_logged_the_next_ones_arrive(store, monkeypatch,
                                                                                            caplog):
    """Batches are pickled when they are handed to the export process (once: what is sent is also the copy
    kept for re-delivery).  One that cannot be pickled is dropped with an error and counted; the sender
    keeps going and the batches after it arrive."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = project("unpicklable")
    h = start(project=name, experiment="e", exporters=["mlflow"], export_process="true")
    client = h._export_process
    try:
        otel_rl.log(step_values(1), step=1)
        assert h.flush(60)
        seq = client._seq
        with caplog.at_level("ERROR", logger="otel_rl"):
            client.send([lambda: 0, "another record"], client.names)
        assert client.dropped == 2 and client._seq == seq
        assert "could not be pickled" in caplog.text and "2 items dropped" in caplog.text
        otel_rl.log(step_values(2), step=2)
        assert h.flush(60)
        assert client.alive and client._seq == seq + 1
    finally:
        h.shutdown()
    assert_steps(store, name, [1, 2])


def test_export_process_marks_probed_modules_that_are_not_installed():
    """`_mark_absent`: a module that is not installed fails every later import at once (MLflow tries
    ``import litellm`` for each LLM span it stores); an installed one is left alone."""
    import importlib

    from otel_rl.export_process.ostune import mark_absent

    missing = f"otel_rl_not_installed_{uuid.uuid4().hex}"
    present = "colorsys"  # stdlib, not imported by anything here
    sys.modules.pop(present, None)
    try:
        mark_absent([missing, present])
        assert sys.modules[missing] is None
        with pytest.raises(ImportError):
            importlib.import_module(missing)
        assert present not in sys.modules  # not marked, not imported
        assert importlib.import_module(present).rgb_to_hsv(1, 0, 0)[2] == 1
    finally:
        sys.modules.pop(missing, None)


def thread_affinities(pid: int) -> dict[str, set[int]]:
    """Thread id -> CPUs it may run on, for every thread of process `pid` that is still there when read."""
    seen = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            seen[t] = os.sched_getaffinity(int(t))
        except ProcessLookupError:  # a short-lived thread (the one answering a flush) ended meanwhile
            pass
    return seen


def test_export_process_cpus_keeps_the_export_process_and_its_threads_on_those_cpus(store, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    for spec, want in (("last", {allowed[-1]}), (str(allowed[0]), {allowed[0]}), (None, set(allowed))):
        h = start(project=project("cpus"), experiment="e", exporters=["mlflow"], export_process="true",
                  batch_delay_s=0.05, export_process_cpus=spec)
        try:
            otel_rl.log(step_values(1), step=1)
            assert h.flush(60) is True  # the exporter's threads exist now
            pid = h._export_process.proc.pid
            seen = thread_affinities(pid)
            assert len(seen) > 2
            assert seen == {t: want for t in seen}, spec
        finally:
            h.shutdown(30)
    assert os.sched_getaffinity(0) == set(allowed)  # the trainer is left as it was
    assert resolve(export_process_cpus="0-1,3").export_process_cpus == "0-1,3"
    assert resolve(env={"OTEL_RL_EXPORT_PROCESS_CPUS": "off"}).export_process_cpus is None
    for bad in ("x", "3-1", "-1", "1,,2", "0-99999999"):
        with pytest.raises(otel_rl.ConfigError, match="export_process_cpus"):
            resolve(export_process_cpus=bad)


def test_export_process_cpus_none_of_which_is_available_leave_it_where_it_was_with_a_warning(store, monkeypatch,
                                                                                             capfd):
    allowed = set(os.sched_getaffinity(0))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    first = min(allowed)
    # CPU 65000 exists on no machine here: alone it is ignored (a warning, the process unpinned);
    # with an available one, that one is used
    for spec, want, warned in (("65000", allowed, True), (f"{first},65000", {first}, False)):
        name = project("cpus-missing")
        h = start(project=name, experiment="e", exporters=["mlflow"], export_process="true", batch_delay_s=0.05,
                  export_process_cpus=spec)
        try:
            for n in (1, 2):
                otel_rl.log(step_values(n), step=n)
            assert h.flush(60) is True
            pid = h._export_process.proc.pid
            seen = thread_affinities(pid)
            assert seen and all(v == want for v in seen.values()), (spec, seen)
        finally:
            h.shutdown(30)
        err = capfd.readouterr().err
        assert ("export_process_cpus=65000: none of these CPUs is available" in err) is warned, err[-2000:]
        client = MlflowClient(store)
        _, run = get_run(client, name)  # the data arrived either way
        assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "n")) == [(1, 1.0), (2, 2.0)]


def test_waiting_for_the_export_process_to_exit_returns_its_code_and_times_out_as_popen_does():
    # (the training process waits for the export process's exit where it has not said it is done: woken
    # by the exit itself)
    from otel_rl.export_process.ostune import wait_exit

    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert wait_exit(p, 60) == 3 and p.returncode == 3
    assert wait_exit(p, 1) == 3  # already reaped
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            wait_exit(p, 0.3)
        assert p.poll() is None
    finally:
        p.kill()
        assert wait_exit(p, 60) == -signal.SIGKILL


def test_the_export_process_says_stopped_then_done_after_its_exit_hooks(tmp_path):
    """At the end the export process says "stopped" (every tracker run finished: nothing is delivered again
    after it, whatever happens next), then "done" once the exit hooks have run, even the first registered
    (run last), and only then ends: the trainer waits for "done", not for the process's end."""
    from otel_rl.export_process.client import CHILD

    hook_file = tmp_path / "hook"
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import atexit, time
        def hook():
            time.sleep(0.3)
            open({str(hook_file)!r}, "w").write("ran")
        atexit.register(hook)
    """))
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)]))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(r_in), str(w_out)],
                            pass_fds=(r_in, w_out), env=env)
    os.close(r_in)
    os.close(w_out)
    try:
        with os.fdopen(w_in, "wb") as w, os.fdopen(r_out, "rb") as r:
            write_frame(w, Stop(10.0, None))
            seen = []
            while (msg := read_frame(r)) is not None:
                seen.append((type(msg), hook_file.exists()))
        assert seen == [(Stopped, False), (Done, True)]
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
