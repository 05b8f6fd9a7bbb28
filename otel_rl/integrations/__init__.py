"""Integrations with other frameworks.

- `otel_rl.integrations.ray`: Ray actors and tasks join the driver's run and link their
  trajectories to the driver's step span.
- `otel_rl.integrations.transformers`: ``OtelRLCallback`` for `transformers.Trainer` and TRL's
  trainers; ``trace_rewards`` makes each GRPO completion a trajectory.
- `otel_rl.integrations.verl`: ``install()`` makes an installed verl use `otel_rl.compat.verl`.
"""
