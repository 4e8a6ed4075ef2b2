"""Pretrained Hugging Face models loaded in `configure_model` under ZeRO-3, straight into the partitions.

Lightning builds the model of `configure_model` inside `deepspeed.zero.Init` under ZeRO-3 (its
`model_sharded_context`), so every parameter is partitioned the moment it is created. A plain `from_pretrained`
builds on the meta device and copies whole checkpoint tensors into those empty partitions: transformers raises
"You set `ignore_mismatched_sizes` to `False`". transformers has a ZeRO-3 loading path of its own
(`modeling_utils` + `integrations/deepspeed.py: _load_state_dict_into_zero3_model`), taken only while
`is_deepspeed_zero3_enabled()`, i.e. while an `HfDeepSpeedConfig` of a ZeRO-3 config is alive. `zero3_loading`
keeps one alive around `configure_model` (the strategy's `model_sharded_context`), and nowhere else.

What transformers then does, verified by reading it (5.24) and by the parity tests: it builds the model in a
nested `deepspeed.zero.Init` (a no-op inside Lightning's: the outer context's settings apply); global rank 0 reads
the checkpoint files to host memory, the other ranks only their keys and shapes (meta tensors); module by module,
`GatheredParameters(modifier_rank=0)` gathers that module's partitions, rank 0 copies the checkpoint values in,
and the exit re-partitions them (a broadcast from rank 0); buffers are broadcast from rank 0; the keys the
checkpoint lacks are initialised on rank 0 and scattered the same way; tied weights are tied afterwards; its
checkpoint conversions (renamed keys, fused MoE experts) apply as in a plain load. Host memory: one full state
dict on global rank 0 only (the others hold none), plus one module's whole parameters on every rank at a time.

Why this rather than a load and scatter of our own: it is the same algorithm (rank 0 reads, one module gathered
at a time), and transformers' copy also knows its checkpoint formats, tying and missing-key initialisation, which
a copy here would have to follow release by release. Reading each rank's partition straight from sharded
safetensors would keep less on rank 0, but ZeRO-3 partitions are flat slices across tensor boundaries, and the
checkpoint conversions work on whole tensors.

ZeRO 0/1/2 build the model unpartitioned (no `zero.Init`): `from_pretrained` in `configure_model` is a plain
load on every rank (every rank holds the whole model anyway), and this module does nothing.

FSDP2 (`UlyssesFSDPStrategy`, `ShardedPretrainedLoads`): FSDP2 shards every parameter by rows (`Shard(0)`, torch.chunk's
split), so a rank's shard *is* a contiguous slice of each checkpoint tensor. While `configure_model` runs,
`from_pretrained` builds the model on the meta device as usual, but reads no tensor (its one reading step is
replaced: `fences/_transformers_private.py`); transformers still finalises the model (non-persistent buffers such
as RoPE's `inv_freq` computed, tied weights tied). After the strategy's `fully_shard`, each rank allocates its shards
(`to_empty`) and reads only their slices through torch Distributed Checkpoint's public Hugging Face reader
(`torch.distributed.checkpoint.HuggingFaceStorageReader`: `safe_open(...).get_slice(key)[rows]` per shard).
Only checkpoints whose tensors are the model's own, by name and shape, are read so (transformers' conversions,
such as per-expert MoE tensors fused on load, work on whole tensors); any other is loaded whole on every rank as
before, decided from the file headers alone, identically on every rank.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch

from lightning_ulysses.fences import _transformers_private as transformers_private


@contextlib.contextmanager
def zero3_loading(config: Optional[Mapping[str, Any]]) -> Iterator[None]:
    """Within this context, transformers sees DeepSpeed ZeRO-3 as enabled (`is_deepspeed_zero3_enabled()`), so that
    `from_pretrained` / `from_config` build and load into partitioned parameters. `config`: the DeepSpeed config
    the strategy builds the model under, or None (not ZeRO-3: nothing to do).

    A config a user registered themselves (their own live `HfDeepSpeedConfig`) is left as it is.
    """
    if config is None:
        yield
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    if hf_deepspeed.deepspeed_config() is not None:  # the user's own HfDeepSpeedConfig: theirs to manage
        yield
        return
    # Registered as a weak reference by its constructor: it counts only while this frame holds it.
    registered = hf_deepspeed.HfDeepSpeedConfig(dict(config))
    try:
        yield
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
        del registered


def transformers_initialises_partitioned_weights() -> bool:
    """Whether transformers initialises the weights of a model it builds partitioned (`from_config` under
    `zero3_loading`: `initialize_weights_zero3`), so that the recipes' own re-initialisation is not needed."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


# -- FSDP2: each rank reads its own shards ------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of a checkpoint, where the model holds it: `getattr(module, name)` (a parameter or a persistent
    buffer). Modules are kept, not parameter objects: `fully_shard` replaces the parameters, peft keeps the module
    it adapts (as `base_layer`)."""

    module: torch.nn.Module
    name: str
    key: str  # the checkpoint's (safetensors) key


@dataclass(repr=False)
class PendingLoad:
    """A model `from_pretrained` built on the meta device, and what to read into it once it is sharded."""

    model: torch.nn.Module
    folder: str
    tensors: list[CheckpointTensor]
    tied_keys: frozenset[str] = frozenset()  # names the files lack, which transformers ties to another

    def unfilled_parameters(self) -> list[str]:
        """The model's parameters still on the meta device that the checkpoint does not fill (created after
        `from_pretrained`, e.g. LoRA adapters: they would hold no values). Before sharding: tied weights are one
        parameter object by then."""
        filled = {id(getattr(tensor.module, tensor.name)) for tensor in self.tensors}
        return [name for name, parameter in self.model.named_parameters(remove_duplicate=False)
                if parameter.is_meta and id(parameter) not in filled]

    def read_shards(self, device: torch.device) -> None:
        """Allocate the model's tensors on `device` (each rank its DTensor shards) and read each shard's slice of
        the checkpoint (collective: every rank, in the same order). Tensors that already hold values keep them
        (non-persistent buffers transformers computed, such as RoPE's `inv_freq`; adapters `models.lora` made)."""
        import torch.distributed.checkpoint as dcp

        computed = {name: _local(tensor).clone() for name, tensor in _tensors(self.model) if not tensor.is_meta}
        shared = _shared_parameters(self.model)
        self.model.to_empty(device=device)  # FSDP2: on the unit's root, the shards (torchtitan's meta-device init)
        for names in shared:  # `Module.to_empty` gives each name its own tensor (FSDP2's one parameter stays one)
            first = self.model.get_parameter(names[0])
            for name in names[1:]:
                module_path, _, attribute = name.rpartition(".")
                if self.model.get_parameter(name) is not first:
                    setattr(self.model.get_submodule(module_path), attribute, first)
        with torch.no_grad():
            for name, tensor in _tensors(self.model):
                if name in computed:
                    _local(tensor).copy_(computed[name])
        state = {tensor.key: getattr(tensor.module, tensor.name) for tensor in self.tensors}
        # In place into each DTensor's local shard; every key must be in the files (no partial load).
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(self.folder))


def _tensors(model: torch.nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter held under several (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


class ShardedPretrainedLoads:
    """`from_pretrained` in `configure_model` under the FSDP2 strategy: built on the meta device there (`deferring`,
    the strategy's `model_sharded_context`), each rank's shards read after `fully_shard` (`read_shards`). See the
    module docstring. The strategy holds one; nothing here is process-global outside `deferring`."""

    def __init__(self) -> None:
        self.pending: list[PendingLoad] = []

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        with transformers_private.pretrained_load_replaced(self._load_or_defer):
            yield

    def _load_or_defer(self, load, model, state_dict, checkpoint_files, load_config, *args: Any, **kwargs: Any):
        pending = None
        if state_dict is None and not args and not kwargs and transformers_private.reads_plain_weights(load_config):
            pending = readable_by_shards(model, checkpoint_files or ())
        if pending is None:
            return load(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        self.pending.append(pending)
        # Where transformers would have put the tensors (no device map: the host); `kernelize` refuses "meta".
        transformers_private.kernelize_for(model, "cpu")
        return transformers_private.nothing_loaded(pending.tied_keys)

    def check(self) -> None:
        """Before sharding (no collective; the same on every rank): refuse a deferred model that gained parameters
        on the meta device after `from_pretrained` (no values would reach them)."""
        for pending in self.pending:
            unfilled = pending.unfilled_parameters()
            if unfilled:
                raise ValueError(
                    f"Under the FSDP2 strategy, from_pretrained in configure_model builds {type(pending.model).__name__}"
                    f" on the meta device and each rank reads its shards of the checkpoint after sharding; parameters"
                    f" added to it on the meta device after from_pretrained have no values to read:"
                    f" {unfilled[:3]}{' ...' if len(unfilled) > 3 else ''}. For LoRA adapters use"
                    " lightning_ulysses.models.lora.with_lora / add_adapter (they give the adapters peft's initial"
                    " values on the host); otherwise create them on a real device (`with torch.device('cpu'):`), or"
                    " load the model in the LightningModule's __init__.")

    def read_shards(self, device: torch.device) -> None:
        pending, self.pending = self.pending, []
        for load in pending:
            load.read_shards(device)


def readable_by_shards(model: torch.nn.Module, checkpoint_files: Sequence[str]) -> Optional[PendingLoad]:
    """The `PendingLoad` of `model` (built on the meta device) from `checkpoint_files`, when each rank can read its
    shards straight from them: a distributed run, safetensors files that are all those of one folder, whose keys and
    shapes are exactly the model's parameters and persistent buffers (tied ones once). None otherwise (read from the
    headers only, so every rank decides alike): transformers then loads as usual."""
    import torch.distributed as dist
    from safetensors import safe_open

    # (not resolving links: a Hub cache's snapshot folder holds links to its blobs, which the reader lists by name)
    files = [os.path.abspath(file) for file in checkpoint_files]
    if not files or not dist.is_initialized() or not all(file.endswith(".safetensors") for file in files):
        return None
    folder = os.path.dirname(files[0])
    in_folder = {os.path.join(folder, name) for name in os.listdir(folder)
                 if name.endswith(".safetensors")}
    if in_folder != set(files):
        return None
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    # Parameters and persistent buffers. Tied weights are not tied yet (transformers ties them after loading): a
    # name the files lack must be one transformers ties to another (`all_tied_weights_keys`: tied name -> source).
    state = model.state_dict(keep_vars=True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    if not all(tensor.is_meta for tensor in state.values()) or not set(shapes) <= set(state):
        return None
    if any(shapes[key] != tuple(state[key].shape) for key in shapes) or not set(state) - set(shapes) <= tied:
        return None
    tensors = []
    for key in shapes:
        module_path, _, attribute = key.rpartition(".")
        tensors.append(CheckpointTensor(model.get_submodule(module_path), attribute, key))
    return PendingLoad(model, folder, tensors, frozenset(set(state) - set(shapes)))


# A Hugging Face Hub name: `name` or `namespace/name` (letters, digits, `_`, `-`, `.`), the form transformers accepts.
_HUB_NAME = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")
MAKE_AN_EXAMPLE = ("To try the recipes without a model of your own, `python -m lightning_ulysses example-finetune"
                   " <folder>` writes a tiny one with data files, offline, and prints the command that fine-tunes it.")


def check_pretrained_folder(pretrained: str, setting: str = "pretrained") -> None:
    """Refuse, naming the path, a model folder that does not exist or is not one `save_pretrained` wrote (no
    `config.json`), before transformers reads it as a Hub name ("Repo id must be in the form ..."). A name that can
    only be a Hub name (`name` or `namespace/name`, not an existing path) is left to transformers. `setting` names the
    option in the messages (the recipes': `model.pretrained`)."""
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{setting}={pretrained}: {path.resolve()} holds no config.json, so it is not a model folder"
                f" `save_pretrained` wrote (config.json, weights, tokenizer). {MAKE_AN_EXAMPLE}")
        return
    if path.exists():
        raise NotADirectoryError(f"{setting}={pretrained}: {path.resolve()} is a file; name the model's folder (the"
                                 f" one holding config.json and the weights). {MAKE_AN_EXAMPLE}")
    first = Path(pretrained.split("/")[0]).expanduser()
    if not _HUB_NAME.fullmatch(pretrained) or ".." in pretrained or first.is_dir():
        raise FileNotFoundError(f"{setting}={pretrained}: the folder {path.resolve()} does not exist. Name a model"
                                f" folder `save_pretrained` wrote (config.json, weights, tokenizer). {MAKE_AN_EXAMPLE}")
