"""A trainer for the exit-path tests, run as a subprocess and ended the way the test says.

It logs ``STEPS`` steps (console, JSONL, MLflow at ``MLFLOW_TRACKING_URI``), one ``log()`` a step
inside ``otel_rl.step(n)``, then prints ``logged`` on stderr and ends by ``END``:

- ``wait``: sleeps (the test sends a signal: SIGTERM, SIGINT or SIGKILL)
- ``raise``: an uncaught RuntimeError
- ``exit``: ``sys.exit(EXIT_CODE)``
- ``return``: the end of the script
- ``rollouts``: opens ``OPEN`` sampled trajectories in asyncio tasks (``ROLLOUTS_IN=threads``: in daemon
  threads) that each made one LLM call and wait, inside step ``STEPS + 1`` whose timers run; prints
  ``logged`` there and waits for Ctrl-C
- ``shutdown``: once ``$EXIT_DIR/go`` exists, logs ``STEPS`` more steps, calls ``shutdown()`` and prints
  how long it took (``shutdown_s <seconds>``)

Right after ``init()`` it prints the export process's pid on stderr (``export_pid <pid>``; 0 for none).

``FLUSH=<seconds>``: ``flush()`` before ``logged``.  ``USER_HANDLER=1``: a SIGTERM handler of the program's own is installed before ``init()``: it writes
``$EXIT_DIR/user_handler`` and asks the loop to stop; the loop then logs ``{"stopped": 1}`` and returns.
``USER_HANDLER=exit``: the program's handler writes that file and calls ``sys.exit(143)`` itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import otel_rl

out = os.environ["EXIT_DIR"]
steps = int(os.environ.get("STEPS", "200"))
end = os.environ.get("END", "wait")
stop = []

if os.environ.get("USER_HANDLER") == "1":
    def on_term(signum, frame):
        with open(os.path.join(out, "user_handler"), "w") as f:
            f.write(str(signum))
        stop.append(signum)

    signal.signal(signal.SIGTERM, on_term)
elif os.environ.get("USER_HANDLER") == "exit":
    def exit_on_term(signum, frame):
        with open(os.path.join(out, "user_handler"), "w") as f:
            f.write(str(signum))
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_on_term)

h = otel_rl.init(project="exit", experiment="exit", exporters=os.environ.get("EXPORTERS", "console,jsonl").split(","),
                 jsonl_path=os.path.join(out, "metrics.jsonl"), trace_backend=os.environ.get("TRACE_BACKEND") or None)
_client = getattr(h, "_export_process", None)
print(f"export_pid {_client.proc.pid if _client is not None else 0}", file=sys.stderr, flush=True)


@otel_rl.generate(model="policy")
async def generate(prompt: str) -> str:
    return prompt + " answer"


async def rollout(i: int, n: int, hold: asyncio.Event) -> None:
    with otel_rl.trajectory(step=n, sample_index=i):
        await generate(f"p{i}")
        await hold.wait()


async def rollouts(n: int) -> None:
    hold = asyncio.Event()
    tasks = [asyncio.ensure_future(rollout(i, n, hold)) for i in range(int(os.environ.get("OPEN", "4")))]
    await asyncio.sleep(0.05)
    print("logged", file=sys.stderr, flush=True)
    await asyncio.gather(*tasks)


def rollouts_in_threads(n: int) -> None:
    hold = threading.Event()
    called = threading.Semaphore(0)

    def rollout_thread(i: int) -> None:
        with otel_rl.trajectory(step=n, sample_index=i):
            asyncio.run(generate(f"p{i}"))
            called.release()
            hold.wait()

    threads = [threading.Thread(target=rollout_thread, args=(i,), daemon=True)
               for i in range(int(os.environ.get("OPEN", "4")))]
    for t in threads:
        t.start()
    for _ in threads:
        called.acquire()
    print("logged", file=sys.stderr, flush=True)
    while True:  # (a sleep: Ctrl-C reaches the main thread here)
        time.sleep(0.05)


for n in range(1, steps + 1):
    with otel_rl.step(n):
        with otel_rl.timer("step"):
            time.sleep(0.002)
        otel_rl.log({"loss": 1.0 / n, "n": n}, step=n)
    if stop:
        otel_rl.log({"stopped": 1}, step=n)
        sys.exit(0)

if os.environ.get("FLUSH"):  # delivered, or in the spool (the tracker is down) once this returns
    h.flush(float(os.environ["FLUSH"]))

if end == "rollouts":
    with otel_rl.step(steps + 1):
        with otel_rl.timer("step"):
            if os.environ.get("ROLLOUTS_IN") == "threads":
                rollouts_in_threads(steps + 1)
            else:
                asyncio.new_event_loop().run_until_complete(rollouts(steps + 1))
        otel_rl.log({"loss": 0.0}, step=steps + 1)

print("logged", file=sys.stderr, flush=True)
if end == "wait":
    for _ in range(600):
        time.sleep(0.1)
        if stop:
            otel_rl.log({"stopped": 1}, step=steps)
            break
elif end == "raise":
    raise RuntimeError("the trainer failed")
elif end == "exit":
    sys.exit(int(os.environ.get("EXIT_CODE", "1")))
elif end == "shutdown":
    while not os.path.exists(os.path.join(out, "go")):  # the test takes the tracker down meanwhile
        time.sleep(0.02)
    for n in range(steps + 1, 2 * steps + 1):  # logged while the tracker is down
        otel_rl.log({"loss": 1.0 / n, "n": n}, step=n)
    t0 = time.monotonic()
    h.shutdown()
    print(f"shutdown_s {time.monotonic() - t0:.2f}", file=sys.stderr, flush=True)
