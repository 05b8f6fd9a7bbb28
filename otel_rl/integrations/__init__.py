"""Integrations with other frameworks.

- `otel_rl.integrations.ray`: Ray actors and tasks join the driver's run and link their
  trajectories to the driver's step span.
- `otel_rl.integrations.verl`: ``install()`` makes an installed verl use `otel_rl.compat.verl`.
"""
