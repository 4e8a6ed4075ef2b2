"""The Hydra recipes' side of the package (`recipes/train.py`, `conf/`): `driver` (runtime environment, early checks,
the hardware-free plan, callbacks, loggers, auto-resume, the preempted run's exit), `config` (the resolvers),
`summary` and `plot` (the end-of-run summary and `loss.png`), `example` (`python -m lightning_ulysses
example-finetune`)."""
