"""GRPO on the arithmetic-with-a-calculator task, instrumented with otel-rl's public API only.

One training step, as in verl's ``RayPPOTrainer.fit``::

    with otel_rl.step(n):                       # the step's root span
        with otel_rl.timer("step"):
            gen            n rollouts per prompt, concurrent agent loops (asyncio)
            reward         sequence scores -> token-level rewards, reward metrics
            old_log_prob   log-probs (and entropy) of the rollout policy
            ref            log-probs of the frozen reference policy
            adv            GRPO: (score - group mean) / (group std + eps)
            update_actor   PPO-clipped policy gradient + k3 KL to the reference - entropy bonus
            testing        validation (every trainer.test_freq steps and at the end)
        otel_rl.log(metrics, step=n)            # verl's metric names
"""

from __future__ import annotations

import asyncio
import copy
import gc
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import otel_rl

from .agent_loop import AgentLoop, AgentLoopOutput, RolloutServer
from .config import DEFAULT_CONFIG, get
from .model import TinyPolicy, pad_batch, token_log_probs
from .task import ArithTokenizer, Dataset, Problem, all_problems, pretraining_sequence

VAL_SET_SEED = 1234  # the validation problems are the same for every seed


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{name}/mean": float(sum(values) / len(values)),
        f"{name}/max": float(max(values)),
        f"{name}/min": float(min(values)),
    }


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


class GRPOTrainer:
    """A complete (small) GRPO trainer; `fit()` runs it, `val_history` keeps (step, val reward)."""

    def __init__(self, cfg: dict[str, Any], on_step: Callable[[int, dict[str, float]], None] | None = None):
        self.cfg = cfg
        self.on_step = on_step
        self.seed = int(get(cfg, "trainer.seed", 0))
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        threads = get(cfg, "trainer.torch_threads")
        if threads:
            torch.set_num_threads(int(threads))
        self.tokenizer = ArithTokenizer()
        # the policy's size and optimizer: what the config gives, else the demo's defaults (one place for them)
        m = {**DEFAULT_CONFIG["actor_rollout_ref"]["model"], **get(cfg, "actor_rollout_ref.model", {})}
        max_len = int(get(cfg, "data.max_prompt_length", 8)) + int(get(cfg, "data.max_response_length", 16))
        self.actor = TinyPolicy(
            int(m["d_model"]), int(m["n_layers"]), int(m["n_heads"]), int(m["d_ff"]), max_len=max_len
        )
        self.ref: TinyPolicy | None = None  # the reference policy: a frozen copy of the pretrained one
        a = get(cfg, "actor_rollout_ref.actor", {})
        self.a = a
        optim = {**DEFAULT_CONFIG["actor_rollout_ref"]["actor"]["optim"], **a.get("optim", {})}
        self.optimizer = torch.optim.AdamW(
            self.actor.parameters(), lr=float(optim["lr"]), weight_decay=float(optim["weight_decay"])
        )
        warmup = int(optim.get("lr_warmup_steps", 0) or 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / warmup) if warmup > 0 else 1.0
        )
        problems = all_problems(int(get(cfg, "data.max_operand", 9)), list(get(cfg, "data.ops", ["+", "*"])))
        self.train_data = Dataset(problems, self.seed)
        n_val = min(int(get(cfg, "data.val_batch_size", 64)), len(problems))
        self.val_problems: list[Problem] = random.Random(VAL_SET_SEED).sample(problems, n_val)
        self.server = RolloutServer(self.actor, self.seed)
        mt = get(cfg, "actor_rollout_ref.rollout.multi_turn", {})
        self.max_tokens_per_turn = int(mt.get("max_tokens_per_turn", 4))
        self.max_response_length = int(get(cfg, "data.max_response_length", 16))
        self.agent = AgentLoop(
            self.server,
            self.tokenizer,
            int(mt.get("max_assistant_turns", 2)),
            self.max_response_length,
            float(get(cfg, "reward_model.format_score", 0.0)),
        )
        self.n = int(get(cfg, "actor_rollout_ref.rollout.n", 8))
        self.batch_size = int(get(cfg, "data.train_batch_size", 32))
        self.total_steps = int(get(cfg, "trainer.total_training_steps", 100))
        self.problems = problems
        self.test_freq = int(get(cfg, "trainer.test_freq", 10) or 0)
        self.shuffle = torch.Generator().manual_seed(self.seed + 1)
        self.loop = asyncio.new_event_loop()
        self.val_history: list[tuple[int, float]] = []
        self.log_calls = 0  # otel_rl.log() calls made here
        self.step_blocks = 0  # otel_rl.step() blocks (each logs its timings once)
        self.trajectories = 0
        self.last_metrics: dict[str, float] = {}
        self.step_timings: list[dict[str, float]] = []  # timing_s/<phase> of each training step
        self.warmup_s = 0.0  # seconds of the supervised warm-up (`pretrain`)
        self.step0_s = 0.0  # seconds of step 0: the warm-up and the validation before training

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.actor.parameters())

    def _log(self, metrics: dict[str, Any], step: int) -> None:
        otel_rl.log(metrics, step=step)
        self.log_calls += 1

    # -- rollouts -------------------------------------------------------------------------
    async def _rollout(
        self, problems: Sequence[Problem], n: int, sampling_params: dict[str, Any], step: int, validate: bool
    ) -> list[AgentLoopOutput]:
        runs = [
            self.agent.run(p, sampling_params, step=step, sample_index=i, rollout_n=r, validate=validate)
            for i, p in enumerate(problems)
            for r in range(n)
        ]
        return list(await asyncio.gather(*runs))

    def generate_sequences(
        self, problems: Sequence[Problem], n: int, sampling_params: dict[str, Any], step: int, validate: bool
    ) -> list[AgentLoopOutput]:
        # register the candidates: max_samples_per_step_per_worker picks the same samples every time
        otel_rl.select_samples(step, range(len(problems)), validate=validate)
        outs = self.loop.run_until_complete(self._rollout(problems, n, sampling_params, step, validate))
        self.trajectories += len(outs)
        return outs

    # -- the step ------------------------------------------------------------------------
    def fit(self) -> list[tuple[int, float]]:
        frozen = False
        try:
            t0 = time.perf_counter()
            with otel_rl.step(0):  # the base policy, and validation before training
                self.step_blocks += 1
                metrics: dict[str, float] = {}
                with otel_rl.timer("pretrain"):
                    metrics.update(self.pretrain())
                t1 = time.perf_counter()
                if get(self.cfg, "trainer.val_before_train", True):
                    with otel_rl.timer("testing"):
                        metrics.update(self.validate(0))
                self._log(metrics, 0)
            self.warmup_s = t1 - t0  # the supervised warm-up, before any GRPO step
            self.step0_s = time.perf_counter() - t0  # ... and the validation before training
            if self.on_step:
                self.on_step(0, metrics)
            # What exists now (torch's modules, the models, what the first backward imported) lives as
            # long as the run: keep it out of the cyclic collector, as long-running trainers do.  A full
            # collection then scans only what the steps allocate, not ~300k objects (~150 ms each).
            gc.collect()
            gc.freeze()
            frozen = True
            for step in range(1, self.total_steps + 1):
                with otel_rl.step(step) as st:
                    self.step_blocks += 1
                    metrics = self.train_step(step)
                    self._log(metrics, step)
                self.step_timings.append(dict(st.timings))
                self.last_metrics = metrics
                if self.on_step:
                    self.on_step(step, metrics)
        finally:
            self.loop.close()
            if frozen:
                gc.unfreeze()  # the caller's objects are collectable again (the demo can run in-process)
        return self.val_history

    def pretrain(self) -> dict[str, float]:
        """The base policy: a few supervised steps on a synthetic corpus (`task.pretraining_sequence`).

        Random numbers only: it learns the answer and tool-call formats, and calls the calculator
        now and then; what is right is left to GRPO.  Then the reference policy is frozen.
        """
        p = get(self.cfg, "actor_rollout_ref.model.pretrain", {}) or {}
        steps, size = int(p.get("steps", 0) or 0), int(p.get("batch_size", 64))
        rng = random.Random(self.seed + 2)
        max_result = max(pr.answer for pr in self.problems)
        transcripts, tool = float(p.get("transcript_fraction", 0.1)), float(p.get("tool_fraction", 0.02))
        optim = torch.optim.AdamW(self.actor.parameters(), lr=float(p.get("lr", 3e-3)))
        loss_value = float("nan")
        self.actor.train()
        for _ in range(steps):
            pairs = [
                pretraining_sequence(rng, rng.choice(self.problems), max_result, transcripts, tool) for _ in range(size)
            ]
            ids, _ = pad_batch([seq for seq, _ in pairs])
            mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
            for i, (_, m) in enumerate(pairs):
                mask[i, : len(m) - 1] = torch.tensor(m[1:], dtype=torch.float)
            logp, _ = token_log_probs(self.actor, ids)
            loss = -_masked_mean(logp, mask)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            loss_value = float(loss.detach())
        self.actor.eval()
        self.ref = copy.deepcopy(self.actor).eval().requires_grad_(False)
        return {"pretrain/loss": loss_value, "pretrain/steps": steps} if steps else {}

    def train_step(self, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        rollout = get(self.cfg, "actor_rollout_ref.rollout", {})
        sampling = {"temperature": float(rollout.get("temperature", 1.0)), "max_tokens": self.max_tokens_per_turn}
        with otel_rl.timer("step") as step_timer:
            problems = self.train_data.batch(self.batch_size)
            with otel_rl.timer("gen"):
                outs = self.generate_sequences(problems, self.n, sampling, step, validate=False)
            with otel_rl.timer("reward"):
                batch = self._make_batch(outs)
                metrics.update(self._data_metrics(outs, batch))
            with otel_rl.timer("old_log_prob"), torch.no_grad():
                old_logp, entropy = token_log_probs(self.actor, batch["ids"], with_entropy=True)
                if entropy is not None:  # (asked for)
                    metrics["actor/entropy"] = float(_masked_mean(entropy, batch["mask"]))
            if self.ref is None:
                raise RuntimeError("the reference policy is made by pretrain(), which runs first")
            with otel_rl.timer("ref"), torch.no_grad():
                ref_logp, _ = token_log_probs(self.ref, batch["ids"])
            with otel_rl.timer("adv"):
                adv = self._grpo_advantages(batch["scores"])
                token_adv = adv.unsqueeze(-1) * batch["mask"]
                valid = token_adv[batch["mask"] > 0]
                metrics.update(_stats("critic/advantages", valid.tolist()))
                metrics.update(_stats("critic/returns", valid.tolist()))  # GRPO: returns are the advantages
            with otel_rl.timer("update_actor"):
                metrics.update(self.update_actor(batch, old_logp, ref_logp, token_adv))
            if self.test_freq > 0 and (step % self.test_freq == 0 or step == self.total_steps):
                with otel_rl.timer("testing"):
                    metrics.update(self.validate(step))
        tokens = batch["total_tokens"]
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/time_per_step"] = step_timer.last
        metrics["perf/throughput"] = tokens / step_timer.last
        metrics["training/global_step"] = step
        metrics["training/epoch"] = self.train_data.epoch
        return metrics

    def _make_batch(self, outs: list[AgentLoopOutput]) -> dict[str, Any]:
        seqs = [o.prompt_ids + o.response_ids for o in outs]
        ids, _ = pad_batch(seqs)
        mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        for i, o in enumerate(outs):
            start = len(o.prompt_ids) - 1  # log-prob index of the first response token
            for j, m in enumerate(o.response_mask):
                if m:
                    mask[i, start + j] = 1.0
        scores = torch.tensor([o.reward_score for o in outs])
        return {"ids": ids, "mask": mask, "scores": scores, "total_tokens": sum(len(s) for s in seqs)}

    def _data_metrics(self, outs: list[AgentLoopOutput], batch: dict[str, Any]) -> dict[str, float]:
        scores = batch["scores"].tolist()
        resp = [len(o.response_ids) for o in outs]
        prompt = [len(o.prompt_ids) for o in outs]
        m: dict[str, float] = {}
        m.update(_stats("critic/score", scores))
        m.update(_stats("critic/rewards", scores))  # no in-reward KL penalty (KL is a loss term, use_kl_loss)
        m.update(_stats("response_length", resp))
        m["response_length/clip_ratio"] = sum(r >= self.max_response_length for r in resp) / len(resp)
        m.update(_stats("prompt_length", prompt))
        m.update(_stats("num_turns", [o.num_turns for o in outs]))
        m.update(_stats("tool_call_counts", [o.tool_calls for o in outs]))
        calls = sum(o.tool_calls for o in outs)
        m["tool/error_rate"] = sum(o.tool_errors for o in outs) / calls if calls else 0.0
        return m

    def _grpo_advantages(self, scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        groups = scores.view(-1, self.n)
        mean = groups.mean(-1, keepdim=True)
        std = groups.std(-1, keepdim=True) if self.n > 1 else torch.ones_like(mean)
        centred = groups - mean
        if get(self.cfg, "algorithm.norm_adv_by_std_in_grpo", True):
            centred = centred / (std + eps)
        return centred.reshape(-1)

    def update_actor(
        self, batch: dict[str, Any], old_logp: torch.Tensor, ref_logp: torch.Tensor, token_adv: torch.Tensor
    ) -> dict[str, float]:
        a = self.a
        clip = float(a.get("clip_ratio", 0.2))
        clip_c = float(a.get("clip_ratio_c", 3.0))
        ent_coef = float(a.get("entropy_coeff", 0.01))
        kl_coef = float(a.get("kl_loss_coef", 0.001)) if a.get("use_kl_loss", True) else 0.0
        grad_clip = float(a.get("grad_clip", 1.0))
        mb = max(1, int(a.get("ppo_mini_batch_size", 8))) * self.n
        ids, mask = batch["ids"], batch["mask"]
        sums: dict[str, float] = {}
        count = 0
        self.actor.train()
        for _ in range(int(a.get("ppo_epochs", 1))):
            for chunk in torch.randperm(ids.shape[0], generator=self.shuffle).split(mb):
                m = mask[chunk]
                logp, entropy = token_log_probs(self.actor, ids[chunk], with_entropy=ent_coef != 0)
                adv = token_adv[chunk]
                log_ratio = (logp - old_logp[chunk]).clamp(-20.0, 20.0)
                ratio = torch.exp(log_ratio)
                loss1 = -adv * ratio
                loss2 = -adv * ratio.clamp(1.0 - clip, 1.0 + clip)
                clipped = torch.maximum(loss1, loss2)
                loss3 = -adv * clip_c  # dual clip: bounds the loss of negative advantages
                dual = torch.minimum(loss3, clipped)
                pg = torch.where(adv < 0, dual, clipped)
                pg_loss = _masked_mean(pg, m)
                loss = pg_loss
                entropy_mean = _masked_mean(entropy, m) if entropy is not None else None
                if entropy_mean is not None:
                    loss = loss - ent_coef * entropy_mean
                kl = ref_logp[chunk] - logp  # k3 ("low_var_kl"): exp(kl) - kl - 1 >= 0
                kl_loss = _masked_mean((torch.exp(kl) - kl - 1).clamp(-10.0, 10.0), m)
                if kl_coef:
                    loss = loss + kl_coef * kl_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), grad_clip)
                lr = self.optimizer.param_groups[0]["lr"]
                if math.isfinite(float(grad_norm)):
                    self.optimizer.step()
                self.scheduler.step()
                with torch.no_grad():
                    part = {
                        "actor/pg_loss": float(pg_loss),
                        "actor/pg_clipfrac": float(_masked_mean((loss2 > loss1).float(), m)),
                        "actor/pg_clipfrac_lower": float(_masked_mean(((clipped > loss3) & (adv < 0)).float(), m)),
                        "actor/ppo_kl": float(_masked_mean(-log_ratio, m)),
                        "actor/kl_loss": float(kl_loss),
                        "actor/grad_norm": float(grad_norm),
                        "actor/lr": float(lr),
                    }
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        self.actor.eval()
        out = {k: v / count for k, v in sums.items()}
        out["actor/kl_coef"] = kl_coef
        return out

    # -- validation ----------------------------------------------------------------------
    def validate(self, step: int) -> dict[str, float]:
        vk = get(self.cfg, "actor_rollout_ref.rollout.val_kwargs", {})
        sampling = {"temperature": float(vk.get("temperature", 0.0)), "max_tokens": self.max_tokens_per_turn}
        outs = self.generate_sequences(self.val_problems, 1, sampling, step, validate=True)
        rewards = [o.reward_score for o in outs]
        acc = [float(o.reward_score == 1.0) for o in outs]
        mean = sum(rewards) / len(rewards)
        by_op: dict[str, list[float]] = {}
        for o in outs:
            by_op.setdefault({"+": "add", "*": "mul", "-": "sub"}[o.problem.op], []).append(o.reward_score)
        m = {
            "val-core/arith/reward/mean@1": mean,
            "val-aux/arith/acc/mean@1": sum(acc) / len(acc),
            "val-aux/arith/tool_call_counts/mean@1": sum(o.tool_calls for o in outs) / len(outs),
            "val-aux/num_turns/mean": sum(o.num_turns for o in outs) / len(outs),
        }
        for op, vals in sorted(by_op.items()):
            m[f"val-aux/arith/reward_{op}/mean@1"] = sum(vals) / len(vals)
        rows = [
            (self.tokenizer.decode(o.prompt_ids), self.tokenizer.decode(o.response_ids), o.reward_score) for o in outs
        ]
        otel_rl.log_generations(rows, step)
        self.val_history.append((step, mean))
        return m
