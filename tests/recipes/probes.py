"""Callbacks the recipe tests add to `recipes/train.py` runs (`+callbacks.<name>._target_=tests.recipes.probes...`):
they record what a run's ranks did, into files the test reads."""

from __future__ import annotations

import json
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
