"""peft's LoRA on the linears of token mixers split by heads (lightning_ulysses/mixers/lora.py), in one process.

peft puts an adapted linear inside a layer of its own, which is no `torch.nn.Linear`: the families' declarations
recognised only bare linears, so LoRA on a Kimi, Mamba, LFM2, MiniMax or RecurrentGemma mixer sent it to whole rows. Here: every
mixer kind with LoRA on each of its linears is declared a split; at SP 1 on packed rows (where the split's local view
runs, one document at a time, its linears sliced through their adapters' parts) it equals the adapted mixer run on
each document alone, output and every gradient; what cannot go through a slice is named, with the fix. Exactness
over several ranks: tests/distributed/test_parity.py (`-lora` cases of hybrid families).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lightning_ulysses.hf import token_mixer_modules
from lightning_ulysses.mixers import install_mixers, lora, split_of
from tests.distributed.families import family_model

# peft refuses LoRA on Mamba models' `out_proj` and `conv1d` (mamba_ssm's fused kernels read their weights)
PEFT_REFUSES = {"mamba": ("out_proj",)}
FAMILIES = ("qwen3_5_text", "olmo_hybrid", "kimi_linear", "bamba", "jamba", "mamba", "lfm2", "minimax",
            "recurrent_gemma")
LENGTH = 8
PACKED = torch.cat([torch.arange(3), torch.arange(5)])[None].expand(2, -1)  # two documents per row: 3 and 5 tokens


def _adapted_mixer(family: str, **config):
    """The first token mixer of `family`'s tiny model with LoRA (random A and B: not a no-op) on each of its linears."""
    model = family_model(family)
    path, mixer = token_mixer_modules(model)[0]
    targets = [f"{path}.{name}" for name, module in mixer.named_modules()
               if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] not in PEFT_REFUSES.get(family, ())]
    torch.manual_seed(3)
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False, **config))
    return path, mixer, [name for name, module in mixer.named_modules() if hasattr(module, "base_layer")]


def _call(mixer, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    parameters = inspect.signature(type(mixer).forward).parameters
    kwargs = {name: None for name in ("attention_mask", "position_embeddings")
              if name in parameters and parameters[name].default is inspect.Parameter.empty}
    if "position_ids" in parameters:  # (RecurrentGemma's block restarts its recurrence where they are 0)
        kwargs["position_ids"] = positions
    output = mixer(hidden, **kwargs)
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixer_with_lora_on_its_linears_is_split_by_heads(family):
    _, mixer, adapted = _adapted_mixer(family)
    assert adapted, family
    for parts in (1, 2, 4):
        split = split_of(mixer, parts, 0)
        assert split is not None, (family, parts)
        assert lora.why_not_split(mixer, split) is None, (family, parts)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_runs_through_the_split_exactly(family):
    # At SP 1 packed rows run the local view (mixers/head_split.py `_per_document`), with every linear the split
    # slices taken apart into its adapter's parts (the whole of them, at one rank): the adapted mixer's own output
    # and gradients on each document alone.
    path, mixer, _ = _adapted_mixer(family)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, LENGTH, mixer.hidden_size if hasattr(mixer, "hidden_size") else 32, generator=generator)
    weights = torch.randn(2, LENGTH, 1, generator=generator)
    trained = {name: p for name, p in mixer.named_parameters() if p.requires_grad}
    assert any("lora_" in name for name in trained)
    expected = torch.cat([_call(mixer, hidden[:, :3], PACKED[:, :3]), _call(mixer, hidden[:, 3:], PACKED[:, 3:])], dim=1)
    (expected * weights).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in trained.items() if p.grad is not None}
    mixer.zero_grad()
    handles, whole_rows = install_mixers([(path, mixer)], None, positions=lambda: PACKED)
    assert handles and not whole_rows
    try:
        output = _call(mixer, hidden, PACKED)
        (output * weights).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert (output - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert expected_grads.keys() == {name for name, p in trained.items() if p.grad is not None}
    for name, grad in expected_grads.items():  # (relative to the largest: another order of the same sums)
        assert (trained[name].grad - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_what_cannot_go_through_a_slice_is_named_with_the_fix():
    # DoRA normalises the whole weight's rows; dropout before a linear sliced by its output channels would draw one
    # mask per rank on an input every rank holds whole; a LoRA bias on a sum of partial products would be added per
    # rank. Each sends its mixer to whole rows (exact) with the reason; the exchanged projections take any of them.
    _, kimi, _ = _adapted_mixer("kimi_linear", use_dora=True)
    why = lora.why_not_split(kimi, split_of(kimi, 2, 0))
    assert "not plain LoRA" in why and "out of the adapter's target_modules" in why, why
    _, kimi, _ = _adapted_mixer("kimi_linear", lora_dropout=0.1)
    why = lora.why_not_split(kimi, split_of(kimi, 2, 0))
    assert "lora_dropout=0" in why and ("g_b_proj" in why or "f_b_proj" in why), why
    _, jamba, _ = _adapted_mixer("jamba", lora_bias=True)
    why = lora.why_not_split(jamba, split_of(jamba, 2, 0))
    assert "lora_bias=True" in why and "x_proj" in why, why
    for config in ({"use_dora": True}, {"lora_dropout": 0.1, "lora_bias": True}):  # exchanged projections only
        _, lfm2, _ = _adapted_mixer("lfm2", **config)
        assert lora.why_not_split(lfm2, split_of(lfm2, 2, 0)) is None


def test_the_partial_products_of_a_lora_linear_sum_to_it_with_its_bias_once(monkeypatch):
    # Mamba's x_proj under LoRA in the local view of each of 2 ranks (its base weight's and lora_A's input channels
    # sliced, as `lora.through_adapters` declares): the partial products sum to the whole adapted linear, its base
    # bias counted once (the families' x_proj have none; a bias added by every rank would be counted twice).
    from lightning_ulysses.mixers import head_split

    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(8, 3)
    torch.manual_seed(0)
    layer = get_peft_model(holder, LoraConfig(r=2, target_modules=["proj"], init_lora_weights=False)).base_model.model.proj
    rows = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(head_split, "sum_over_ranks", lambda partial, ranks: partial)  # summed below instead
    partials = []
    for rank, channels in enumerate((slice(0, 4), slice(4, 8))):
        view = head_split._bare_copy(layer)  # the view's copies, as `HeadSplitMixer._local_view` makes them
        base = view._modules["base_layer"] = head_split._bare_copy(layer.base_layer)
        adapters = view._modules["lora_A"] = head_split._bare_copy(layer.lora_A)
        down = adapters._modules["default"] = head_split._bare_copy(layer.lora_A["default"])
        base._parameters["weight"] = base.weight[:, channels]
        down._parameters["weight"] = down.weight[:, channels]
        ranks = SimpleNamespace(rank=rank, size=2)  # (what SumOfPartialProducts reads of a SequenceRanks)
        partials.append(head_split.SumOfPartialProducts(view, ranks)(rows[..., channels]))
    expected = layer(rows)
    assert (partials[0] + partials[1] - expected).abs().max() <= 1e-6 * expected.abs().max()
