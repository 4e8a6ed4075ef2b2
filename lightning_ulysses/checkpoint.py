"""Checkpoints that survive interruption, resume exactly, resume at another SP/DP layout, and export.

A checkpoint is DeepSpeed's directory (one shard file per rank) plus what this module adds to it:

- `ulysses.json`, the manifest: written last, by global rank 0, once every rank has finished writing. A
  directory without it is an interrupted save and is refused on load.
- `rng/rank_<r>.pt`: every rank's random-number-generator states (dropout differs per rank), restored at the
  first training batch after a resume.
- `hf/<module path>/config.json`: the config of every Hugging Face model in the LightningModule, so `export`
  can write a `save_pretrained` directory without the training code.

Saves are atomic: ranks write into `<path>.partial`; rank 0 then moves a previous checkpoint at `<path>` aside
to `<path>.previous`, renames `<path>.partial` to `<path>` and deletes `<path>.previous`. A save interrupted at
any point leaves either the old checkpoint at `<path>` or, during the two renames, a complete one at
`<path>.previous` that `resolve_checkpoint` falls back to. Neither suffix ends in `.ckpt`, so Lightning's
`ckpt_path="last"` never picks them.

ZeRO partitions are laid out over the whole world (global rank order) at every SP/DP split, so a checkpoint
loads unchanged at another split of the same number of ranks; only the data position needs translating
(`ResumableSampler`). A different number of ranks is refused before anything is loaded (the shards are cut per
rank); `export` still recovers the weights from such a checkpoint.

Command line: `python -m lightning_ulysses checkpoint {inspect,export} ...` (see `main`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch.utils.data import Sampler

MANIFEST = "ulysses.json"
FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"
DEEPSPEED_TAG = "checkpoint"  # the tag Lightning's DeepSpeedStrategy saves under


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
def save_rng_state(directory: Path, rank: int) -> None:
    from lightning.fabric.utilities.seed import _collect_rng_states

    (directory / "rng").mkdir(exist_ok=True)
    torch.save(_collect_rng_states(include_cuda=torch.cuda.is_available()), directory / "rng" / f"rank_{rank}.pt")


def load_rng_state(directory: Path, rank: int) -> Optional[dict[str, Any]]:
    path = directory / "rng" / f"rank_{rank}.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


def restore_rng_state(states: Mapping[str, Any]) -> None:
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(dict(states))


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


def export(path: Path, output: Path, hf_model: Optional[str] = None) -> list[Path]:
    """Write `output/model.pt` (the consolidated state dict) and, for every Hugging Face model recorded in the
    checkpoint (or only `hf_model`, a module path like `model`), a `save_pretrained` directory
    `output/<module path>`. Returns the paths written."""
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
        written.append(_export_hf_model(path / "hf" / name, state, name, output / name))
    return written


def _export_hf_model(config_dir: Path, state: Mapping[str, torch.Tensor], name: str, target: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    prefix = f"{name}."
    weights = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    # Tied weights (e.g. lm_head = embeddings) are stored once; anything else missing is a real mismatch.
    tied = {key for key in missing if _is_tied(model, key)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{name}: checkpoint weights do not match the model: missing {sorted(set(missing) - tied)},"
                         f" unexpected {sorted(unexpected)}.")
    model.tie_weights()
    model.save_pretrained(target)
    return target


def _is_tied(model, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    keys = tied.keys() if isinstance(tied, Mapping) else tied
    return any(key == pattern or key.endswith(pattern) for pattern in keys)


def save_hf_configs(directory: Path, configs: Mapping[str, Any]) -> None:
    for name, config in configs.items():
        config.save_pretrained(directory / "hf" / name)


# -- command line ------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ulysses checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="check a checkpoint is complete and print what wrote it")
    inspect.add_argument("checkpoint", type=Path)
    exporter = commands.add_parser(
        "export", help="write the consolidated state dict (model.pt) and save_pretrained folders of HF models"
    )
    exporter.add_argument("checkpoint", type=Path)
    exporter.add_argument("output", type=Path)
    exporter.add_argument("--hf-model", default=None, help="only this Hugging Face model (its module path)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            path = resolve_checkpoint(args.checkpoint)
            manifest = read_manifest(path)
            print(json.dumps({"path": str(path), **(asdict(manifest) if manifest else {"manifest": None})}, indent=2))
        else:
            for written in export(args.checkpoint, args.output, args.hf_model):
                print(f"wrote {written}")
    except (IncompleteCheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
