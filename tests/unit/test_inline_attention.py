"""Attention computed inline (BLOOM, MPT, Falcon, GPT-Neo, XGLM): the families' forwards around `attend` on whole rows.

Single process: the forwards `InlineAttention` adapters install (attention/inline.py), run on whole rows (a binding
without an SP group: the same local attention every rank runs after the exchange, with ALiBi from the heads it holds
and key positions from the whole rows), against the unprepared model on rows padded on the left, on the right and
inside (where BLOOM's positions count real tokens only and MPT's every token): loss and gradients. The
multi-process exchange is the family matrix's (tests/distributed/test_families.py). Then what is refused, by name.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_ulysses.attention import inline
from lightning_ulysses.attention.core import ProcessGroupHandle
from lightning_ulysses.hf import PreparedHFModel, validate_hf_model
from lightning_ulysses.hf.binding import _Binding
from lightning_ulysses.hf.positions import _ForwardPositions
from tests.distributed.families import FAMILIES, SEQ_LEN, VOCAB, tiny_model

INLINE = ("bloom", "mpt", "falcon", "gpt_neo", "xglm")
# Eager code whose left-padding tokens (no key to attend to) lightning_ulysses does not reproduce: refused there.
LEFT_PADDING_REFUSED = ("gpt_neo", "xglm")


# Falcon's eager branch (it also has sdpa) and its other two layouts of the fused projection (adapters/falcon.py):
# grouped KV heads (the new decoder architecture) and one KV head per query head; the matrix's is multi-query.
FALCON_VARIANTS = {"falcon_eager": ("eager", {}), "falcon_grouped": ("sdpa", {"new_decoder_architecture": True,
                                                                              "num_kv_heads": 2}),
                   "falcon_mha": ("sdpa", {"multi_query": False})}


def _build(name: str, **overrides):
    if name in FALCON_VARIANTS:
        implementation, settings = FALCON_VARIANTS[name]
        return tiny_model("falcon", implementation, **settings, **overrides)
    try:
        return tiny_model(name, "sdpa", **{**FAMILIES[name], **overrides})
    except ValueError as error:  # eager-only families
        if "scaled_dot_product_attention" not in str(error):
            raise
        return tiny_model(name, "eager", **{**FAMILIES[name], **overrides})


def _batch(rows=(0, 1, 2)) -> dict:
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, VOCAB, (3, SEQ_LEN), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[0, :5] = 0  # left padding
    mask[1, -6:] = 0  # right padding
    mask[2, 8:11] = 0  # inner padding
    batch = {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}
    return {key: value[list(rows)] for key, value in batch.items()}


def _take_over(model) -> PreparedHFModel:
    binding = _Binding(group=ProcessGroupHandle(None), backend=model.config._attn_implementation)
    prepared = PreparedHFModel(model=model, backend=binding.backend)
    prepared.inline_modules = inline.install(model, binding)
    prepared.hooks.append(model.register_forward_pre_hook(_ForwardPositions(model, binding), with_kwargs=True))
    return prepared


@pytest.mark.parametrize("family", (*INLINE, *FALCON_VARIANTS))
def test_inline_forward_on_whole_rows_matches_the_family(family):
    reference = _build(family)
    model = copy.deepcopy(reference)
    assert inline.covers(model)
    prepared = _take_over(model)
    assert prepared.inline_modules
    batch = _batch((1, 2) if family in LEFT_PADDING_REFUSED else (0, 1, 2))
    expected = reference(**batch)
    expected.loss.backward()
    got = model(**batch)
    got.loss.backward()
    assert abs(got.loss.item() - expected.loss.item()) < 1e-5
    real = batch["attention_mask"].bool()
    assert torch.allclose(got.logits[real], expected.logits[real], atol=1e-5)
    named = dict(reference.named_parameters())
    floor = 1e-6 * max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    for name, parameter in model.named_parameters():
        full = named[name].grad
        if full is None:
            continue
        error = (parameter.grad - full).abs().max().item() / max(full.abs().max().item(), floor)
        assert error < 1e-4, (family, name, error)
    prepared.restore()  # the modules' class forwards are back
    assert all("forward" not in module.__dict__ for module in model.modules())


@pytest.mark.parametrize("family", ("falcon", "falcon_eager"))
def test_falcon_drops_attention_out_exactly_when_its_installed_module_does(family):
    # Up to transformers 5.24 Falcon's sdpa and eager branches drop no attention probabilities; from 5.25 on every
    # backend drops its attention_dropout in training (adapters/falcon.py): taken over, it does the same.
    reference = _build(family, attention_dropout=0.5)
    model = copy.deepcopy(reference)
    _take_over(model)
    batch = _batch((1, 2))

    def drops(module) -> bool:
        plain = module.eval()(**batch).logits
        torch.manual_seed(0)
        return not torch.equal(module.train()(**batch).logits, plain)

    with torch.no_grad():
        assert drops(model) == drops(reference)


@pytest.mark.parametrize("family", LEFT_PADDING_REFUSED)
def test_left_padding_is_refused_by_name_where_the_eager_code_is_not_reproduced(family):
    model = _build(family)
    _take_over(model)
    with pytest.raises(NotImplementedError, match="padding_side='right'"):
        model(**_batch((0,)))


def test_alibi_key_positions_count_real_tokens_or_every_token():
    documents = type("Rows", (), {"real_tokens": torch.tensor([[False, True, True, False, True]])})()
    assert inline.alibi_key_positions(5, documents, False, "cpu").tolist() == [[0, 0, 1, 0, 2]]  # BLOOM
    assert inline.alibi_key_positions(5, documents, True, "cpu").tolist() == [[0, 1, 2, 3, 4]]  # MPT


@pytest.mark.parametrize("family", ("bloom", "mpt"))
def test_alibi_refuses_ring_attention_by_name(family):
    with pytest.raises(NotImplementedError, match="ALiBi.*ring_size=1"):
        validate_hf_model(_build(family), 1, ring_size=2)


def test_falcon_alibi_variant_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="alibi=True.*sequence_parallel_size=1"):
        validate_hf_model(_build("falcon", alibi=True), 2)


@pytest.mark.parametrize("family", ("gpt_neo", "xglm"))
def test_eager_inline_attention_refuses_ring_attention_by_name(family):
    with pytest.raises(NotImplementedError, match="eager attention.*ring_size=1"):
        validate_hf_model(_build(family), 1, ring_size=2)


@pytest.mark.parametrize("family", INLINE)
def test_inline_families_pass_the_checks(family):
    validate_hf_model(_build(family), 2)


def test_tiled_mlp_refuses_an_mlp_that_takes_more_than_the_hidden_states():
    from lightning_ulysses.memory import MemoryOptions, apply_memory_options

    with pytest.raises(ValueError, match="BloomMLP takes more arguments.*tiled_mlp off"):  # (hidden, residual)
        apply_memory_options(_build("bloom"), MemoryOptions(tiled_mlp=True))
