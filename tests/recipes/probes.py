"""Callbacks the recipe tests add to `recipes/train.py` runs (`+callbacks.<name>._target_=tests.recipes.probes...`):
they record what a run's ranks did, into files the test reads."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override


class ParameterGroupProbe(pl.Callback):
    """Writes `<folder>/groups_rank<r>.json`: the parameter groups the module's `configure_optimizers` built on this
    rank, as it built them (DeepSpeed replaces the groups' parameters with its flat partitions right after), with
    each parameter's local and real shape."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        configure = pl_module.configure_optimizers

        def recording():
            result = configure()
            optimizer = result["optimizer"] if isinstance(result, dict) else result
            names = {id(p): name for name, p in pl_module.named_parameters()}
            groups = [{"weight_decay": group["weight_decay"],
                       "parameters": {names[id(p)]: {"shape": list(p.shape), "ds_shape": list(p.ds_shape)}
                                      for p in group["params"]}} for group in optimizer.param_groups]
            (self.folder / f"groups_rank{trainer.global_rank}.json").write_text(json.dumps(groups))
            return result

        pl_module.configure_optimizers = recording


class PauseForSignal(pl.Callback):
    """On global rank 0, once the run reaches optimizer step `step`: writes `<folder>/paused_at_step_<step>` (its pid)
    and waits until the strategy has recorded a scheduler's signal (at most `timeout` seconds), so that a test's
    real SIGTERM arrives at a known step however fast or slow the machine is. The other ranks wait for it in their
    next collective, as they would for a slow rank."""

    def __init__(self, folder: str, step: int, timeout: float = 300.0) -> None:
        self.folder, self.step, self.timeout = Path(folder), step, timeout
        self._paused = False

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", *args, **kwargs) -> None:
        if self._paused or trainer.global_rank != 0 or trainer.global_step != self.step:
            return
        self._paused = True
        (self.folder / f"paused_at_step_{self.step}").write_text(str(os.getpid()))
        deadline = time.monotonic() + self.timeout
        while not trainer.strategy.runtime.faults.signals.pending:  # set by the SIGTERM handler (faults.SchedulerSignals)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no signal reached rank 0 within {self.timeout} s of step {self.step}")
            time.sleep(0.05)
