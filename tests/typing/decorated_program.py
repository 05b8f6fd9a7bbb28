"""A typed user program: checked by mypy in tests/test_public_types.py (not run).

The lines marked ``# expect: <code>`` must be reported with that error code: a decorator that lost the
function's signature (returning Any) would let them pass unnoticed."""

from __future__ import annotations

import otel_rl
from otel_rl.compat.verl import rollout_trace_op


@otel_rl.op
def add(a: int, b: int) -> int:
    return a + b


@otel_rl.op(name="scaled", kind="chain")
def scale(x: float, factor: float = 2.0) -> float:
    return x * factor


@otel_rl.generate(model="tiny")
async def complete(prompt: str) -> str:
    return prompt + "!"


@otel_rl.tool
def search(query: str) -> list[str]:
    return [query]


class Agent:
    @rollout_trace_op
    def act(self, observation: str) -> int:
        return len(observation)


async def main() -> None:
    total: int = add(1, 2)
    reply: str = await complete("hi")
    hits: list[str] = search("x")
    moves: int = Agent().act("obs")
    with otel_rl.step(total) as st, otel_rl.timer("gen") as t:
        otel_rl.log({"reward": scale(1.0), "moves": moves, "hits": len(hits)}, step=st.n)
        print(reply, t.last)
    wrong: str = add(1, 2)  # expect: assignment
    add("one", 2)  # expect: arg-type
    scale(1.0, factor="x")  # expect: arg-type
    search(query=3)  # expect: arg-type
    Agent().act(5)  # expect: arg-type
    print(wrong)
