"""The demo's verl-shaped default config and how command-line overrides merge into it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from otel_rl.config import apply_dotlist

DEFAULT_OUTPUT_DIR = "./outputs/demo"

#: verl's layout; keys the demo does not use are not invented
DEFAULT_CONFIG: dict[str, Any] = {
    "data": {
        "train_batch_size": 32,  # prompts per step
        "val_batch_size": 64,  # validation problems (fixed set)
        "max_prompt_length": 8,
        "max_response_length": 16,  # assistant turns + tool responses
        "max_operand": 9,  # operands 0..max_operand
        "ops": ["+", "*"],
    },
    "actor_rollout_ref": {
        "model": {
            "d_model": 128,
            "n_layers": 2,
            "n_heads": 4,
            "d_ff": 512,
            # the base policy: supervised steps on random-number transcripts (formats only, see task.py)
            "pretrain": {"steps": 150, "batch_size": 64, "lr": 3e-3, "transcript_fraction": 0.1, "tool_fraction": 0.02},
        },
        "actor": {
            "optim": {"lr": 5e-4, "weight_decay": 0.0, "lr_warmup_steps": 0},
            "ppo_mini_batch_size": 8,  # prompts per mini-batch (x rollout.n trajectories)
            "ppo_epochs": 1,
            "clip_ratio": 0.2,
            "clip_ratio_c": 3.0,  # dual-clip bound for negative advantages
            "grad_clip": 1.0,
            "loss_agg_mode": "token-mean",
            "entropy_coeff": 0.01,
            "use_kl_loss": True,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "low_var_kl",  # k3
        },
        "rollout": {
            "n": 8,  # rollouts per prompt (the GRPO group)
            "temperature": 1.0,
            "val_kwargs": {"temperature": 0.0, "n": 1},  # greedy validation
            "multi_turn": {"max_assistant_turns": 2, "max_tokens_per_turn": 4},
            "trace": {"backend": "mlflow", "token2text": True, "max_samples_per_step_per_worker": 4},
        },
    },
    "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True},
    "reward_model": {"format_score": 0.0},  # score of a wrong but well-formed answer (verl gsm8k: 0.0)
    "trainer": {
        "project_name": "otel_rl_demo",
        "experiment_name": None,  # grpo_arith_seed<seed>
        "logger": ["console", "mlflow", "file"],
        "total_training_steps": 100,
        "test_freq": 10,  # validate every N steps (and before training, and at the end)
        "val_before_train": True,
        "log_val_generations": 10,
        "seed": 0,
        # one torch thread: the demo stands in for a GPU trainer, its loop on one core and the host's other
        # cores free for the rest (the export process); two threads train faster here but leave telemetry
        # only torch's gaps (benchmarks/results/2026-12-04-demo-cost.md, "One torch thread or two")
        "torch_threads": 1,
    },
}


def build_config(overrides: Sequence[str] = (), seed: int | None = None) -> dict[str, Any]:
    """Defaults, then the dotlist overrides (verl/Hydra syntax), then ``--seed``.

    As in Hydra, an override of a key the default config does not have is an error naming the closest
    key (``+key=value`` adds one on purpose)."""
    cfg = apply_dotlist(copy.deepcopy(DEFAULT_CONFIG), list(overrides), strict="all")
    if seed is not None:
        cfg["trainer"]["seed"] = int(seed)
    if not cfg["trainer"].get("experiment_name"):
        cfg["trainer"]["experiment_name"] = f"grpo_arith_seed{cfg['trainer']['seed']}"
    return cfg


def get(cfg: dict[str, Any], path: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
