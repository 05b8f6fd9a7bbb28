"""The export process: tracker exporters in a child process of the trainer.

`export_process` (docs/configuration.md) moves the tracker exporters named in the config into one
child process; the training process only pays for handing records over.  This package holds both
ends and what they share: the receiver that turns shipped records and packed spans into deliveries
(also used in the training process when it takes the exporters back).
"""
