"""The recipes' LightningModule: any Hugging Face causal LM, random init from a config, no download.

Written exactly as it would be without sequence parallelism: the strategy shards the batch, swaps the
attention and makes `model(**batch).loss` the whole-sequence loss.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from transformers import AutoConfig, AutoModelForCausalLM


class CausalLMModule(L.LightningModule):
    """Args:
        model: keyword arguments of a transformers config, with `model_type` (e.g. `{"model_type": "llama",
            "hidden_size": 64, ...}`).
        attn_implementation: the local attention backend Ulysses wraps (`sdpa`, `flash_attention_2`, ...).
        learning_rate, weight_decay, betas: AdamW settings.
    """

    def __init__(
        self,
        model: dict[str, Any],
        attn_implementation: str = "sdpa",
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None

    def configure_model(self) -> None:
        if self.model is not None:  # configure_model runs again for validate/test after fit
            return
        options = dict(self.hparams.model)
        config = AutoConfig.for_model(options.pop("model_type"), **options)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation=self.hparams.attn_implementation)
        self._initialize_sharded_weights()

    def _initialize_sharded_weights(self) -> None:
        """Re-run Hugging Face's weight init when the model was built partitioned under ZeRO-3.

        Inside `deepspeed.zero.Init` (Lightning's `configure_model` under ZeRO-3) HF's `_init_weights` never sees
        the real tensors, and embeddings came out with std 1.0 instead of 0.02. One module at a time is gathered,
        initialised on rank 0 and re-partitioned, so no rank ever holds the whole model.
        """
        parameters = list(self.model.parameters())
        if not parameters or not hasattr(parameters[0], "ds_id"):
            return
        import deepspeed

        for module in self.model.modules():
            own = list(module.parameters(recurse=False))
            if own:
                with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
                    if self.global_rank == 0:
                        self.model._init_weights(module)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val/loss", self.model(**batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay,
            betas=tuple(self.hparams.betas),
        )
