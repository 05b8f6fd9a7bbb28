"""The demo's agent loop when its tool fails: the trajectory goes on, the failure is counted and traced."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from otel_rl.demo.agent_loop import AgentLoop
from otel_rl.demo.task import CALL, EOS, RESULT, ArithTokenizer, Problem


@dataclass(frozen=True)
class Garbled(Problem):
    """A problem whose expression reaches the calculator garbled (its answer is set apart)."""

    @property
    def expression(self) -> str:
        return f"{self.a}{self.op}?"

    @property
    def answer(self) -> int:
        return 0


class Scripted:
    """The rollout server's interface, answering a tool call first and then an end of turn."""

    def __init__(self) -> None:
        self.turns = [[CALL], [EOS]]

    async def generate(self, prompt_ids: list[int], sampling_params: dict) -> list[int]:
        return self.turns.pop(0)


def test_a_failing_tool_is_counted_and_the_trajectory_goes_on(otel_rl_capture):
    loop = AgentLoop(Scripted(), ArithTokenizer())
    problem = Garbled(3, "+", 4)
    out = asyncio.run(loop.run(problem, {"max_tokens": 4}, step=1, sample_index=0, rollout_n=0, validate=False))
    assert (out.tool_calls, out.tool_errors) == (1, 1)
    assert out.response_ids == [CALL, RESULT, EOS, EOS]  # an empty result, then the answer turn
    assert out.response_mask == [1, 0, 0, 1]
    cap = otel_rl_capture.collect()
    (t,) = cap.trajectories(step=1, sample_index=0)
    tool = next(n for n in t.root.walk() if n.name == "execute_tool calculator")
    assert tool.status == "ERROR" and "cannot evaluate '3+?'" in (tool.status_message or "")
    assert t.root.status != "ERROR"  # the rollout itself completed
