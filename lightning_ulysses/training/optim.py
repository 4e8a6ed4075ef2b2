"""Optimizer setup for any LightningModule under the strategy: parameter groups that exempt norms and biases from
weight decay, and learning-rate schedules stepped once per optimizer step.

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(parameter_groups(self, weight_decay=0.1), lr=3e-4)
        return schedule_config(optimizer, LRSchedule("cosine", warmup_steps=100, min_lr_ratio=0.1), self.trainer)

Under ZeRO-3, `configure_optimizers` sees parameters that `deepspeed.zero.Init` has already partitioned: each
`p.shape` is `torch.Size([0])` and the real shape is `p.ds_shape`, so "1-D means a bias or a norm" must read the
latter (`parameter_groups` does). Lightning's `DeepSpeedStrategy` takes the scheduler off DeepSpeed's engine
(`engine.lr_scheduler = None`) and steps it itself after each optimizer step (`interval="step"`), never once per
micro-batch, and saves and restores its state with the rest of Lightning's checkpoint (DeepSpeed's own
`lr_scheduler` entry stays empty).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional

import torch

from lightning_ulysses.fences import _torch_private as torch_private
from lightning_ulysses.parallel.run_spec import RunSpec

_NORM_TYPES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm, torch_private.NormBase)


def _is_norm(module: torch.nn.Module) -> bool:
    # Hugging Face's norms are classes of their own (LlamaRMSNorm, ...): their names say what they are.
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def parameter_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW parameter groups of `module`'s trainable parameters: `weight_decay` for matrices, 0 for norm
    weights, biases and every other parameter of fewer than 2 dimensions (by its real shape, also under ZeRO-3).
    Frozen parameters (`requires_grad=False`) are left out; a parameter shared by two modules (tied embeddings)
    appears once. Empty groups are dropped."""
    decayed, exempt, seen = [], [], set()
    for child in module.modules():
        for name, parameter in child.named_parameters(recurse=False):
            if not parameter.requires_grad or id(parameter) in seen:
                continue
            seen.add(id(parameter))
            shape = getattr(parameter, "ds_shape", parameter.shape)  # ZeRO-3: `shape` is the empty local partition
            (exempt if _is_norm(child) or name == "bias" or len(shape) < 2 else decayed).append(parameter)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


@dataclass
class LRSchedule:
    """The learning rate as a factor of the optimizer's, per optimizer step `s` (0 for the first step):
    linear warmup `(s + 1) / warmup_steps` for `s < warmup_steps`, then `constant` (1), or `cosine` / `linear`
    decay from 1 to `min_lr_ratio` at `total_steps` (and `min_lr_ratio` after it).

    Args:
        kind: `constant`, `cosine` or `linear`.
        warmup_steps: optimizer steps of linear warmup (0: none).
        min_lr_ratio: the factor decay ends at.
        total_steps: optimizer steps the decay ends at; `None`: the trainer's (`trainer.estimated_stepping_batches`,
            i.e. `max_steps` when set). Resolved when the optimizer is built and saved with the checkpoint, so a
            resumed run continues the curve it started on.
    """

    kind: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine", "linear"):
            raise ValueError(f"LRSchedule kind={self.kind!r}: use constant, cosine or linear")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"LRSchedule needs warmup_steps >= 0 and 0 <= min_lr_ratio <= 1, got {self}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def resolved(self, trainer_steps: float) -> "LRSchedule":
        """This schedule with `total_steps` filled in from the trainer's number of optimizer steps."""
        if self.total_steps is not None or self.kind == "constant":
            return self
        if not math.isfinite(trainer_steps):
            raise ValueError(f"A {self.kind} schedule needs an end: set trainer.max_steps (or max_epochs), or"
                             " model.schedule.total_steps")
        return replace(self, total_steps=int(trainer_steps))


def optimizer_on_host(trainer: Any) -> bool:
    """Whether the trainer's strategy runs the optimizer step on the host: its run offloads the optimizer
    (`RunSpec.offloads_optimizer`: `zero_optimization.offload_optimizer.device` cpu or nvme, set by you or by
    `memory="auto"` before `configure_optimizers` runs). A DeepSpeed strategy other than ours is asked through its
    config; `False` without a trainer or a DeepSpeed strategy."""
    strategy = getattr(trainer, "strategy", None)
    if isinstance(getattr(type(strategy), "run_spec", None), property):  # ours: described once, at set-up
        return strategy.run_spec.offloads_optimizer
    return RunSpec.of_config(getattr(strategy, "config", None)).offloads_optimizer


def adamw(groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], on_host: bool) -> torch.optim.Optimizer:
    """AdamW over `groups`: torch's, or DeepSpeed's CPU Adam in AdamW mode (the same update) where the optimizer runs
    on the host — DeepSpeed refuses a torch optimizer for its offload (`zero_force_ds_cpu_optimizer`), and partial
    offload (`offload_optimizer.ratio`) steps its host share with this one."""
    if not on_host:
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, adamw_mode=True)


def schedule_config(optimizer: torch.optim.Optimizer, schedule: Optional[LRSchedule],
                    trainer: Any) -> Any:
    """What `configure_optimizers` returns: the optimizer alone without a schedule, else the optimizer with a
    `LambdaLR` of `schedule` stepped every optimizer step (logged by `LearningRateMonitor` as `lr`)."""
    if schedule is None:
        return optimizer
    factor = schedule.resolved(trainer.estimated_stepping_batches)
    # A callable object, not a closure: LambdaLR saves its fields with the scheduler state (the resolved total).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}
