"""`log(<100 keys>)` with the TensorBoard, Trackio and ClearML exporters, beside verl's own call of each
tracker, in the same run.

    .venv/bin/python benchmarks/bench_new_trackers.py [--quick] [--md benchmarks/results/<date>-new-trackers.md]

Per tracker, every store local / offline in a temporary directory:

- verl: its own adapter's ``log(data, step)`` (``verl.utils.tracking``: ``_TensorboardAdapter`` — torch's
  SummaryWriter, one ``add_scalar`` per key; ``_TrackioLoggingAdapter`` — ``trackio.log``; ``ClearMLLogger``
  — one ``report_scalar`` per key, ClearML offline).  "caller": the calls alone; "end-to-end": the calls
  plus the tracker's flush (event file flushed, Trackio's queue written to sqlite, ClearML's reporter
  flushed).
- otel-rl: ``otel_rl.log(data, step=step)`` with that exporter alone, in the training process
  (``export_process=false``, so end-to-end holds the tracker's own work).  "caller": the ``log()`` calls,
  the pipeline flushed between timed chunks outside the timed region; "end-to-end": the calls plus
  ``flush()`` (delivered to the tracker's store).

Each figure: the minimum over repeats of the per-call time over a chunk of calls (the median is shown too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TRACKERS = ("tensorboard", "trackio", "clearml")


def data(step: int) -> dict[str, float]:
    prefixes = ("actor", "critic", "response_length", "timing_s", "perf")
    return {f"{prefixes[i % 5]}/metric_{i}": step * 0.001 + i for i in range(100)}


def timed(calls: Callable[[int], None], after: Callable[[], None] | None, between: Callable[[], None] | None,
          chunk: int, chunks: int, repeats: int, step0: list[int]) -> tuple[float, float]:
    """(min, median) seconds per call; `after` inside the timed region (end-to-end), `between` outside."""
    per_call = []
    for _ in range(repeats):
        for _ in range(chunks):
            if between is not None:
                between()
            gc.disable()
            t0 = time.perf_counter()
            for _ in range(chunk):
                step0[0] += 1
                calls(step0[0])
            if after is not None:
                after()
            dt = time.perf_counter() - t0
            gc.enable()
            per_call.append(dt / chunk)
    return min(per_call), statistics.median(per_call)


def verl_logger(name: str, tmp: str) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """verl's adapter of `name`, its flush, its finish."""
    from verl.utils import tracking as vt

    if name == "tensorboard":
        os.environ["TENSORBOARD_DIR"] = os.path.join(tmp, "verl-tb")
        lg = vt._TensorboardAdapter("bench", "verl")
        del os.environ["TENSORBOARD_DIR"]
        return lg, lg.writer.flush, lg.finish
    if name == "trackio":
        import trackio

        run = trackio.init(project="bench-verl", name="verl", config={"k": 1})
        lg = vt._TrackioLoggingAdapter(trackio)

        def flush() -> None:
            with run._client_lock:
                run._flush_queues_inline()
        return lg, flush, lg.finish
    from clearml import Task

    Task.set_offline(True)
    Task._report_subprocess_enabled = False  # as the exporter runs it (ClearML's subprocess holds close() ~10 s)
    lg = vt.ClearMLLogger("bench-verl", "verl", {"k": 1})
    return lg, lambda: lg._task.flush(wait_for_uploads=True), lg.finish


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    md = os.path.abspath(a.md) if a.md else None  # before the chdir below
    chunk, chunks, repeats = (10, 3, 2) if a.quick else (20, 5, 3)
    tmp = tempfile.mkdtemp(prefix="bench-new-trackers-")
    os.environ.update({"TRACKIO_DIR": os.path.join(tmp, "trackio"), "CLEARML_CACHE_DIR": os.path.join(tmp, "cml"),
                       "HOME": os.path.join(tmp, "home")})
    for k in list(os.environ):
        if k.startswith(("OTEL_", "CLEARML_API", "TRACKIO_SPACE")):
            del os.environ[k]
    os.chdir(tmp)
    import otel_rl

    rows = []
    step = [0]
    for name in TRACKERS:
        with contextlib.redirect_stdout(io.StringIO()):
            lg, flush, finish = verl_logger(name, tmp)
            v_call = timed(lambda s: lg.log(data(s), s), None, flush, chunk, chunks, repeats, step)
            v_e2e = timed(lambda s: lg.log(data(s), s), flush, None, chunk, chunks, repeats, step)
            finish()
            h = otel_rl.init(project=f"bench-{name}", experiment="otel-rl", exporters=[name], batch_delay_s=0.02,
                             export_process="false")
            h.log(data(0), step=0)
            h.flush(60)  # the tracker's run is open before timing
            o_call = timed(lambda s: h.log(data(s), step=s), None, lambda: h.flush(60), chunk, chunks, repeats, step)
            o_e2e = timed(lambda s: h.log(data(s), step=s), lambda: h.flush(60), None, chunk, chunks, repeats, step)
            h.shutdown()
        rows.append((name, v_call, o_call, v_e2e, o_e2e))
        print(f"{name}: caller verl {v_call[0] * 1e6:.0f} us, otel-rl {o_call[0] * 1e6:.0f} us "
              f"({v_call[0] / o_call[0]:.1f}x); end-to-end verl {v_e2e[0] * 1e6:.0f} us, otel-rl "
              f"{o_e2e[0] * 1e6:.0f} us ({o_e2e[0] / v_e2e[0]:.2f}x of verl)", flush=True)

    lines = [f"# log(100 keys): TensorBoard, Trackio, ClearML beside verl's own call ({time.strftime('%Y-%m-%d')})",
             "", f"`python benchmarks/bench_new_trackers.py{' --quick' if a.quick else ''}` on {platform.node()} "
             f"({os.cpu_count()} CPUs, Python {platform.python_version()}); {chunk} calls a chunk, {chunks} chunks, "
             f"{repeats} repeats; per call, min (median) in microseconds.", "",
             "| tracker | verl caller | otel-rl caller | caller ratio verl/otel-rl | verl end-to-end | "
             "otel-rl end-to-end | end-to-end ratio otel-rl/verl |", "|---|---|---|---|---|---|---|"]
    for name, vc, oc, ve, oe in rows:
        lines.append(f"| {name} | {vc[0] * 1e6:.0f} ({vc[1] * 1e6:.0f}) | {oc[0] * 1e6:.0f} ({oc[1] * 1e6:.0f}) | "
                     f"{vc[0] / oc[0]:.1f} | {ve[0] * 1e6:.0f} ({ve[1] * 1e6:.0f}) | "
                     f"{oe[0] * 1e6:.0f} ({oe[1] * 1e6:.0f}) | {oe[0] / ve[0]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if md:
        os.makedirs(os.path.dirname(md), exist_ok=True)
        with open(md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
