"""Checkpoints that survive interruption, and what they hold: the files a checkpoint adds to DeepSpeed's and the
atomic commit that makes a directory a checkpoint.

A checkpoint is DeepSpeed's directory (one shard file per rank) plus what this module adds to it:

- `ulysses.json`, the manifest: written last, by global rank 0, once every rank has finished writing. A
  directory without it is an interrupted save and is refused on load.
- `rng/rank_<r>.pt`: every rank's random-number-generator states, the shared stream's and the SP rank's own that
  its steps draw dropout masks from (`lightning_ulysses.integration.rng`), restored at the first training batch
  after a resume.
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
(`resume.ResumableSampler`). A different number of ranks is refused before anything is loaded (the shards are cut
per rank); `command_line.export` still recovers the weights from such a checkpoint. FSDP2's Distributed Checkpoint
(`backend="fsdp2"`) reshards to any number of ranks, and loads at any.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from lightning_ulysses.integration.export import DEFAULT_ADAPTER, PeftAdapters, adapter_configs
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
    # What wrote the shards: "deepspeed" (ZeRO's files under the tag folder) or "fsdp2" (torch Distributed Checkpoint:
    # `.metadata` and one `.distcp` file per rank). Manifests written before the field: DeepSpeed's.
    backend: str = "deepspeed"

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
    """Every rank's shard is there: one optimizer-state file per rank for ZeRO 1-3, model states in any case; for
    FSDP2 (torch Distributed Checkpoint), the metadata and one `.distcp` file per rank."""
    if manifest.backend == "fsdp2":
        files = list(directory.glob("*.distcp"))
        if not (directory / ".metadata").exists() or len(files) < manifest.world_size:
            raise IncompleteCheckpointError(
                f"{directory} is missing Distributed Checkpoint files ({len(files)} of {manifest.world_size} .distcp"
                " files, or its .metadata): its save did not finish. Resume from an earlier checkpoint.")
        return
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
EPOCH_ORDER_KEY = "lightning_ulysses/epoch_order"  # beside the generator states: where the epoch's order was drawn


def save_rng_state(directory: Path, rank: int, streams: SequenceParallelRNG,
                   epoch_order: Optional[Mapping[str, Any]] = None) -> None:
    """This rank's generator states and, when its training sampler draws the epoch's order, the states it drew it
    from (`resume.ResumableSampler.epoch_order`)."""
    (directory / "rng").mkdir(exist_ok=True)
    states = streams.collect()
    if epoch_order is not None:
        states[EPOCH_ORDER_KEY] = dict(epoch_order)
    torch.save(states, directory / "rng" / f"rank_{rank}.pt")


def load_rng_state(directory: Path, rank: int) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
    """What `save_rng_state` wrote: the generator states and the epoch order's (each None where not written)."""
    path = directory / "rng" / f"rank_{rank}.pt"
    if not path.exists():
        return None, None
    states = torch.load(path, weights_only=False)
    return states, states.pop(EPOCH_ORDER_KEY, None)



# -- what a checkpoint records for export ------------------------------------------------------------------------
def deepspeed_tag(path: Path) -> str:
    latest = Path(path) / "latest"
    return latest.read_text().strip() if latest.exists() else DEEPSPEED_TAG


def consolidated_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The LightningModule's full fp32 state dict, assembled from the ZeRO shards of the complete checkpoint at
    `path` (as `resolve_checkpoint` returns it; CPU memory: one model copy), or from its Distributed Checkpoint
    shards (FSDP2: the `state_dict` entry alone, read without a process group; the optimizer state is not read:
    `_distributed_checkpoint_weights`)."""
    manifest = read_manifest(Path(path))
    if manifest is not None and manifest.backend == "fsdp2":
        return _distributed_checkpoint_weights(Path(path))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=deepspeed_tag(path))


# The entry of a Lightning checkpoint that holds the LightningModule's state dict (`ModelParallelStrategy` saves the
# checkpoint dict through Distributed Checkpoint, which names each tensor by its path of keys joined with dots).
STATE_DICT_ENTRY = "state_dict"


def _distributed_checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The `state_dict` entry of the Distributed Checkpoint at `path`, whole, in this process (no process group):
    tensors allocated from the checkpoint's metadata (`FileSystemReader.read_metadata`), then filled by the public
    `torch.distributed.checkpoint.load` (`no_dist=True`), which assembles each tensor from every rank's shards. The
    optimizer state is not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    prefix = f"{STATE_DICT_ENTRY}."
    weights = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
               for key, entry in reader.read_metadata().state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process" (also when told so): it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.load({STATE_DICT_ENTRY: weights}, storage_reader=reader, no_dist=True)
    return weights


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
