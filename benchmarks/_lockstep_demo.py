"""`otel-rl demo` that waits for a go-ahead after every training step (for ``bench_demo.py --lockstep``).

    python benchmarks/_lockstep_demo.py demo [demo arguments...]

After step k (the trainer's ``on_step`` callback) it writes ``"k seconds\\n"`` to the file
descriptor in ``LOCKSTEP_DONE_FD`` — the main thread's time from the go-ahead to the end of
step k, everything the training loop did for that step (the step, its ``log()``, the
progress callback) — and then blocks until one byte arrives on ``LOCKSTEP_GO_FD``.  The
benchmark stops the whole process group (this process, its threads, the export process and
what that started) between the two, so no part of it runs while the other variant's step runs.
"""

from __future__ import annotations

import os
import resource
import sys
import time


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def main() -> None:
    done_fd = int(os.environ["LOCKSTEP_DONE_FD"])
    go_fd = int(os.environ["LOCKSTEP_GO_FD"])

    if os.environ.get("LOCKSTEP_TORCH_FIRST") == "1":  # torch imported before init(), as the demo once did
        import otel_rl.demo.trainer  # noqa: F401
    import otel_rl

    init = otel_rl.init

    def init_then_pace(*args, **kwargs):  # the demo imports its trainer (and torch) after init(): so does this
        handle = init(*args, **kwargs)
        _pace(done_fd, go_fd)
        return handle

    otel_rl.init = init_then_pace
    from otel_rl.cli import program

    program()  # the `otel-rl` program itself: it runs the demo and exits as the program does


def _pace(done_fd: int, go_fd: int) -> None:
    from otel_rl.demo import trainer as trainer_mod

    base = trainer_mod.GRPOTrainer
    # LOCKSTEP_MUTE=1: telemetry set up as configured (threads, export process, trackers) but switched off
    # after step 0, as in a run without it: what its mere presence costs; =start: switched off from step 0 on
    mute = os.environ.get("LOCKSTEP_MUTE", "")
    # LOCKSTEP_SETTLE=1: step 0 ends with a flush (the trackers started, the export process idle): the steps
    # without the export process's start-up running beside them
    settle = os.environ.get("LOCKSTEP_SETTLE", "") == "1"
    # LOCKSTEP_HOLD_EXPORT=1: the export process (and what it started) stays stopped during steps 1..N-1 and
    # catches up at the end: the steps with the training process's share of the telemetry only
    hold = os.environ.get("LOCKSTEP_HOLD_EXPORT", "") == "1"
    # LOCKSTEP_QUIET_GEN=1: the export process (and what it started) is stopped while the trainer's "gen"
    # timer is open and continued when it closes: its work kept out of the rollouts
    quiet_gen = os.environ.get("LOCKSTEP_QUIET_GEN", "") == "1"
    # LOCKSTEP_ONLY_GEN=1: the reverse: the export process (and what it started) runs only while the trainer's
    # "gen" timer is open (stopped from its close to the next one's opening; continued after the last step)
    only_gen = os.environ.get("LOCKSTEP_ONLY_GEN", "") == "1"
    # LOCKSTEP_BURN=F[:P]: a process beside the trainer (in its process group, so paused with it; at the export
    # process's niceness and idle class) running allocation-heavy Python a fraction F of every P seconds (default
    # 0.1) and sleeping the rest: what another process's work on the other core costs the training thread, with
    # or without telemetry
    burn = os.environ.get("LOCKSTEP_BURN", "")
    if burn:
        _start_burner(burn)
    # LOCKSTEP_WAKE=HZ: a process beside the trainer (paused with it, at the export process's niceness and idle
    # class) that only wakes HZ times a second and sleeps again: what a neighbour's wake-ups cost the training
    # thread (wandb's service, a Go program, wakes ~100 times a second while a run is open)
    wake = os.environ.get("LOCKSTEP_WAKE", "")
    if wake:
        _start_waker(wake)
    from otel_rl import _runtime

    muted: list = []  # the runtime switched off (its pipeline still runs)

    def switch_off() -> None:
        if _runtime.active.handle is not None:
            muted[:] = [_runtime.active]
        _runtime.uninstall()  # what the decorators and context managers read

    if hold or quiet_gen or only_gen:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_telemetry_cpu import _descendants

    def export_pids() -> list[int]:
        rt = muted[0] if muted else _runtime.active
        remote = rt.handle._pipeline.remote if rt.handle is not None else None
        return _descendants(remote.pid) if remote is not None else []

    def signal_export(sig: int) -> None:
        for pid in export_pids():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    if quiet_gen or only_gen:
        import contextlib
        import signal

        import otel_rl

        timer = otel_rl.timer

        @contextlib.contextmanager
        def signalling_timer(name, *args, **kwargs):
            rollout = name == "gen"
            if rollout:
                signal_export(signal.SIGCONT if only_gen else signal.SIGSTOP)
            try:
                with timer(name, *args, **kwargs) as t:
                    yield t
            finally:
                if rollout:
                    signal_export(signal.SIGSTOP if only_gen else signal.SIGCONT)

        otel_rl.timer = signalling_timer

    class PacedTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, cfg, on_step=None):
            if mute == "start":
                switch_off()
            started = [time.perf_counter(), time.thread_time(), _faults()]

            def paced(step, metrics):
                if on_step is not None:
                    on_step(step, metrics)
                if step == 0 and settle:
                    import otel_rl

                    otel_rl.flush()  # the export process started and caught up before step 1 is timed
                seconds = time.perf_counter() - started[0]
                cpu = time.thread_time() - started[1]
                faults = _faults() - started[2]
                os.write(done_fd, f"{step} {seconds!r} {cpu!r} {faults}\n".encode())
                if os.read(go_fd, 1) != b"g":
                    raise SystemExit("lockstep: the benchmark went away")
                if mute in ("1", "start"):
                    switch_off()
                if hold or only_gen:  # the benchmark's go-ahead continued the whole process group
                    import signal

                    signal_export(signal.SIGCONT if step + 1 >= self.total_steps else signal.SIGSTOP)
                started[:] = [time.perf_counter(), time.thread_time(), _faults()]

            super().__init__(cfg, on_step=paced)

    trainer_mod.GRPOTrainer = PacedTrainer  # the demo's CLI imports it after init()


def _start_burner(spec: str) -> None:
    import subprocess

    duty_s, _, period_s = spec.partition(":")
    try:
        duty, period = float(duty_s), float(period_s or "0.1")
    except ValueError:
        duty = period = -1.0
    if not (0.0 < duty <= 1.0 and period > 0.0):
        raise SystemExit(f"LOCKSTEP_BURN={spec!r}: expected F or F:P, a fraction 0 < F <= 1 of every P > 0 seconds")
    here = os.path.dirname(os.path.abspath(__file__))
    # bench_neighbour.py's neighbour, at the export process's default niceness (19) and class (idle); its
    # files in this process's directory (the benchmark's, removed with it)
    subprocess.Popen([sys.executable, os.path.join(here, "bench_neighbour.py"), "--neighbour", "dicts",
                      "--workdir", os.getcwd(), "--duty", repr(duty),
                      "--period", repr(period), "--nice", "19"])


def _start_waker(spec: str) -> None:
    import subprocess

    try:
        hz = float(spec)
    except ValueError:
        hz = -1.0
    if not 0.0 < hz <= 10_000.0:
        raise SystemExit(f"LOCKSTEP_WAKE={spec!r}: expected a rate in wake-ups per second, 0 < HZ <= 10000")
    here = os.path.dirname(os.path.abspath(__file__))
    # bench_neighbour.py's neighbour doing no work, at the export process's niceness (19) and class (idle)
    subprocess.Popen([sys.executable, os.path.join(here, "bench_neighbour.py"), "--neighbour", "wake",
                      "--period", repr(1.0 / hz), "--nice", "19"])


if __name__ == "__main__":
    main()
