"""Drop-in replacements for other frameworks' tracking APIs, routed through otel-rl.

- `otel_rl.compat.verl`: verl's ``Tracking``, ``ValidationGenerationsLogger``,
  ``RolloutTraceConfig``, ``rollout_trace_attr`` and ``rollout_trace_op``.
"""
