"""The task: arithmetic questions, a calculator tool, a tiny vocabulary.

A prompt is ``<s>7*8=``.  The policy answers in assistant turns made of tokens from
`ACTION_IDS` (digits, ``</s>``, ``<tool_call>``):

- ``5 6 </s>``: a direct answer, the trajectory ends;
- ``... <tool_call>``: the turn ends with a call of the calculator on the question's
  expression; the environment appends the tool's answer as an observation
  ``<tool_response> 5 6 </s>`` and the policy takes another turn.

The reward (`compute_score`) is 1 for the right number followed by ``</s>``, a small
format score for a wrong but well-formed number, 0 otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

PAD, BOS, EOS, CALL, RESULT, EQ, PLUS, TIMES, MINUS = range(9)
DIGIT0 = 9
TOKENS = ["<pad>", "<s>", "</s>", "<tool_call>", "<tool_response>", "=", "+", "*", "-"] + [str(d) for d in range(10)]
VOCAB_SIZE = len(TOKENS)
OPS = {"+": PLUS, "*": TIMES, "-": MINUS}
#: what the policy may emit in an assistant turn
ACTION_IDS = [EOS, CALL] + [DIGIT0 + d for d in range(10)]
_ID = {t: i for i, t in enumerate(TOKENS)}


class ArithTokenizer:
    """A character-level tokenizer with the HF-like methods otel-rl's token2text uses."""

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text[i] == "<":
                j = text.index(">", i) + 1
                ids.append(_ID[text[i:j]])
                i = j
            else:
                ids.append(_ID[text[i]])
                i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(TOKENS[i] for i in ids if not (skip_special_tokens and i == PAD))

    def batch_decode(self, seqs: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]


def number_ids(n: int) -> list[int]:
    digits = [DIGIT0 + int(c) for c in str(abs(n))]
    return digits if n >= 0 else [MINUS] + digits


def parse_number(ids: Sequence[int]) -> int | None:
    """The integer written by `ids` (digits, an optional leading minus), else None."""
    if not ids:
        return None
    sign = 1
    if ids[0] == MINUS:
        sign, ids = -1, ids[1:]
    if not ids or any(not DIGIT0 <= i < DIGIT0 + 10 for i in ids):
        return None
    return sign * int("".join(str(i - DIGIT0) for i in ids))


def evaluate(expression: str) -> int:
    """The calculator: ``a op b`` with integers and one of + - *."""
    for op in ("+", "*", "-"):
        left, sep, right = expression.partition(op)
        if sep and left.strip().lstrip("-").isdigit() and right.strip().isdigit():
            a, b = int(left), int(right)
            return a + b if op == "+" else a * b if op == "*" else a - b
    raise ValueError(f"cannot evaluate {expression!r}")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        return evaluate(self.expression)

    @property
    def data_source(self) -> str:
        return "arith"

    def prompt_ids(self) -> list[int]:
        return [BOS, *number_ids(self.a), OPS[self.op], *number_ids(self.b), EQ]


def all_problems(max_operand: int, ops: Sequence[str]) -> list[Problem]:
    return [Problem(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)]


class Dataset:
    """Shuffled epochs over every problem; `batch()` returns the next `size` problems."""

    def __init__(self, problems: Sequence[Problem], seed: int):
        self.problems = list(problems)
        self._rng = random.Random(seed)
        self._order: list[Problem] = []
        self.epoch = 0

    def batch(self, size: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < size:
            if not self._order:
                self._order = list(self.problems)
                self._rng.shuffle(self._order)
                self.epoch += 1
            out.append(self._order.pop())
        return out


def score(response_ids: Sequence[int], ground_truth: int, format_score: float) -> float:
    """Reward of a final assistant turn: 1 if it writes the right number then ``</s>``."""
    if not response_ids or response_ids[-1] != EOS:
        return 0.0
    value = parse_number(list(response_ids[:-1]))
    if value is None:
        return 0.0
    return 1.0 if value == ground_truth else format_score


def pretraining_sequence(
    rng: random.Random, problem: Problem, max_result: int, transcript_fraction: float, tool_fraction: float
) -> tuple[list[int], list[int]]:
    """One sequence of the synthetic "pretraining" corpus and its loss mask (1: a token learnt).

    The numbers in it are random, never the right answer.  A share `transcript_fraction` of
    the sequences are tool transcripts (``<tool_call> <tool_response> N </s> N </s>``): the base
    policy learns to read a tool response; the ``<tool_call>`` token itself is learnt in only
    enough of them that the policy calls the tool about `tool_fraction` of the time.  The
    others are direct answers ``N </s>``.  Nothing about arithmetic is in it.
    """
    prompt = problem.prompt_ids()
    value = rng.randint(0, max_result)
    if rng.random() < transcript_fraction:
        obs = [RESULT, *number_ids(value), EOS]
        answer = [*number_ids(value), EOS]
        call = 1 if rng.random() < tool_fraction / transcript_fraction else 0
        return prompt + [CALL] + obs + answer, [0] * len(prompt) + [call] + [0] * len(obs) + [1] * len(answer)
    answer = [*number_ids(value), EOS]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)
