"""Checkpoints that survive interruption, resume exactly, resume at another SP/DP layout, and export.

A checkpoint is DeepSpeed's directory (one shard file per rank) plus what this module adds to it:

- `ulysses.json`, the manifest: written last, by global rank 0, once every rank has finished writing. A
  directory without it is an interrupted save and is refused on load.
- `rng/rank_<r>.pt`: every rank's random-number-generator states, the shared stream's and the SP rank's own that
  its steps draw dropout masks from (`lightning_ulysses.integration.rng`), restored at the first training batch after a resume.
- `hf/<module path>/config.json`: the config of every Hugging Face model in the LightningModule, so `export`
  can write a `save_pretrained` directory without the training code; beside it, for a model a PEFT (LoRA) model
  adapts, every adapter's `LoraConfig` as peft's own `adapter_config.json`, in the layout of peft's `save_pretrained`
  (the adapter `default` beside `config.json`, any other in `<name>/`), and `adapters.json` (the adapters' names in
  peft's order and the active ones: `{"adapters": [...], "active": [...]}`), so that `export` rebuilds the PEFT model
  and writes its `adapter/` (and `merged/`) folders as `ExportPretrained` does at the end of `fit`. The PEFT model's
  state-dict keys are the recorded model's under `base_model.model.` (`export.PEFT_BASE`): nothing else needs
  recording. Checkpoints written before `adapters.json` record the one adapter `default` (beside `config.json`).

Saves are atomic: ranks write into `<path>.partial`; rank 0 then moves a previous checkpoint at `<path>` aside
to `<path>.previous`, renames `<path>.partial` to `<path>` and deletes `<path>.previous`. A save interrupted at
any point leaves either the old checkpoint at `<path>` or, during the two renames, a complete one at
`<path>.previous` that `resolve_checkpoint` falls back to. Neither suffix ends in `.ckpt`, so Lightning's
`ckpt_path="last"` never picks them.

ZeRO partitions are laid out over the whole world (global rank order) at every SP/DP split, so a checkpoint
loads unchanged at another split of the same number of ranks; only the data position needs translating
(`ResumableSampler`). A different number of ranks is refused before anything is loaded (the shards are cut per
rank); `export` still recovers the weights from such a checkpoint.

`StrategyCheckpoints` is the strategy's side of all this (its checkpoint hooks delegate to it): the staged save
and its barriers, the loop state rewritten to the data position, the resume state kept from load to the first
batch, and evaluation loads of ZeRO-3 checkpoints (which DeepSpeed cannot load into an engine without optimizer).

Command line: `python -m lightning_ulysses checkpoint {inspect,export} ...` (see `main`; `export <ckpt> <folder>`
writes the folders the recipes' `export.enabled` writes, into `<folder>` itself for one model; `--merged` also
writes a LoRA model's adapters merged into its base weights, `--tokenizer` saves a tokenizer beside the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler, SequentialSampler

from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.integration import console
from lightning_ulysses.integration.export import (DEFAULT_ADAPTER, PEFT_BASE, PeftAdapters, adapter_configs,
                                      save_pretrained_folders)
from lightning_ulysses.integration.rng import SequenceParallelRNG

MANIFEST = "ulysses.json"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under
ADAPTER_CONFIG = "adapter_config.json"  # peft's file name (`PeftConfig.save_pretrained` / `from_pretrained`)
ADAPTERS = "adapters.json"  # a PEFT model's adapter names and active ones, beside its recorded configs


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory whose save never finished (no manifest, or shard files missing)."""


@dataclass(frozen=True)
class CheckpointManifest:
    """What a complete checkpoint records about the run that wrote it."""

    world_size: int
    sequence_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    # Samples of the current epoch already trained on, counted over all DP ranks (0 at an epoch boundary): the
    # prefix of the epoch's sample order that a resume skips, whatever the new DP size.
    epoch_samples_consumed: int
    hf_models: tuple[str, ...] = ()
    # Samples per training batch over all DP ranks (batch size × DP): a mid-epoch resume must keep it, since
    # Lightning's restored batch counter is in batches of this size.
    global_batch_size: Optional[int] = None
    # Micro-batches of an unfinished accumulation window at the save (a save inside a window: a callback, a
    # mid-window validation's checkpoint). Their gradients are not saved, so resuming training from here is refused.
    micro_batches_accumulated: int = 0
    # The trainer's global step (optimizer steps) the checkpoint resumes at, as Lightning's own `global_step` entry
    # in the shards: read here without opening them (`saved_global_step`, `resume=auto`'s choice). None: written
    # before it was recorded.
    global_step: Optional[int] = None
    format: int = FORMAT_VERSION

    def write(self, directory: Path) -> None:
        path = directory / MANIFEST
        with open(path, "w") as handle:
            json.dump(asdict(self), handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())

    @classmethod
    def read(cls, directory: Path) -> "CheckpointManifest":
        data = json.loads((directory / MANIFEST).read_text())
        data["hf_models"] = tuple(data.get("hf_models", ()))
        return cls(**data)


def staging_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def previous_path(path: Path) -> Path:
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def prepare_staging(path: Path) -> Path:
    """Rank 0, before any rank writes: an empty staging directory (leftovers of an interrupted save removed)."""
    staging = staging_path(path)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(path: Path, manifest: CheckpointManifest) -> None:
    """Rank 0, after every rank finished writing into the staging directory: make it the checkpoint at `path`."""
    staging, previous = staging_path(path), previous_path(path)
    _check_shards(staging, manifest)
    manifest.write(staging)
    if previous.exists():  # a crash between the renames of an earlier save; `path` is the newer, complete one
        shutil.rmtree(previous) if path.exists() else os.replace(previous, path)
    if path.exists():
        os.replace(path, previous)
    os.replace(staging, path)
    _fsync_directory(path.parent)
    if previous.exists():
        shutil.rmtree(previous) if previous.is_dir() else previous.unlink()


def resolve_checkpoint(path: Path) -> Path:
    """The complete checkpoint to load for `path`, or a clear error. Falls back to `<path>.previous` when a save
    was interrupted between its two renames."""
    if path.name.endswith(PARTIAL_SUFFIX):
        raise IncompleteCheckpointError(
            f"{path} is the staging directory of a save that never finished; load {path.name[: -len(PARTIAL_SUFFIX)]}"
            " (the last complete checkpoint) instead."
        )
    if not path.exists() and previous_path(path).is_dir():
        path = previous_path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    if not (path / MANIFEST).exists():
        if (path / "latest").exists() and not staging_path(path).exists():
            return path  # written by Lightning's own DeepSpeedStrategy: nothing to check it against
        raise IncompleteCheckpointError(
            f"{path} has no {MANIFEST}: its save was interrupted before every rank finished. Resume from an earlier"
            " checkpoint in the same folder."
        )
    _check_shards(path, CheckpointManifest.read(path))
    return path


def read_manifest(path: Path) -> Optional[CheckpointManifest]:
    return CheckpointManifest.read(path) if (path / MANIFEST).exists() else None


def saved_global_step(path: Path) -> int:
    """The global step the complete checkpoint at `path` (as `resolve_checkpoint` returns it, or a single-file
    checkpoint of another strategy) resumes at: its manifest's, else Lightning's `global_step` entry, read from the
    first DeepSpeed model-state file (a memory map: no tensor is read)."""
    path = Path(path)
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest is not None and manifest.global_step is not None:
        return manifest.global_step
    if path.is_dir():
        shards = sorted((path / deepspeed_tag(path)).glob("*model_states.pt"))
        if not shards:
            raise IncompleteCheckpointError(f"{path} holds no DeepSpeed model-state file to read its step from.")
        path = shards[0]
    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["global_step"])


def _check_shards(directory: Path, manifest: CheckpointManifest) -> None:
    """Every rank's shard is there: one optimizer-state file per rank for ZeRO 1-3, model states in any case."""
    shards = directory / DEEPSPEED_TAG
    model_states = list(shards.glob("*model_states.pt"))
    optimizer_states = list(shards.glob("*zero_pp_rank_*_optim_states.pt"))
    expected = manifest.world_size if manifest.zero_stage > 0 else 0
    if not model_states or len(optimizer_states) < expected:
        raise IncompleteCheckpointError(
            f"{directory} is missing shard files ({len(optimizer_states)} of {expected} optimizer-state files,"
            f" {len(model_states)} model-state files under {DEEPSPEED_TAG}/): its save did not finish. Resume from an"
            " earlier checkpoint."
        )


def _fsync_directory(directory: Path) -> None:
    # The renames above are durable only once the directory entry is on disk (POSIX); harmless elsewhere.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- random number generators ------------------------------------------------------------------------------------
def save_rng_state(directory: Path, rank: int, streams: SequenceParallelRNG) -> None:
    (directory / "rng").mkdir(exist_ok=True)
    torch.save(streams.collect(), directory / "rng" / f"rank_{rank}.pt")


def load_rng_state(directory: Path, rank: int) -> Optional[dict[str, Any]]:
    path = directory / "rng" / f"rank_{rank}.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


# -- data position -------------------------------------------------------------------------------------------------
class ResumableSampler(Sampler):
    """Wraps a training sampler so that the first epoch after a resume skips what was already trained on.

    Lightning restores its loop counters but restarts the epoch's data from the beginning. The distributed
    sampler gives DP rank `r` samples `order[r], order[r + dp], ...` of the epoch's order (fixed by seed and
    epoch), so the first `k` batches of all ranks together are exactly the prefix `order[: k * batch * dp]`.
    Skipping that prefix is therefore exact at the same DP size and at any other DP size that divides it.
    """

    def __init__(self, sampler: Sampler, data_parallel_size: int) -> None:
        self.sampler = sampler
        self.data_parallel_size = data_parallel_size
        self._skip_per_rank = 0

    def skip_once(self, epoch_samples_consumed: int, saved_global_batch: Optional[int] = None,
                  global_batch: Optional[int] = None) -> None:
        """Skip `epoch_samples_consumed` (counted over all DP ranks) at the start of the next iteration."""
        if saved_global_batch is not None and global_batch is not None and saved_global_batch != global_batch:
            raise ValueError(
                f"The checkpoint was written in the middle of an epoch with a global batch of {saved_global_batch}"
                f" samples (batch size × data-parallel size) and this run has {global_batch}: Lightning counts the"
                " epoch's progress in batches, so the data position cannot be continued. Keep the global batch (e.g."
                " halve the batch size when doubling the data-parallel size) or resume from an epoch-end checkpoint."
            )
        if epoch_samples_consumed % self.data_parallel_size:
            raise ValueError(
                f"The checkpoint was written after {epoch_samples_consumed} samples of the current epoch, which the"
                f" data-parallel size {self.data_parallel_size} does not divide: the resumed run cannot continue at"
                " the same sample. Resume with a data-parallel size that divides it, or from an epoch boundary."
            )
        self._skip_per_rank = epoch_samples_consumed // self.data_parallel_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip_per_rank = self._skip_per_rank, 0
        iterator = iter(self.sampler)
        for _ in range(skip):
            next(iterator, None)
        return iterator

    def __len__(self) -> int:
        # The full length: Lightning counts the skipped batches as done (its restored progress), so the epoch ends
        # where it would have.
        return len(self.sampler)


# -- export --------------------------------------------------------------------------------------------------------
def deepspeed_tag(path: Path) -> str:
    latest = Path(path) / "latest"
    return latest.read_text().strip() if latest.exists() else DEEPSPEED_TAG


def consolidated_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The LightningModule's full fp32 state dict, assembled from the ZeRO shards of the complete checkpoint at
    `path` (as `resolve_checkpoint` returns it; CPU memory: one model copy)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=deepspeed_tag(path))


def export(path: Path, output: Path, hf_model: Optional[str] = None, merged: bool = False,
           tokenizer: Optional[str] = None) -> list[Path]:
    """Write `output/model.pt` (the consolidated state dict) and the Hugging Face model's folders in the layout
    `ExportPretrained` (the recipes' `export.enabled`) writes: one model recorded in the checkpoint (or `hf_model`,
    a module path like `model`, chosen) is exported into `output` itself, a `save_pretrained` folder
    (`from_pretrained(output)`), or for a model with LoRA adapters `output/adapter` (every adapter, peft's layout)
    and, with `merged`, `output/merged` (the active adapters merged); several are exported side by side, each in
    `output/<module path>` (a PEFT model's: `output/<PEFT model's module path>`). `tokenizer` (a folder or Hub
    name): saved beside the weights in each of those folders, as the callback's `tokenizer` is. Returns the paths
    written."""
    path = resolve_checkpoint(Path(path))
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    state = consolidated_state_dict(path)
    written = [output / "model.pt"]
    torch.save(state, written[0])
    manifest = read_manifest(path)
    names = list(manifest.hf_models) if manifest else []
    if hf_model is not None:
        if hf_model not in names:
            raise ValueError(f"The checkpoint records no Hugging Face model at {hf_model!r}; it records {names}.")
        names = [hf_model]
    for name in names:
        # The PEFT model's module path for a model it adapts (`name` is that model's, see the module docstring).
        target = output if len(names) == 1 else output / name.removesuffix(f".{PEFT_BASE}")
        written += _export_hf_model(path / "hf" / name, state, name, target, merged, tokenizer)
    return written


def _export_hf_model(config_dir: Path, state: Mapping[str, torch.Tensor], name: str, target: Path,
                     merged: bool, tokenizer: Optional[str] = None) -> list[Path]:
    """The folder(s) `save_pretrained_folders` writes into `target` for the model recorded at `name` (see
    `export`)."""
    from transformers import AutoConfig

    prefix = f"{name}."
    weights = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    config = AutoConfig.from_pretrained(config_dir)
    adapters = read_adapters(config_dir)
    _refuse_unrecorded_adapters(config_dir, name, weights, adapters)
    if adapters is not None:
        # The PEFT model's own keys (`name` is that of the model it adapts, see the module docstring).
        weights = {f"{PEFT_BASE}.{key}": value for key, value in weights.items()}
        # The adapter folders name the base the run loaded (as the callback's do), not this checkpoint's folder. peft
        # records it in the first adapter's config only (`get_peft_model`; `add_adapter` leaves it unset).
        loaded = [lora.base_model_name_or_path for lora in adapters.configs.values() if lora.base_model_name_or_path]
        config.name_or_path = loaded[0] if loaded else config.name_or_path
    try:
        return save_pretrained_folders(config, weights, target, lora=adapters, merged=merged, tokenizer=tokenizer)
    except ValueError as error:
        raise ValueError(f"{name}: checkpoint weights do not match the model: {error}") from error


def _refuse_unrecorded_adapters(config_dir: Path, name: str, weights: Mapping[str, torch.Tensor],
                                adapters: Optional[PeftAdapters]) -> None:
    """A model whose weights carry peft's names (`...base_layer.weight`, `...lora_A.default.weight`) in a checkpoint
    without its adapter config (one written before checkpoints recorded it), or adapters (`...lora_A.<adapter>...`)
    the checkpoint does not record (written before checkpoints recorded several), cannot be rebuilt: say how to
    record them."""
    if adapters is not None:
        unrecorded = sorted(_adapter_names(weights) - set(adapters.configs))
        if unrecorded:
            raise ValueError(
                f"{name} was trained with the LoRA adapters {sorted(_adapter_names(weights))}, and this checkpoint"
                f" records the config of {list(adapters.configs)} only (checkpoints written before several adapters"
                f" were recorded hold the active one's, as `default`). Record them all and export again: each"
                f" adapter's config as peft saves it, `LoraConfig(...).save_pretrained('{config_dir}')` for `default`"
                f" and `.save_pretrained('{config_dir}/<adapter>')` for each other, and the names in"
                f" {config_dir / ADAPTERS}: {{'adapters': [every adapter], 'active': [those the model applied,"
                f" which --merged merges]}} as JSON."
            )
        return
    peft_keys = [key for key in weights if any(part == "base_layer" or part.startswith("lora_")
                                               for part in key.split("."))]
    if peft_keys:
        raise ValueError(
            f"{name} was trained with PEFT (LoRA) adapters ({peft_keys[0]}, ...), and this checkpoint does not record"
            f" their config (checkpoints record it as {ADAPTER_CONFIG} beside config.json for a model inside a"
            f" PeftModel; older ones do not). Write the run's LoRA settings there and export again: `LoraConfig(r=...,"
            f" lora_alpha=..., target_modules=[...]).save_pretrained('{config_dir}')` (peft), or for the recipes'"
            f" `model.lora` block"
            f" `LoraSettings(**lora).peft_config().save_pretrained('{config_dir}')` (lightning_ulysses.models.lora)."
        )


def _adapter_names(weights: Mapping[str, torch.Tensor]) -> set[str]:
    """The adapters named in peft's parameter names (`...q_proj.lora_A.<adapter>.weight`,
    `...lora_embedding_A.<adapter>`)."""
    return {parts[i + 1] for parts in (key.split(".") for key in weights)
            for i, part in enumerate(parts[:-1]) if part.startswith("lora_")}


def save_hf_configs(directory: Path, configs: Mapping[str, Any], module: Optional[torch.nn.Module] = None) -> None:
    """`hf/<module path>/config.json` of every model of `configs`, and beside it, for a model a PEFT model in `module`
    (the LightningModule) adapts, its adapters' configs and `adapters.json` (see the module docstring)."""
    adapters = adapter_configs(module) if module is not None else {}
    for name, config in configs.items():
        config.save_pretrained(directory / "hf" / name)
        if name in adapters:
            _save_adapters(directory / "hf" / name, adapters[name])


def _save_adapters(config_dir: Path, adapters: PeftAdapters) -> None:
    for name, lora in adapters.configs.items():
        lora.save_pretrained(_adapter_dir(config_dir, name))
    (config_dir / ADAPTERS).write_text(json.dumps({"adapters": list(adapters.configs), "active": list(adapters.active)},
                                                  indent=2))


def read_adapters(config_dir: Path) -> Optional[PeftAdapters]:
    """The `PeftAdapters` recorded beside the config at `config_dir` (see the module docstring); None: the model is
    not adapted by PEFT (or the checkpoint predates recording its adapters)."""
    if (config_dir / ADAPTERS).exists():
        record = json.loads((config_dir / ADAPTERS).read_text())
        names, active = record["adapters"], record["active"]
    elif (config_dir / ADAPTER_CONFIG).exists():  # recorded before several adapters were: the one, `default`
        names, active = [DEFAULT_ADAPTER], [DEFAULT_ADAPTER]
    else:
        return None
    from peft import PeftConfig

    return PeftAdapters({name: PeftConfig.from_pretrained(str(_adapter_dir(config_dir, name))) for name in names},
                        tuple(active))


def _adapter_dir(config_dir: Path, adapter: str) -> Path:
    """Where peft's `save_pretrained` puts an adapter of a PEFT model saved to `config_dir`."""
    return config_dir if adapter == DEFAULT_ADAPTER else config_dir / adapter


# -- the strategy's side: atomic saves, exact resumes, evaluation loads of ZeRO-3 checkpoints -----------------------
def _refuse_resume_inside_window(path: Path, manifest: CheckpointManifest) -> None:
    """A checkpoint saved inside a gradient-accumulation window holds the weights of the window's start but not the
    gradients of its first micro-batches: continuing from it would step on part of a window. The same on every rank
    (one manifest), before training."""
    pending = manifest.micro_batches_accumulated
    if pending:
        raise ValueError(
            f"{path} was saved inside a gradient-accumulation window, after {pending} micro-batch(es) whose gradients"
            " a checkpoint does not hold: resuming training from it cannot be exact. Resume from a checkpoint saved at"
            " an optimizer step (ModelCheckpoint(every_n_train_steps=...), the end of an epoch, a preemption save), or"
            " make mid-epoch validation fall on steps (val_check_interval a multiple of accumulate_grad_batches);"
            " validate/test/predict and `checkpoint export` read this checkpoint as it is.")


@dataclass
class PendingResume:
    """What a loaded checkpoint still has to restore once training starts."""

    epoch_samples_consumed: int
    global_batch_size: Optional[int]
    rng_state: Optional[dict[str, Any]]


class StrategyCheckpoints:
    """The checkpoint protocol behind `UlyssesDeepSpeedStrategy`'s `save_checkpoint`, `load_checkpoint`,
    `load_model_state_dict`, `process_dataloader` and `on_train_batch_start`, and the resume state between them.

    `strategy` is the `UlyssesDeepSpeedStrategy` (its ranks, groups, config and trainer), `random_streams` the
    random streams its steps draw from; the parent `DeepSpeedStrategy`'s own save and load are passed in by the hooks
    as `write` and `load`. `quiet`: Lightning's warning that a resume in the middle of an epoch is unreliable is
    hidden where this resume is exact (see `process_dataloader`).
    """

    def __init__(self, strategy: Any, random_streams: Optional[SequenceParallelRNG] = None,
                 quiet: bool = False) -> None:
        self.strategy = strategy
        self.random_streams = random_streams if random_streams is not None else SequenceParallelRNG()
        self.resume: Optional[PendingResume] = None
        # Lightning warns at the start of every resumed epoch loop whose step count is not a whole number of epochs and
        # whose dataloader has no `state_dict` (`training_epoch_loop.py`), between `process_dataloader` and the first
        # batch: suspended there when the data continues exactly.
        self._not_resumable = console.SuspendedWarning(console.NOT_RESUMABLE[1], PossibleUserWarning) if quiet else None
        self.data_epoch: Optional[int] = None  # the epoch the last training batch came from (see `resumable_loops`)
        self._load_consolidated_weights = False  # see `load`

    @property
    def trainer(self):
        return self.strategy.lightning_module.trainer

    # -- save -------------------------------------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any],
             write: Callable[[dict[str, Any], Any, Optional[Any]], None], hf_model_configs: Mapping[str, Any]) -> None:
        """Atomic: every rank writes into `<path>.partial`; rank 0 renames it to `<path>` once all have finished."""
        strategy = self.strategy
        path = Path(strategy.broadcast(str(filepath)))
        if strategy.is_global_zero:
            prepare_staging(path)
        strategy.barrier("lightning_ulysses.integration.checkpoint.staging")
        staging = staging_path(path)
        if "loops" in checkpoint:
            checkpoint = {**checkpoint, "loops": self.resumable_loops(checkpoint["loops"])}
        write(checkpoint, staging, storage_options)
        save_rng_state(staging, strategy.global_rank, self.random_streams)
        if strategy.is_global_zero:
            save_hf_configs(staging, hf_model_configs, strategy.lightning_module)
        strategy.barrier("lightning_ulysses.integration.checkpoint.written")
        if strategy.is_global_zero:
            commit(path, self.manifest(hf_model_configs))
        strategy.barrier("lightning_ulysses.integration.checkpoint.committed")

    def manifest(self, hf_model_configs: Mapping[str, Any]) -> CheckpointManifest:
        groups = self.strategy.parallel_groups
        return CheckpointManifest(
            world_size=self.strategy.world_size,
            sequence_parallel_size=groups.sequence_parallel_world_size,
            data_parallel_size=groups.data_parallel_world_size,
            zero_stage=self.strategy.run_spec.zero_stage,
            epoch_samples_consumed=self.epoch_samples_consumed(),
            global_batch_size=self.global_batch_size(),
            micro_batches_accumulated=self.strategy.micro_batches_accumulated,
            hf_models=tuple(hf_model_configs),
            global_step=self.trainer.global_step,
        )

    def global_batch_size(self) -> Optional[int]:
        batch_size = getattr(self.trainer.train_dataloader, "batch_size", None)
        return None if batch_size is None else batch_size * self.strategy.parallel_groups.data_parallel_world_size

    def epoch_position(self) -> tuple[int, bool]:
        """Batches of the current epoch trained on so far, and whether that epoch's data is used up."""
        done, is_last_batch = lightning_private.epoch_batch_progress(self.trainer)
        return done, is_last_batch or done >= self.trainer.num_training_batches

    def epoch_samples_consumed(self) -> int:
        """Samples of the current epoch trained on so far, over all DP ranks (0 between epochs)."""
        done, used_up = self.epoch_position()
        if used_up or not done:
            return 0
        global_batch = self.global_batch_size()
        if global_batch is None:  # a custom batch sampler: positions cannot be counted in samples
            return -1
        return done * global_batch

    def resumable_loops(self, loops: dict[str, Any]) -> dict[str, Any]:
        """Lightning's loop state as the uninterrupted run had it at this data position, so that a resume continues
        on the same epoch's sampler permutation with the same epoch counters.

        Lightning counts an epoch as processed (and, after `fit`, completed) as soon as its epoch loop ends, also
        when `max_steps` ends it inside the epoch; a resume then sets the sampler to the next epoch and calls the
        rest of the old one's batches part of it. And a checkpoint whose epoch ran to its end resumes with the
        batch counter at the end of that epoch: with `max_steps` (which makes Lightning treat every resume as a
        restart) it trains one batch of the next epoch and ends that epoch there. Both are rewritten to the
        state between the same two steps of an uninterrupted run: the epoch in progress, or the next one not yet
        begun. A save inside a batch hook (ModelCheckpoint every n steps, a callback) comes before Lightning counts
        the epoch and resumes correctly as it is; in mid-epoch its epoch counters are written out consistently
        too (after some of Lightning's own restarts, `ready` lags `processed` by one)."""
        fit = loops.get("fit_loop")
        epoch = self.data_epoch
        if fit is None or epoch is None:  # nothing trained since this process started (or loaded) the run
            return loops
        epochs_key, batches_key = lightning_private.FIT_LOOP_EPOCH_PROGRESS, lightning_private.FIT_LOOP_BATCH_PROGRESS
        counters = lightning_private.PROGRESS_COUNTERS
        done, used_up = self.epoch_position()
        counted = fit[epochs_key]["current"]["processed"] > epoch  # Lightning has counted the data's epoch
        if used_up and counted:
            epochs = dict.fromkeys(counters, epoch + 1)
            batches = {**fit[batches_key], "is_last_batch": False, "current": dict.fromkeys(counters, 0)}
        elif done and not used_up:
            epochs = {"ready": epoch + 1, "started": epoch + 1, "processed": epoch, "completed": epoch}
            batches = fit[batches_key]
        else:
            return loops
        fit = {**fit, epochs_key: {"total": dict(epochs), "current": dict(epochs)}, batches_key: batches}
        return {**loops, "fit_loop": fit}

    # -- load -------------------------------------------------------------------------------------------------------
    def load(self, checkpoint_path: Any, load: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """Refuse interrupted saves and other world sizes, keep what a resume must restore later, and load
        (`load`: the parent's `load_checkpoint`), or consolidate ZeRO-3 shards for an evaluation."""
        strategy = self.strategy
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        manifest = None
        if os.path.isdir(checkpoint_path) or not os.path.exists(checkpoint_path):
            path = resolve_checkpoint(Path(checkpoint_path))  # refuses interrupted saves
            manifest = read_manifest(path)
            if manifest is not None and manifest.world_size != strategy.world_size:
                raise ValueError(
                    f"{path} was written by {manifest.world_size} ranks (SP {manifest.sequence_parallel_size} × DP"
                    f" {manifest.data_parallel_size}) and this run has {strategy.world_size}: ZeRO shards are cut per"
                    f" rank. Resume with {manifest.world_size} ranks (any SP × DP split works), or export the weights"
                    f" with `python -m lightning_ulysses checkpoint export {path} <folder>` and start a new run from"
                    " them."
                )
            checkpoint_path = str(path)
        if fitting and manifest is not None:
            _refuse_resume_inside_window(path, manifest)
            same_layout = manifest.sequence_parallel_size == strategy.sequence_parallel_world_size
            self.resume = PendingResume(
                epoch_samples_consumed=manifest.epoch_samples_consumed,
                global_batch_size=manifest.global_batch_size,
                # Each rank's generators continue where they were; at another split ranks play other roles.
                rng_state=load_rng_state(Path(checkpoint_path), strategy.global_rank) if same_layout else None,
            )
        if fitting or not strategy.zero_stage_3 or strategy.load_full_weights or not os.path.isdir(checkpoint_path):
            return load(checkpoint_path)
        return self._load_consolidated(Path(checkpoint_path))

    def _load_consolidated(self, path: Path) -> dict[str, Any]:
        """validate/test/predict(ckpt_path=<ZeRO-3 checkpoint>): DeepSpeed 0.19 cannot load a ZeRO-3 checkpoint
        into an engine without optimizer (it calls `_restore_from_bit16_weights` on `DeepSpeedZeRoOffload`).
        Consolidate the fp32 weights from the shards instead; `load_model_state_dict` then lets Lightning's
        full-weights path copy them into the partitioned parameters, module by module."""
        # Lightning's own entries (epoch, callbacks, ...) are saved as DeepSpeed client state in every model-state file.
        states = path / deepspeed_tag(path) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        checkpoint = torch.load(states, map_location="cpu", weights_only=False)
        # Only global rank 0 reads the weights (`_restore_zero_state` copies them in from rank 0 alone): one full
        # fp32 copy of the model in host memory, not one per rank.
        checkpoint["state_dict"] = consolidated_state_dict(path) if self.strategy.is_global_zero else {}
        self._load_consolidated_weights = True
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool) -> bool:
        """Copy consolidated weights (see `_load_consolidated`) in; False: not ours, the parent's hook loads."""
        if not self._load_consolidated_weights:
            return False
        self._load_consolidated_weights = False
        self.strategy.model_to_device()
        lightning_private.restore_zero_state(self.strategy, checkpoint, strict)
        return True

    # -- resume -----------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        """After a resume in the middle of an epoch, skip the samples that epoch already trained on; at an epoch
        boundary, restore the random generators here. Where the sampler's order is one a new process repeats, the
        data then continues exactly, and Lightning's warning that it may not is suspended until the first batch."""
        resume = self.resume
        if resume is None or self.trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if resume.epoch_samples_consumed == 0:
            # Between an epoch's last step and the next one, the uninterrupted run drew from the global generator
            # for the new epoch's data loader iterator (its base seed); Lightning creates that iterator right after
            # this call, so the generators continue from here, not from the first batch.
            if resume.rng_state is not None:
                self.random_streams.restore(resume.rng_state)
                resume.rng_state = None
            self._continues_exactly(dataloader)
            return dataloader
        # An iterable dataset's DataLoader has a sampler too (torch's placeholder), which it never draws from.
        if (resume.epoch_samples_consumed < 0 or not isinstance(dataloader, DataLoader) or dataloader.sampler is None
                or isinstance(dataloader.dataset, IterableDataset)):
            rank_zero_warn("The checkpoint's position inside its epoch cannot be restored for this dataloader (a"
                           " custom batch sampler or an iterable dataset): the epoch's data restarts from its beginning.")
            return dataloader
        data_parallel_size = self.strategy.parallel_groups.data_parallel_world_size
        sampler = ResumableSampler(dataloader.sampler, data_parallel_size)
        global_batch = None if dataloader.batch_size is None else dataloader.batch_size * data_parallel_size
        # Raises before any collective (every rank has the same manifest and loader) if the position cannot continue.
        sampler.skip_once(resume.epoch_samples_consumed, resume.global_batch_size, global_batch)
        resume.epoch_samples_consumed = 0
        self._continues_exactly(dataloader)
        return lightning_private.update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)

    def _continues_exactly(self, dataloader: object) -> None:
        """Suspend Lightning's "not resumable" warning when the epoch's sample order is one a new process repeats:
        set by seed and epoch (`DistributedSampler`, which Lightning puts in by default) or fixed
        (`SequentialSampler`). Any other sampler (e.g. a `RandomSampler` drawing its order from the global generator
        when its iterator is made) may not repeat it, and the warning stays."""
        sampler = getattr(dataloader, "sampler", None)
        if self._not_resumable is not None and isinstance(sampler, (DistributedSampler, SequentialSampler)):
            self._not_resumable.suspend()

    def end_resume(self) -> None:
        """Lightning's "not resumable" warning back in force (at the first batch after a resume and at teardown)."""
        if self._not_resumable is not None:
            self._not_resumable.resume()

    def on_train_batch_start(self) -> None:
        self.end_resume()  # Lightning's check ran when the epoch loop started
        # Mid-epoch, restored here, not at load: the dataloader and anything between load and the first step would
        # otherwise consume random numbers the uninterrupted run did not (at an epoch boundary: process_dataloader).
        if self.resume is not None:
            if self.resume.rng_state is not None:
                self.random_streams.restore(self.resume.rng_state)
            self.resume = None
        # Lightning set the sampler's epoch from this counter when the epoch began; it stays until the epoch loop
        # ends (a checkpoint needs it after that, see `resumable_loops`).
        self.data_epoch = lightning_private.epochs_processed(self.trainer)


# -- command line ------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ulysses checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="check a checkpoint is complete and print what wrote it")
    inspect.add_argument("checkpoint", type=Path)
    exporter = commands.add_parser(
        "export", help="write the consolidated state dict (model.pt) and the Hugging Face model as the recipes'"
                       " export does: a save_pretrained folder in OUTPUT itself (LoRA: OUTPUT/adapter, and"
                       " OUTPUT/merged with --merged); several models: one folder each, OUTPUT/<module path>"
    )
    exporter.add_argument("checkpoint", type=Path)
    exporter.add_argument("output", type=Path)
    exporter.add_argument("--hf-model", default=None, help="only this Hugging Face model (its module path)")
    exporter.add_argument("--merged", action="store_true",
                          help="for a LoRA model, also write its (active) adapters merged into the base weights"
                               " (merged/)")
    exporter.add_argument("--tokenizer", default=None,
                          help="a tokenizer (folder or Hub name) to save beside the weights of every folder written")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            path = resolve_checkpoint(args.checkpoint)
            manifest = read_manifest(path)
            print(json.dumps({"path": str(path), **(asdict(manifest) if manifest else {"manifest": None})}, indent=2))
        else:
            for written in export(args.checkpoint, args.output, args.hf_model, args.merged, args.tokenizer):
                print(f"wrote {written}")
    except (IncompleteCheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
