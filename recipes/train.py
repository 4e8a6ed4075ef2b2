"""Hydra entry point: compose the config, build data, model, strategy and Trainer, fit.

    python recipes/train.py                                   # tiny Llama, copy task, SP 2 on 2 CPU processes
    python recipes/train.py data.seq_len=1024 trainer.max_steps=50
    python recipes/train.py -m data.seq_len=256,512           # a Hydra sweep
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig

import lightning_ulysses  # noqa: F401  (registers the "ulysses" strategy names)

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(config_path=CONFIG_DIR, config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # DeepSpeed JIT-builds ops on first use: keep the cache in the project's ignored folders.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
    # Deprecation chatter from DeepSpeed's and Lightning's internals, once per collective; nothing users can act on.
    warnings.filterwarnings("ignore", message=r"`torch.distributed.\w+` is deprecated")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    L.seed_everything(cfg.seed, workers=True)
    data = instantiate(cfg.data)
    module = instantiate(cfg.model)
    strategy = instantiate(cfg.strategy)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=CSVLogger(save_dir=run_dir, name="logs"),
                          default_root_dir=run_dir)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        print(f"\nRun directory: {run_dir}")
        print(f"Metrics (CSV): {trainer.logger.log_dir}/metrics.csv")
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.best_model_path:
            print(f"Checkpoint:    {trainer.checkpoint_callback.best_model_path}")
        print(f"Final metrics: { {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()} }")


if __name__ == "__main__":
    main()
