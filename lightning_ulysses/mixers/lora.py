"""peft's LoRA layers on the linears of a mixer split by heads.

peft puts an adapted `torch.nn.Linear` inside a layer of its own (`base_layer`), beside two linears per adapter, a
down-projection `lora_A[name]` and an up-projection `lora_B[name]`: `base(x) + lora_B(lora_A(dropout(x))) * scaling`.
Through the split (head_split.py):
- a projection that runs on the shard and is exchanged (`MixerSplit.inputs`, `output`) is called as it is, its
  adapters included: each rank projects its own tokens, as a LoRA attention projection does;
- a linear whose weight the split slices (`MixerSplit.parameters`) is sliced in its parts: along its output
  channels (dimension 0: Mamba's `dt_proj`, Kimi's `g_b_proj`) the base weight's and bias's rows and every
  `lora_B`'s rows (its `lora_A` reads every input channel: whole); along its input channels (dimension 1, a
  `SumOfPartialProducts`: Mamba's `x_proj`) the base weight's columns and every `lora_A`'s columns, `lora_B` whole:
  it is linear, so the partial products still sum to the whole layer's output.

What cannot go through a slice is named by `why_not_split`, and its mixer then runs on whole rows (exact): another
kind of adapter (peft's variants of LoRA among them: DoRA normalises the whole weight's rows), a `lora_B` bias on
a partial product (it would be added once per rank), and dropout before a linear sliced by its output channels
(its input is the same on every rank, and each rank would draw its own mask: the whole layer draws one).
"""

from __future__ import annotations

import dataclasses

import torch


def base_linear(module: torch.nn.Module | None) -> torch.nn.Linear | None:
    """`module` if it is a `torch.nn.Linear`, the linear a peft layer adapts, else None: what a family's `matches`
    reads the shape of (whether the split can take the adapter is `why_not_split`'s question)."""
    if module is None:
        return None
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    return base if isinstance(base, torch.nn.Linear) else None


def is_plain_lora(module: torch.nn.Module) -> bool:
    """A peft LoRA layer around a `torch.nn.Linear` whose adapters are all plain LoRA (no variant)."""
    return (isinstance(getattr(module, "base_layer", None), torch.nn.Linear)
            and isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), torch.nn.ModuleDict)
            and all(isinstance(m, torch.nn.Linear) for m in (*module.lora_A.values(), *module.lora_B.values()))
            and not getattr(module, "lora_variant", None)
            and not any(getattr(module, name, None) for name in ("lora_embedding_A", "lora_magnitude_vector")))


def _adapted(module: torch.nn.Module, path: str) -> tuple[str, torch.nn.Module] | None:
    """The (path, module) that holds the parameter at `path` when it is a peft layer, else None."""
    owner_path = path.rpartition(".")[0]
    owner = module.get_submodule(owner_path)
    return (owner_path, owner) if hasattr(owner, "base_layer") else None


def why_not_split(module: torch.nn.Module, split) -> str | None:
    """Why the peft layers among the linears `split` (a `MixerSplit` of `module`) slices cannot be sliced; None when
    they can (or there are none)."""
    for path, (dim, _) in split.parameters.items():
        adapted = _adapted(module, path)
        if adapted is None:
            continue
        owner_path, owner = adapted
        fix = f"leave {owner_path.rpartition('.')[2]!r} out of the adapter's target_modules to split it by heads"
        if not is_plain_lora(owner):
            return (f"the {type(owner).__name__} adapter on its {owner_path}, whose weight the split slices, is not"
                    f" plain LoRA on a linear; {fix}")
        if dim == 0 and any(isinstance(d, torch.nn.Dropout) and d.p > 0 for d in owner.lora_dropout.values()):
            return (f"LoRA dropout on its {owner_path}, whose input every rank holds whole, would draw a mask per rank;"
                    f" set lora_dropout=0 or {fix}")
        if dim == 1 and any(b.bias is not None for b in owner.lora_B.values()):
            return f"a LoRA bias (lora_bias=True) on its {owner_path}, a sum of partial products, would be added per rank"
    return None


def through_adapters(module: torch.nn.Module, split):
    """`split` with every slice of a parameter of a LoRA layer (`why_not_split` None) made in that layer's parts
    (module docstring)."""
    parameters = {}
    for path, (dim, layout) in split.parameters.items():
        adapted = _adapted(module, path)
        if adapted is None:
            parameters[path] = (dim, layout)
            continue
        owner_path, owner = adapted
        name = path.rpartition(".")[2]
        parameters[f"{owner_path}.base_layer.{name}"] = (dim, layout)
        if name == "weight":  # (a bias is the base layer's alone)
            adapters = owner.lora_B if dim == 0 else owner.lora_A
            kind = "lora_B" if dim == 0 else "lora_A"
            for adapter, linear in adapters.items():
                parameters[f"{owner_path}.{kind}.{adapter}.weight"] = (dim, layout)
                if dim == 0 and linear.bias is not None:
                    parameters[f"{owner_path}.{kind}.{adapter}.bias"] = (0, layout)
    return dataclasses.replace(split, parameters=parameters)
