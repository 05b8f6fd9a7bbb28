"""A trainer for the bridge test: the workload to TensorBoard, Trackio and ClearML in this process (stores from
this process's environment) and over OTLP/HTTP to a bridge: one execution, two delivery paths.

    python new_trackers_trainer.py ENDPOINT PROJECT EXPERIMENT RUN_ID
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import otel_rl  # noqa: E402
from new_stores import run_workload  # noqa: E402

CONFIG = {"trainer": {"logger": ["tensorboard", "trackio", "clearml"]}, "actor": {"lr": 1e-6}}


def main() -> None:
    endpoint, project, experiment, run_id = sys.argv[1:5]
    h = otel_rl.init(CONFIG, project=project, experiment=experiment, run_id=run_id,
                     exporters=["otlp", "tensorboard", "trackio", "clearml"], otlp_protocol="http/protobuf",
                     otlp_endpoint=endpoint, batch_delay_s=0.05, export_process="false")
    run_workload(lambda values, step: otel_rl.log(values, step=step),
                 lambda rows, step: otel_rl.log_generations(rows, step=step))
    h.shutdown()
    failed = {k: v for k, v in h.stats()["exporters"].items() if v["dropped"] or v["queued"]}
    if failed:
        raise SystemExit(f"not delivered: {failed}")


if __name__ == "__main__":
    main()
