"""``otel-rl demo``: a small, real agentic GRPO training on CPU, instrumented with otel-rl.

- `task`: arithmetic questions, the calculator tool, the tokenizer, the reward;
- `model`: the tiny transformer policy;
- `agent_loop`: the batched inference "server" and the multi-turn agent loop (verl's shape);
- `trainer`: GRPO (rollouts, advantages, clipped policy gradient, KL, validation);
- `config`: the verl-shaped default config; `cli`: the command; `progress`: the progress line.

See docs/demo.md.
"""
