"""The trained model as a `save_pretrained` folder at the end of training, loadable without the training code.

`ExportPretrained(directory)` (a Callback; the recipes add it with `export.enabled=true`) writes, once `fit` has
trained: for a Hugging Face model, `directory/` with its weights, config and (from `tokenizer`) tokenizer, which
`AutoModelForCausalLM.from_pretrained(directory)` loads with the trained model's logits; for a PEFT LoRA model,
`directory/adapter/` (peft's adapter folder: `PeftModel.from_pretrained(base, directory/adapter)`) and, with
`merged=True`, `directory/merged/` (the adapters merged into the base weights by peft's `merge_and_unload`, a plain
model folder). `python -m lightning_ulysses checkpoint export` writes the same folders from a checkpoint (through
`save_pretrained_folders`; a LoRA model's adapter configs are saved with every checkpoint, see `adapter_configs`).

A PEFT model with several adapters (`add_adapter`) gets them all in `adapter/`, in the layout peft's own
`save_pretrained` writes: the adapter named `default` at the root, every other in `adapter/<name>/`
(`PeftModel.from_pretrained(base, directory/adapter)`, then `load_adapter(directory/adapter/<name>,
adapter_name=<name>)` for each other). `merged/` holds the base with the *active* adapters merged in (peft's
`active_adapters`: what the trained model's forward applies, so `merged/` computes the trained model's logits;
`merge_and_unload` merges those too); the inactive ones are left out of it, with a warning that names them and how to
merge one (load the adapter folders, `merge_and_unload(adapter_names=[...])`).

Under ZeRO-3 each rank holds a partition of every parameter: DeepSpeed's own consolidation for `save_16bit_model`
(`_deepspeed_private.consolidated_16bit_state_dict`, a collective: one module gathered at a time, copied to global
rank 0's host memory) gives the whole state dict; global rank 0 then fills a model built on the meta device with it
(no second copy of the weights) and saves. The values are the module's weights (the Trainer's precision), not
DeepSpeed's fp32 master copies: what the trained model computes with. The config saved is the one the model was built
with (the strategy swaps in a copy with Ulysses attention while it trains).
"""

from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.fences import _transformers_private as transformers_private

# Where a `PeftModel` keeps the model it adapts (`peft_model.base_model.model`): the PEFT model's state-dict keys are
# that model's (adapted layers included) under this prefix.
PEFT_BASE = "base_model.model"
# The name peft gives a model's first adapter, and the only one its `save_pretrained` writes at the folder's root.
DEFAULT_ADAPTER = "default"


@dataclass(frozen=True)
class PeftAdapters:
    """The LoRA adapters of a `PeftModel`: each one's config (a peft `LoraConfig`) by adapter name, in the order peft
    added them, and the names of the active ones (peft's `active_adapters`: those its forward applies, in the order it
    applies them, which `merge_and_unload` merges)."""

    configs: Mapping[str, Any]
    active: tuple[str, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "PeftAdapters":
        # `active_adapters`, not `active_adapter`: after `base_model.set_adapter([...])` (several active adapters)
        # the latter still names the adapter that was active before.
        return cls(dict(model.peft_config), tuple(model.active_adapters))


class ExportPretrained(pl.Callback):
    """Args:
        directory: the folder to write (created; existing files are overwritten).
        merged: for a LoRA model, also write the merged full model to `directory/merged` (with several adapters: the
            active ones merged, see the module docstring).
        tokenizer: a folder (or Hub name) whose tokenizer is saved beside the weights; None: none is saved.
    """

    def __init__(self, directory: str, merged: bool = False, tokenizer: Optional[str] = None) -> None:
        self.directory, self.merged, self.tokenizer = Path(directory), merged, tokenizer

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # While the training engine exists: under ZeRO-3 its consolidation is what gathers the partitions.
        name, model = _exported_model(pl_module)
        state = _whole_state_dict(trainer, pl_module)
        if trainer.is_global_zero:
            weights = {key[len(name) + 1:]: value for key, value in state.items() if key.startswith(f"{name}.")}
            save_pretrained_folders(_built_config(trainer, model, name), weights, self.directory,
                                    lora=_peft_adapters(model), merged=self.merged, tokenizer=self.tokenizer)
        trainer.strategy.barrier("lightning_ulysses.integration.export")


def save_pretrained_folders(config: Any, weights: Mapping[str, torch.Tensor], directory: Path, lora: Any = None,
                            merged: bool = False, tokenizer: Optional[str] = None) -> list[Path]:
    """The `save_pretrained` folder(s) (see the module docstring) of the causal LM of `config` with the whole
    `weights` (its `state_dict`; with `lora`, the `PeftModel`'s: `lora` is its `PeftAdapters`, or one peft `LoraConfig`
    for a model with the single adapter `default`). Returns the folders written (for a LoRA model `adapter/` and, with
    `merged`, `merged/`; any adapter but `default` is in a subfolder of `adapter/`)."""
    if lora is not None:
        adapters = lora if isinstance(lora, PeftAdapters) else PeftAdapters({DEFAULT_ADAPTER: lora}, (DEFAULT_ADAPTER,))
        plain = _meta_peft_model(config, adapters)
        _assign(plain, weights)
        folders = [directory / "adapter"]
        # Every adapter, in peft's own layout for several (`default` at the root, the others in subfolders).
        plain.save_pretrained(folders[0], save_embedding_layers=False)
        if merged:
            _warn_inactive_adapters_not_merged(adapters, directory / "merged")
            # peft merges into the adapted layers' weights in place; `weights` may be the live model's own tensors.
            for layer in plain.modules():
                if hasattr(layer, "base_layer") and hasattr(layer.base_layer, "weight"):
                    layer.base_layer.weight = torch.nn.Parameter(layer.base_layer.weight.detach().clone(),
                                                                 requires_grad=False)
            folders.append(directory / "merged")
            plain.merge_and_unload().save_pretrained(folders[1])
    else:
        plain = _meta_model(config)
        _assign(plain, weights)
        folders = [directory]
        plain.save_pretrained(directory)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        saved = AutoTokenizer.from_pretrained(tokenizer)
        for folder in folders:
            saved.save_pretrained(folder)
    return folders


def _meta_peft_model(config: Any, adapters: PeftAdapters) -> torch.nn.Module:
    """The `PeftModel` with `adapters` (the active ones active) on the causal LM of `config`, on the meta device."""
    from peft import get_peft_model

    # Copies: peft writes into the configs it is given (`get_peft_model` sets `base_model_name_or_path`, and
    # `save_pretrained` fills it in and flips `inference_mode`), and these may be the trained model's own.
    (first, first_config), *others = adapters.configs.items()
    with torch.device("meta"):
        model = get_peft_model(_meta_model(config), copy.deepcopy(first_config), adapter_name=first)
        for name, lora in others:
            model.add_adapter(name, copy.deepcopy(lora))
    # `add_adapter` leaves the first adapter the only active one; `merge_and_unload` merges the active ones.
    model.base_model.set_adapter(list(adapters.active))
    return model


def _warn_inactive_adapters_not_merged(adapters: PeftAdapters, folder: Path) -> None:
    inactive = [name for name in adapters.configs if name not in adapters.active]
    if inactive:
        warnings.warn(
            f"{folder} holds the base weights with the active LoRA adapter(s) {list(adapters.active)} merged in (what"
            f" the trained model computes), not the inactive {inactive}. To merge others: load the adapter folder with"
            " `PeftModel.from_pretrained` (and `load_adapter` for each adapter in a subfolder), then"
            " `merge_and_unload(adapter_names=[...])`.", stacklevel=3)


def _meta_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _assign(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Fill a meta-device model with `weights` (the tensors themselves, no copy); only tied weights may be missing
    (e.g. lm_head = embeddings, stored once)."""
    missing, unexpected = model.load_state_dict(dict(weights), strict=False, assign=True)
    untied = {key for key in missing if not _is_tied(model, key)}
    if untied or unexpected:
        raise ValueError(f"the trained weights do not match the model: missing {sorted(untied)}, unexpected"
                         f" {sorted(unexpected)}.")
    model.tie_weights()


def _is_tied(model, key: str) -> bool:
    tied = transformers_private.tied_weights_keys(model) or {}
    keys = tied.keys() if isinstance(tied, Mapping) else tied
    return any(key == pattern or key.endswith(pattern) for pattern in keys)


def adapter_configs(root: torch.nn.Module) -> dict[str, PeftAdapters]:
    """Module path of every model a `PeftModel` in `root` adapts (`<PEFT model's path>.base_model.model`: the Hugging
    Face model the strategy prepares and records) → that PEFT model's adapters (every adapter's `LoraConfig`, and which
    are active). Empty while peft was never imported: no PEFT model can exist then (peft is not a dependency)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return {}
    return {f"{name}.{PEFT_BASE}" if name else PEFT_BASE: PeftAdapters.of(module)
            for name, module in root.named_modules() if isinstance(module, peft.PeftModel)}


def _peft_adapters(model: torch.nn.Module) -> Optional[PeftAdapters]:
    from peft import PeftModel

    return PeftAdapters.of(model) if isinstance(model, PeftModel) else None


def _exported_model(pl_module: "pl.LightningModule") -> tuple[str, torch.nn.Module]:
    """The one Hugging Face (or PEFT) model of the module, with its module path."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    found, inside = [], set()
    for name, module in pl_module.named_modules():
        if any(name.startswith(f"{outer}.") for outer in inside):
            continue
        if isinstance(module, (PeftModel, PreTrainedModel)):
            found.append((name, module))
            inside.add(name)
    if len(found) != 1:
        raise ValueError(f"ExportPretrained exports one Hugging Face or PEFT model; {type(pl_module).__name__} has"
                         f" {[name for name, _ in found]}.")
    return found[0]


def _whole_state_dict(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Optional[dict[str, torch.Tensor]]:
    """The LightningModule's whole state dict on global rank 0 (None elsewhere under ZeRO-3; on every rank under
    FSDP2)."""
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    if engine is not None and engine.zero_optimization_partition_weights():
        return deepspeed_private.consolidated_16bit_state_dict(engine)  # a collective: every rank calls it
    from torch.distributed.tensor import DTensor

    # FSDP2's shards are gathered (a collective per tensor, in the same order on every rank).
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
            for key, value in pl_module.state_dict().items()}


def _built_config(trainer: "pl.Trainer", model: torch.nn.Module, name: str) -> Any:
    """The config `model` was built with: the strategy records it before swapping in its Ulysses copy."""
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    recorded = getattr(trainer.strategy, "hf_model_configs", {})
    return next((config for path, config in recorded.items() if path == name or path.startswith(f"{name}.")),
                base.config)
