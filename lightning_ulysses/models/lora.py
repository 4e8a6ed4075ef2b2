"""LoRA adapters (the `peft` package) on a causal LM, applied in `configure_model` after the model is built or loaded.

`with_lora(model, LoraSettings(r=8, alpha=16, target_modules=("q_proj", "v_proj")))` returns peft's `PeftModel`:
the base weights frozen, an `A`/`B` pair beside every targeted linear layer, trainable. Under ZeRO-3 this runs inside
Lightning's `deepspeed.zero.Init`, so the adapters are partitioned when peft creates them; their initial values are
nevertheless those of a plain `get_peft_model` in one process seeded with `settings.seed` (`A` as `nn.Linear`'s
default, `B` zero), see `_initialise_adapter`. The strategy then prepares the `PeftModel`'s inner transformers model
as any other (peft wraps the projections; attention, loss and memory engine are untouched by that).

More adapters (several adapters trained in turn, or exported side by side): `add_adapter(peft_model, name, settings)`,
not peft's own `peft_model.add_adapter(name, config)`, which under ZeRO-3 leaves the new adapter's `B` random (the
model would no longer start as the pretrained one). The strategy refuses, at setup, a partitioned adapter that none
of these functions initialised (`preparation.check_adapters_initialised`, which the strategy runs on every module).

Dropout (`settings.dropout` > 0) is allowed, as the model's own dropout is under the strategy: at SP > 1 each SP
rank's steps draw from a random stream of their own (`lightning_ulysses.integration.rng`), so each rank draws the masks of its
own tokens, unlike the other shards' (a run is not bit-equal to one process, only equal in distribution; DP
replicas draw alike, as under Lightning's DDP), and the memory engine's recomputes replay them
(`tests/unit/test_memory.py`, `tests/unit/test_rng.py`).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Iterator, Sequence, Union

import torch

from lightning_ulysses.integration.preparation import INITIALISED_MARK


@dataclass(frozen=True)
class LoraSettings:
    """`conf/model/hf_pretrained.yaml`'s `lora:` block.

    Args:
        r: rank of every adapter.
        alpha: scale numerator (the adapters' output is multiplied by `alpha / r`).
        target_modules: names of the layers to adapt, matched as peft matches them (a module whose name is, or ends
            with `.` + , one of them), or one regular expression (matched whole), or `"all-linear"`.
        dropout: dropout on the adapters' input (see the module docstring).
        seed: the adapters' initial values are those `torch.manual_seed(seed)` then `get_peft_model` gives.
    """

    r: int = 8
    alpha: float = 16.0
    target_modules: Union[Sequence[str], str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0
    seed: int = 0

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          task_type="CAUSAL_LM")


def with_lora(model: torch.nn.Module, settings: LoraSettings):
    """`model` wrapped by peft with LoRA adapters (frozen base, trainable adapters); refuses targets that match no
    layer before anything changes."""
    from peft import get_peft_model

    check_targets(model, settings.target_modules)
    with _seeded(settings.seed):
        peft_model = get_peft_model(model, settings.peft_config())
    (name,) = peft_model.peft_config  # peft's name for a model's first adapter ("default")
    _initialise_adapter(peft_model, name, settings.seed)
    return peft_model


def add_adapter(peft_model, name: str, settings: LoraSettings) -> None:
    """Adds the LoRA adapter `name` to `peft_model` (a `PeftModel`, e.g. `with_lora`'s), with the values a plain
    process's `torch.manual_seed(settings.seed); peft_model.add_adapter(name, settings.peft_config())` gives it, also
    under ZeRO-3 (in `configure_model`), where peft's own `add_adapter` leaves `B` random. As peft's: the new adapter
    is inactive and frozen (`peft_model.set_adapter(name)` trains it). Refuses targets that match no layer before
    anything changes; the run's random generators do not move (see `with_lora`)."""
    check_targets(peft_model.get_base_model(), settings.target_modules)
    with _seeded(settings.seed):
        peft_model.add_adapter(name, settings.peft_config())
    _initialise_adapter(peft_model, name, settings.seed)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """The random generators seeded with `seed`, in a fork: the adapters' draws neither depend on nor move the
    generators the run is seeded with (under ZeRO-3 on a GPU, `zero.Init` builds the adapters on the GPU and draws
    there)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def check_targets(model: torch.nn.Module, target_modules: Union[Sequence[str], str]) -> None:
    """Every name of `target_modules` must match at least one layer (peft only refuses when none of them does, so a
    misspelt name among good ones would silently train fewer adapters)."""
    if target_modules == "all-linear":
        return
    names = [name for name, _ in model.named_modules() if name]
    if isinstance(target_modules, str):
        unmatched = [] if any(re.fullmatch(target_modules, name) for name in names) else [target_modules]
    else:
        unmatched = [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"LoRA target_modules {unmatched} match no layer of {type(model).__name__}; its linear layers"
                         f" are named {linear}: set model.lora.target_modules to some of those.")


def _initialise_adapter(peft_model, name: str, seed: int) -> None:
    """Under ZeRO-3 (`zero.Init`), peft initialises adapters that are already partitioned (empty on every rank):
    measured at SP 2, `B` kept `nn.Linear`'s random init instead of zero (the model no longer starts as the
    pretrained one) and `A` its first draw instead of peft's; the same for an adapter added later by peft's
    `add_adapter` (measured 2026-12-02). So the adapter `name` is gathered and given the values a plain process's
    `torch.manual_seed(seed)`, then the peft call that created it (`get_peft_model`, `add_adapter`), gives. Those are
    drawn on the CPU whatever the device (peft builds each pair on the CPU, initialises it, then moves it): per
    adapted layer, in creation order (the module tree's), `nn.Linear`'s default init of `A` then of `B` (discarded by
    peft), then `A` redrawn like `nn.Linear`'s (`kaiming_uniform_(a=sqrt(5))`) and `B` zero (`reset_lora_parameters`).
    `tests/unit/test_lora.py` pins this order against peft itself. One adapter per call: a peft call creates one,
    and the draws of two would interleave by layer, not by adapter. Without partitioning, peft's own values stand;
    on the meta device (FSDP2's `from_pretrained` in `configure_model`) the same values are put on the host.
    Every weight set (or left) here is marked (`INITIALISED_MARK`)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer) and name in m.lora_A]
    if layers and layers[0].lora_A[name].weight.is_meta:
        _materialise_adapter(layers, name, seed)
    pairs = [(layer.lora_A[name].weight, layer.lora_B[name].weight) for layer in layers]
    for weight in (w for pair in pairs for w in pair):
        setattr(weight, INITIALISED_MARK, True)
    if not pairs or not hasattr(pairs[0][0], "ds_id"):
        return
    import deepspeed

    generator = torch.Generator().manual_seed(seed)
    values = [_peft_initial_pair(a.ds_shape, b.ds_shape, generator) for a, b in pairs]
    # Every rank computed the same values; rank 0's are broadcast on exit.
    with deepspeed.zero.GatheredParameters([p for pair in pairs for p in pair], modifier_rank=0):
        with torch.no_grad():
            for (a, b), (a_value, b_value) in zip(pairs, values):
                a.copy_(a_value)
                b.copy_(b_value)


def _materialise_adapter(layers, name: str, seed: int) -> None:
    """Under the FSDP2 strategy, `from_pretrained` in `configure_model` leaves the model on the meta device until each
    rank reads its shards (`integration/pretrained.py`), so peft builds the adapter `name` there, without values: each
    pair becomes a host tensor with the values peft draws (`_initialise_adapter`), which the shard reading keeps."""
    generator = torch.Generator().manual_seed(seed)
    for layer in layers:
        a, b = layer.lora_A[name], layer.lora_B[name]
        a_value, b_value = _peft_initial_pair(a.weight.shape, b.weight.shape, generator)
        a.weight = torch.nn.Parameter(a_value.to(a.weight.dtype), requires_grad=a.weight.requires_grad)
        b.weight = torch.nn.Parameter(b_value.to(b.weight.dtype), requires_grad=b.weight.requires_grad)


def _peft_initial_pair(a_shape, b_shape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter pair's initial values, drawn as peft's `update_layer` draws them (see `_initialise_adapter`)."""
    def linear_init(shape):  # `nn.Linear.reset_parameters` of a bias-free layer
        return torch.nn.init.kaiming_uniform_(torch.empty(tuple(shape), device="cpu"), a=math.sqrt(5),
                                              generator=generator)

    linear_init(a_shape), linear_init(b_shape)  # the two layers' own init, which peft then overwrites
    return linear_init(a_shape), torch.zeros(tuple(b_shape), device="cpu")
