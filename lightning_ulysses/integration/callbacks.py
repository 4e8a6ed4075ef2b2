"""`ThroughputCallback`: tokens/s, model TFLOP/s, MFU and peak memory, in the progress bar and the logger.

Model FLOPs per step follow the issue's formula, per sequence of `seq` tokens: `6·params·seq + 6·layers·seq²·hidden`
(causal attention counted once, as useful work; recomputation is not counted). Tokens are counted over all ranks
(an SP group's shards add up to whole sequences; DP replicas add up), so a whole-job number is what is logged.
The peak defaults to Lightning's `get_available_flops` for the device and precision (datasheet dense peak);
pass `peak_flops` to measure against a measured one (e.g. 772e12 for the H200's bf16 matmul).

Lightning's own `ThroughputMonitor` needs a per-batch FLOP count from the user (`measure_flops` traces the model,
which counts attention as dense and cannot see the SP shards); this callback computes the count analytically from
the model's shape and the global sequence length instead.
"""

from __future__ import annotations

import math
import resource
import time
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

from lightning_ulysses.adapters.native_model import NativeCausalLM
from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.planning.planner import ModelShape
from lightning_ulysses.planning.step_time import model_flops_per_step


def infer_model_shape(module: torch.nn.Module) -> ModelShape:
    """The shape of the first native GPT or Hugging Face causal LM inside `module`."""
    for child in module.modules():
        if isinstance(child, NativeCausalLM):
            return child.planner_shape()
        config = getattr(child, "config", None)
        if config is not None and hasattr(config, "num_hidden_layers") and hasattr(config, "vocab_size"):
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            try:
                return ModelShape.from_hf_config(config)
            except ValueError:  # a hybrid whose mixers' costs are not declared: counted as attention layers
                return ModelShape.from_hf_config(config, hybrid=False)
    raise ValueError(f"ThroughputCallback found no GPT or Hugging Face causal LM in {type(module).__name__}:"
                     " pass model_shape=lightning_ulysses.planning.planner.ModelShape(...).")


def model_flops_per_sequence(shape: ModelShape, seq_len: int) -> float:
    if shape.layers:  # a hybrid: the weights a token multiplies (experts it reaches), attention layers, scans
        return model_flops_per_step(shape, seq_len)
    return 6 * shape.num_parameters * seq_len + 6 * shape.num_layers * seq_len**2 * shape.hidden_size


# The logger's names (stable: CSV columns, dashboards) and the progress bar's (short enough not to be cut there).
PROGRESS_BAR_NAMES = {"throughput/tokens_per_s": "tok/s", "throughput/tflops": "TFLOP/s", "throughput/mfu": "MFU",
                      "memory/peak_gib": "GiB"}


class ThroughputCallback(pl.Callback):
    """Logs `throughput/tokens_per_s`, `throughput/tflops`, `throughput/mfu` (when a peak is known) and
    `memory/peak_gib` (GPU: max allocated; CPU: the process's peak resident memory) every training step; the
    progress bar shows them as `tok/s`, `TFLOP/s`, `MFU` and `GiB`.

    Args:
        peak_flops: FLOP/s per device that MFU is measured against; `None`: from the device (Lightning's table).
        model_shape: the model's shape; `None`: inferred from the LightningModule.
        prog_bar: also show the numbers in the progress bar.
    """

    def __init__(self, peak_flops: Optional[float] = None, model_shape: Optional[ModelShape] = None,
                 prog_bar: bool = True) -> None:
        self.peak_flops = peak_flops
        self.model_shape = model_shape
        self.prog_bar = prog_bar
        self.total_tokens = 0
        self._started = 0.0

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if self.peak_flops is None and trainer.strategy.root_device.type == "cuda":
            from lightning.fabric.utilities.throughput import get_available_flops

            self.peak_flops = get_available_flops(trainer.strategy.root_device, _compute_dtype(trainer))

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self.model_shape is None:
            self.model_shape = infer_model_shape(pl_module)
        _synchronize(trainer)
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        _synchronize(trainer)
        seconds = time.perf_counter() - self._started
        input_ids = batch["input_ids"]
        sequence_parallel = getattr(trainer.strategy, "sequence_parallel_world_size", 1)
        if not getattr(trainer.strategy, "batches_are_sharded", False):
            sequence_parallel = 1
        seq_len = input_ids.size(1) * sequence_parallel  # the whole sequence (an SP rank holds 1/SP of it)
        # Each rank adds the FLOPs of its own rows at its own length (DP ranks may hold different lengths in one
        # step); every sequence's rows sit on all its SP ranks, so each rank adds 1/SP of them.
        local_flops = input_ids.size(0) / sequence_parallel * model_flops_per_sequence(self.model_shape, seq_len)
        local = torch.tensor([input_ids.numel(), local_flops], dtype=torch.float64, device=trainer.strategy.root_device)
        tokens, flops = trainer.strategy.reduce(local, reduce_op="sum").tolist()
        self.total_tokens += int(tokens)
        metrics = {"throughput/tokens_per_s": tokens / seconds, "throughput/tflops": flops / seconds / 1e12,
                   "memory/peak_gib": _peak_memory(trainer) / 2**30}
        if self.peak_flops:
            metrics["throughput/mfu"] = flops / seconds / (self.peak_flops * trainer.world_size)
        self.last_metrics = dict(metrics, tokens=tokens, flops=flops, seconds=seconds)
        pl_module.log_dict(metrics, logger=True, prog_bar=False, on_step=True, on_epoch=False, sync_dist=False)
        if self.prog_bar:
            pl_module.log_dict({PROGRESS_BAR_NAMES[name]: value for name, value in metrics.items()}, logger=False,
                               prog_bar=True, on_step=True, on_epoch=False, sync_dist=False)


def planned_epochs(trainer: "pl.Trainer") -> Optional[int]:
    """How many epochs `fit` will run: `max_epochs`, or fewer when `max_steps` ends it sooner (an epoch of `b`
    batches is `ceil(b / accumulate_grad_batches)` optimizer steps); `None` when neither bounds it."""
    bounds = [trainer.max_epochs] if trainer.max_epochs is not None and trainer.max_epochs > 0 else []
    batches = trainer.num_training_batches
    if trainer.max_steps > 0 and math.isfinite(batches) and batches > 0:
        bounds.append(math.ceil(trainer.max_steps / math.ceil(batches / trainer.accumulate_grad_batches)))
    return min(bounds, default=None)


class TrainingProgressBar(RichProgressBar):
    """Lightning's rich progress bar with the totals of a `max_steps` run: `Epoch 0/2` counts to the last epoch
    `max_steps` reaches (Lightning prints `max_epochs - 1`, i.e. `Epoch 0/-2` for `max_epochs=-1`), and the batch
    total is the batches this epoch will run, counted in micro-batches under gradient accumulation and from the
    epoch's start also after a resume in its middle (Lightning takes the optimizer steps left: `400/249`, i.e.
    batch 400 of an epoch of which 249 steps remain); without the logger's `v_num`. The strategy turns Lightning's
    default bar into this one (`correct_progress_bar`)."""

    # True inside `on_train_epoch_start`, where Lightning's batch counter still holds the previous epoch's count.
    _epoch_starting = False

    @property
    @override
    def total_train_batches(self) -> Union[int, float]:
        trainer = self.trainer
        if trainer.max_steps <= 0:
            return trainer.num_training_batches
        accumulate = trainer.accumulate_grad_batches
        # Batches of this epoch run so far: none as it starts; after a resume in its middle, the bar is first drawn at
        # the end of a batch, with the checkpoint's batches and this one counted, and this batch's step in
        # `global_step`. An accumulation window steps every `accumulate` batches from the epoch's start.
        done = 0 if self._epoch_starting else lightning_private.epoch_batch_progress(trainer)[0]
        steps_left = trainer.max_steps - trainer.global_step
        return min(trainer.num_training_batches, (done // accumulate + steps_left) * accumulate)

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._epoch_starting = True
        try:
            super().on_train_epoch_start(trainer, pl_module)
        finally:
            self._epoch_starting = False

    @override
    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Union[int, str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version number: the run folder's logs/version_<n> says it
        return metrics

    @override
    def _get_train_description(self, current_epoch: int) -> str:  # private: lightning_ulysses.fences._lightning_private
        epochs = planned_epochs(self.trainer)
        description = f"Epoch {current_epoch}" + ("" if epochs is None else f"/{epochs - 1}")
        # Lightning pads to the validation bar's description: equal widths do not flicker.
        return f"{description:{len(self.validation_description)}}"


def correct_progress_bar(trainer: "pl.Trainer") -> None:
    """Lightning's own rich progress bar, the default (exactly `RichProgressBar`, not a subclass someone wrote),
    becomes a `TrainingProgressBar`: the same object, so the settings it was made with stay, with the class that
    corrects its totals (which adds no state of its own). Another bar is left as it is. `transformers` (through
    `typer`) installs `rich`, so the rich bar is Lightning's default wherever the strategy runs."""
    bar = trainer.progress_bar_callback
    if type(bar) is RichProgressBar:
        bar.__class__ = TrainingProgressBar


def _compute_dtype(trainer) -> torch.dtype:
    precision = str(trainer.precision)
    return torch.bfloat16 if "bf16" in precision else torch.float16 if "16" in precision else torch.float32


def _synchronize(trainer) -> None:
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)


def _peak_memory(trainer) -> float:
    if trainer.strategy.root_device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(trainer.strategy.root_device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB
