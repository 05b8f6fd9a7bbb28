"""One process of a two-process GRPO job on CPU (torch.distributed over gloo), for test_transformers.py.

    RANK=.. WORLD_SIZE=2 LOCAL_RANK=.. MASTER_ADDR=127.0.0.1 MASTER_PORT=.. python ddp_grpo_worker.py OUT PROJECT

Every process trains the tiny Llama with `OtelRLCallback` (MLflow sqlite from $MLFLOW_TRACKING_URI, a JSONL
file of its own, and a capture) and `trace_rewards`, then writes what it saw to ``OUT/rank<N>.json``: the
trainer's log history, the completions its reward function scored, and what otel-rl recorded in it.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for integrations.tiny_lm


def main() -> None:
    out, project = sys.argv[1:3]
    rank = int(os.environ["RANK"])

    import trl
    from datasets import Dataset

    import otel_rl
    from integrations import tiny_lm
    from otel_rl import semconv as sc
    from otel_rl.integrations.transformers import OtelRLCallback, trace_rewards
    from otel_rl.records import Trajectory
    from otel_rl.testing import CaptureExporter

    scored: list[dict] = []

    def count_a(completions, prompts, trainer_state, **kwargs):
        scores = [float(c.count("a")) for c in completions]
        scored.append(
            {
                "step": trainer_state.global_step + 1,
                "prompts": list(prompts),
                "completions": list(completions),
                "scores": scores,
            }
        )
        return scores

    cap = CaptureExporter()
    cb = OtelRLCallback(
        project=project,
        exporters=["mlflow", "file", cap],
        trace_backend="mlflow",
        jsonl_path=os.path.join(out, f"metrics-rank{rank}.jsonl"),
        export_process=False,
        batch_delay_s=0.05,
    )
    tok = tiny_lm.tokenizer()
    # 3 completions a process, 2 a prompt: the group of the 2nd prompt spans both processes
    args = trl.GRPOConfig(
        output_dir=os.path.join(out, "grpo"),
        run_name="ddp-grpo",
        max_steps=2,
        per_device_train_batch_size=3,
        num_generations=2,
        max_completion_length=6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        ddp_backend="gloo",
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=tiny_lm.model(tok),
        reward_funcs=trace_rewards([count_a]),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": tiny_lm.prompts(16)}),
        processing_class=tok,
        callbacks=[cb],
    )
    trainer.train()
    h = otel_rl.current()
    assert h is not None
    run_id = h.config.run_id
    cap.collect()
    h.shutdown()
    report = {
        "rank": rank,
        "process_index": args.process_index,
        "world_process_zero": trainer.state.is_world_process_zero,
        "run_id": run_id,
        "log_history": trainer.state.log_history,
        "scored": scored,
        "metrics_logged": [[m.step, m.values] for m in cap.step_metrics()],
        "step_spans": [
            [s.attributes[sc.RL_STEP], s.resource.attributes[sc.RL_WORKER_RANK]] for s in cap.spans_named(sc.SPAN_STEP)
        ],
        "trajectories": [[t.run.run_id, t.step, t.sample_index, t.rollout_n] for t in cap.of_type(Trajectory)],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
