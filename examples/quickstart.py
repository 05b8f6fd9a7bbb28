"""A small instrumented RL-style loop: console lines + a JSONL file, no server needed.

    python examples/quickstart.py [dotlist overrides...]

e.g. ``python examples/quickstart.py trainer.logger='["console","file"]' trainer.total_training_steps=5``.
The JSONL file goes to $VERL_FILE_LOGGER_PATH, or ./outputs/<project>/<experiment>.jsonl.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys

import otel_rl


class ToyPolicy:
    """Answers `a+b` questions; may call a calculator tool first."""

    def __init__(self, skill: float):
        self.skill = skill

    @otel_rl.generate(model="toy-policy")
    async def generate(self, prompt: str) -> dict:
        await asyncio.sleep(0)
        use_tool = random.random() < 0.5
        text = "call:calc" if use_tool else "answer"
        return {"text": text, "prompt_ids": list(range(len(prompt) // 4)), "response_ids": [1] * random.randint(2, 8)}

    @otel_rl.tool(name="calculator")
    def calculator(self, expression: str, tool_call_id: str) -> int:
        a, b = expression.split("+")
        return int(a) + int(b)


async def rollout(policy: ToyPolicy, step: int, sample_index: int, rollout_n: int, validate: bool) -> dict:
    a, b = random.randint(0, 9), random.randint(0, 9)
    with otel_rl.trajectory(step=step, sample_index=sample_index, rollout_n=rollout_n, validate=validate) as t:
        out = await policy.generate(f"What is {a}+{b}?")
        turns, tool_calls = 1, 0
        if out["text"] == "call:calc":
            policy.calculator(f"{a}+{b}", tool_call_id=f"call-{sample_index}-{rollout_n}")
            tool_calls += 1
            out = await policy.generate("calculator said ...")
            turns += 1
        reward = 1.0 if random.random() < policy.skill + 0.3 * tool_calls else 0.0
        t.set_reward(reward)
        return {"reward": reward, "turns": turns, "tool_calls": tool_calls, "response_length": len(out["response_ids"])}


async def main_async(cfg: list[str]) -> None:
    os.environ.setdefault("VERL_FILE_LOGGER_ROOT", "outputs")
    handle = otel_rl.init(
        ["trainer.project_name=quickstart", "trainer.experiment_name=toy-grpo",
         'trainer.logger=["console","file"]', "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=2",
         *cfg])
    random.seed(0)
    policy = ToyPolicy(skill=0.2)
    steps, batch, n = 5, 4, 2
    with handle:
        for step in range(1, steps + 1):
            with otel_rl.step(step):
                with otel_rl.timer("gen"):
                    results = await asyncio.gather(*[rollout(policy, step, i, r, False)
                                                     for i in range(batch) for r in range(n)])
                with otel_rl.timer("update_actor"):
                    policy.skill = min(0.9, policy.skill + 0.1)  # "learning"
                rewards = [r["reward"] for r in results]
                otel_rl.log({
                    "critic/score/mean": sum(rewards) / len(rewards),
                    "response_length/mean": sum(r["response_length"] for r in results) / len(results),
                    "num_turns/mean": sum(r["turns"] for r in results) / len(results),
                    "tool_call_counts/mean": sum(r["tool_calls"] for r in results) / len(results),
                }, step=step)
            if step % 2 == 0:
                val = [await rollout(policy, step, i, 0, True) for i in range(2)]
                otel_rl.log({"val-core/toy/reward/mean@1": sum(v["reward"] for v in val) / len(val)}, step=step)
                otel_rl.log_generations([(f"q{i}", "answer", v["reward"]) for i, v in enumerate(val)], step=step)
        handle.flush()
        print(f"metrics written to {handle.exporters[1].path}")


def main() -> None:
    asyncio.run(main_async(sys.argv[1:]))


if __name__ == "__main__":
    main()
