"""The export process: tracker exporters run in a child process of the trainer.

Tracker libraries are heavy Python (MLflow's store writes, wandb's and SwanLab's
run bookkeeping).  In the training process they compete with the training loop
for the GIL even on their own threads; in a child process they run on another
core and the training process only pays for handing records over (a pickle and
a pipe write, on the pipeline's threads).  ``export_process`` (docs/configuration.md):

- ``auto`` (default) / ``true``: the tracker exporters named in the config (MLflow,
  WandB, SwanLab, Weave, any `TrackerExporter` that does not opt out) run in one
  export process; console, file, OTLP, Prometheus and exporter *instances* given
  to `init()` stay in the training process;
- ``false``: everything in the training process.

Each exporter has the same `DeliveryQueue` in the child as it would have in the
trainer: retries with backoff, spool on disk when the tracker fails or falls
behind, replay at the next start.  The child ignores SIGINT (a Ctrl-C in the
terminal reaches the whole process group; the trainer stops it in order) and,
when the trainer disappears (EOF on its pipe, e.g. the trainer was killed), it
delivers what it holds and exits.  If the child dies, the trainer takes the
exporters back in-process and re-delivers the batches the child had not yet
settled (delivered or written to its spool): at least once, never silently lost.

Modules: `protocol` (the messages, one class per kind), `frames` (how they travel), `client` (the
training process's end: starts the process, feeds it, takes its exporters back if it dies), `server`
(the export process itself), `receiver` (shipped batches into deliveries, at either end), `ostune`
(CPUs, priority, exit).
"""
