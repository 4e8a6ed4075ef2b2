"""`python -m lightning_ulysses checkpoint {inspect,export} ...`: check a checkpoint; export its weights and Hugging
Face folders.

`export <ckpt> <folder>` writes the folders the recipes' `export.enabled` writes, into `<folder>` itself for one model;
`--merged` also writes a LoRA model's adapters merged into its base weights, `--tokenizer` saves a tokenizer beside
the weights. It reads only what the checkpoint holds (`protocol`: the ZeRO shards, the recorded configs and
adapters), not the training code, and works at any number of ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch

from lightning_ulysses.integration.checkpoint.protocol import (ADAPTER_CONFIG, ADAPTERS, IncompleteCheckpointError,
                                                               consolidated_state_dict, read_adapters, read_manifest,
                                                               resolve_checkpoint)
from lightning_ulysses.integration.export import PEFT_BASE, PeftAdapters, save_pretrained_folders


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
