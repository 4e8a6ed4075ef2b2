"""Hydra entry point: compose the config, build data, model, strategy and Trainer, fit.

    python recipes/train.py                                            # experiment=tiny_cpu (CPU, SP 2)
    python recipes/train.py data.seq_len=1024 trainer.max_steps=50
    python recipes/train.py experiment=gpt3_176b_32k plan=true         # no hardware: parameters, layout, memory
    python recipes/train.py experiment=gpt3_176b_32k strategy.sequence_parallel_size=16 trainer.num_nodes=4
    python recipes/train.py -m data.seq_len=256,512                    # a Hydra sweep
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

import lightning_ulysses  # noqa: F401  (registers the "ulysses" strategy names)
from lightning_ulysses.integration.callbacks import PROGRESS_BAR_NAMES
from lightning_ulysses.recipe.config import register_resolvers
from lightning_ulysses.recipe.driver import (apply_runtime_environment, build_callbacks, build_loggers, check_recipe,
                                             continue_command, end_preempted_run, export_callbacks, plan,
                                             quiet_third_party, resume_decision, strategy_memory)
from lightning_ulysses.recipe.summary import run_summary

ROOT = Path(__file__).resolve().parents[1]
register_resolvers()


@rank_zero_only
def rank_zero_print(line: str) -> None:
    print(line, flush=True)


@hydra.main(config_path=str(ROOT / "conf"), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.plan:
        print(plan(cfg))
        return
    # DeepSpeed JIT-builds ops on first use: keep the cache in the project's ignored folders.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    apply_runtime_environment(cfg.runtime)
    if cfg.console.quiet_third_party:
        quiet_third_party()
    L.seed_everything(cfg.seed, workers=True)

    module = instantiate(cfg.model)
    check_recipe(cfg, module.spec)  # bad overrides fail here, before Lightning starts any other rank
    data = instantiate(cfg.data)
    # memory=auto gets data.seq_len; the strategy's quiet console follows the recipe's
    strategy = instantiate(cfg.strategy, memory=strategy_memory(cfg), quiet_third_party=cfg.console.quiet_third_party)
    strategy.preemption_note = False  # the recipe prints its own continue command (`end_preempted_run`)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    callbacks = build_callbacks(cfg)
    exports = export_callbacks(cfg.export, module.spec, run_dir)
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=build_loggers(cfg.loggers, run_dir, cfg.run_name),
                          callbacks=callbacks + exports, default_root_dir=run_dir)
    with resume_decision(cfg.resume, callbacks, run_dir, announce=rank_zero_print) as decision:
        try:
            trainer.fit(module, datamodule=data, ckpt_path=decision.path)
        except SIGTERMException:  # a scheduler's signal: every rank saved at the same step (SchedulerSignals)
            hydra_config = HydraConfig.get()
            sweep_dir = os.path.abspath(hydra_config.sweep.dir) if hydra_config.mode == RunMode.MULTIRUN else None
            command = continue_command(sys.argv, cfg.run_name, sweep_dir=sweep_dir)
            raise SystemExit(end_preempted_run(trainer, decision, command, callbacks, run_dir))
    if trainer.is_global_zero:
        checkpoint = trainer.checkpoint_callback
        csv = next((logger for logger in trainer.loggers if isinstance(logger, CSVLogger)), None)
        print("\n" + run_summary(run_dir, None if csv is None else Path(csv.log_dir) / "metrics.csv",
                                 checkpoint and (checkpoint.last_model_path or checkpoint.best_model_path),
                                 [export.directory for export in exports]))
        metrics = {k: round(float(v), 4) for k, v in sorted(trainer.callback_metrics.items())
                   if k not in PROGRESS_BAR_NAMES.values()}  # the progress bar's copies of the throughput numbers
        print(f"Final metrics: {metrics}")


if __name__ == "__main__":
    main()
