"""The recipes' LightningModule, for native GPTs and Hugging Face models alike.

Written exactly as it would be without sequence parallelism: the strategy shards the batch, swaps the
attention and makes `model(**batch).loss` the whole-sequence loss.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

import lightning as L
import torch
from typing_extensions import override

from lightning_ulysses.models.hf import PretrainedCausalLM
from lightning_ulysses.models.lora import LoraSettings, with_lora
from lightning_ulysses.training.loss import sequence_parallel_cross_entropy
from lightning_ulysses.training.optim import LRSchedule, adamw, optimizer_on_host, parameter_groups, schedule_config


class ModelSpec(Protocol):
    """What `CausalLMModule` builds. `recipe.plan` also asks a spec for `planner_shape()` where it has one (else it
    reads the Llama-style `spec.config`)."""

    def build(self) -> torch.nn.Module: ...

    def num_parameters(self) -> int: ...


class CausalLMModule(L.LightningModule):
    """Args:
        model: what to build (`GPTConfig`, `HuggingFaceCausalLM` or `PretrainedCausalLM`, see `from_pretrained`);
            built in `configure_model`, i.e. partitioned from the start under ZeRO-3 (pretrained weights too).
        learning_rate, weight_decay, betas: AdamW settings; norms, biases and other 1-D parameters get no weight
            decay, frozen parameters are left out (`lightning_ulysses.training.optim.parameter_groups`).
        schedule: the learning-rate schedule per optimizer step (`lightning_ulysses.training.optim.LRSchedule`); `None`:
            constant.
        activation_checkpointing: recompute every layer in backward.
        report_loss_split: also log the loss of the targets before and after this position (`loss_first`,
            `loss_second`): the copy task's random half and copied half.
        lora: LoRA adapters on the built model (`LoraSettings`' fields: `r`, `alpha`, `target_modules`, `dropout`,
            `seed`): the base frozen, only the adapters train (`lightning_ulysses.models.lora`).
    """

    def __init__(
        self,
        model: ModelSpec,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        activation_checkpointing: bool = False,
        report_loss_split: Optional[int] = None,
        lora: Optional[Mapping[str, Any]] = None,
        schedule: Optional[LRSchedule] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.spec = model
        self.model: Optional[torch.nn.Module] = None

    @classmethod
    def from_pretrained(cls, pretrained: str, attn_implementation: str = "sdpa", torch_dtype: Optional[str] = None,
                        rope_scaling: Optional[Mapping[str, Any]] = None, config: Optional[Mapping[str, Any]] = None,
                        **kwargs: Any) -> "CausalLMModule":
        """The module of a pretrained folder (`PretrainedCausalLM`'s arguments), its weights loaded in
        `configure_model`; `kwargs`: this class's other arguments (`conf/model/hf_pretrained.yaml`)."""
        return cls(PretrainedCausalLM(pretrained, attn_implementation, torch_dtype, rope_scaling, config), **kwargs)

    @override
    def configure_model(self) -> None:
        if self.model is not None:  # configure_model runs again for validate/test after fit
            return
        self.model = self.spec.build()
        if self.hparams.lora is not None:  # after the load: peft wraps the loaded layers
            self.model = with_lora(self.model, LoraSettings(**self.hparams.lora))
        if self.hparams.activation_checkpointing:
            self.model.gradient_checkpointing_enable()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step("train", batch)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step("val", batch)

    def _step(self, stage: str, batch: dict) -> torch.Tensor:
        outputs = self.model(**batch)
        self.log(f"{stage}/loss", outputs.loss, prog_bar=True, sync_dist=stage == "val")
        if self.hparams.report_loss_split is not None:
            if outputs.logits is None:
                raise ValueError("report_loss_split needs the logits, which tiled logits + loss never materialises in"
                                 " training: set strategy.memory.tiled_logits_loss=false or report_loss_split=null.")
            first, second = self._split_losses(outputs.logits.detach(), batch)
            self.log(f"{stage}/loss_first", first, prog_bar=True, sync_dist=stage == "val")
            self.log(f"{stage}/loss_second", second, prog_bar=True, sync_dist=stage == "val")
        return outputs.loss

    @torch.no_grad()
    def _split_losses(self, logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-sequence losses of the targets before / after `report_loss_split` (a label's position is its
        target's), the same with or without the strategy and at every SP size."""
        strategy = self.trainer.strategy
        labels = batch["labels"]
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(labels.size(1), device=labels.device).expand_as(labels)
        second = positions >= self.hparams.report_loss_split
        # Asked of the strategy, not of its class: the example models do not import the package's integration.
        if getattr(strategy, "batches_are_sharded", False):
            loss = strategy.loss_function  # UlyssesDeepSpeedStrategy's: shifts across the shards of the SP group
        else:
            loss = lambda logits, labels: sequence_parallel_cross_entropy(logits, labels=labels)  # noqa: E731
        return loss(logits, labels.masked_fill(second, -100)), loss(logits, labels.masked_fill(~second, -100))

    @override
    def configure_optimizers(self):
        try:
            trainer = self.trainer
        except RuntimeError:  # built outside fit: no trainer, no strategy, torch's AdamW
            trainer = None
        optimizer = adamw(parameter_groups(self, self.hparams.weight_decay), self.hparams.learning_rate,
                          tuple(self.hparams.betas), on_host=optimizer_on_host(trainer))
        if self.hparams.schedule is None:  # no Trainer needed (the optimizer alone, e.g. built outside fit)
            return optimizer
        return schedule_config(optimizer, self.hparams.schedule, self.trainer)
