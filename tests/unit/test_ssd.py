"""Our blockwise Mamba2 scan (lightning_ulysses/mixers/ssd.py) and where prepared mixers call it (mixers/kernels.py):
transformers' PyTorch fallback's results and gradients within float32 rounding, row by row and through every Mamba2
family's mixer (padded and packed rows); what autograd keeps per token does not grow with the row, where the
fallback's does; packed documents restart the state; mamba_ssm, where installed, is never replaced."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers.models.mamba2 import modeling_mamba2

from lightning_ulysses.hf import token_mixer_modules
from lightning_ulysses.mixers import install_mixers, kernels, ssd
from lightning_ulysses.mixers.ssd import mamba2_chunk_scan
from lightning_ulysses.planning import layer_kinds
from tests.distributed.families import family_model

FALLBACK = modeling_mamba2.mamba2_chunk_scan
MAMBA2_FAMILIES = ("mamba2", "nemotron_h", "bamba", "zamba2", "falcon_h1", "granitemoehybrid")


def _inputs(length: int, batch: int = 2, heads: int = 4, width: int = 8, groups: int = 2, size: int = 6,
            seed: int = 0, state: bool = True):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    A = (-0.1 - torch.rand(heads, generator=generator)).requires_grad_()
    return dict(hidden_states=make(batch, length, heads, width), dt=make(batch, length, heads), A=A,
                B=make(batch, length, groups, size), C=make(batch, length, groups, size), D=make(heads),
                dt_bias=make(heads), initial_states=make(batch, heads, width, size) if state else None)


def _run(function, inputs, chunk_size=16, **options):
    output, final = function(**inputs, chunk_size=chunk_size, dt_softplus=True, dt_limit=(0.0, 5.0),
                             return_final_states=True, **options)
    weights = torch.linspace(-1, 1, output.numel()).view_as(output)  # every output position its own gradient
    loss = (output * weights).sum() + final.square().sum()
    leaves = [tensor for tensor in inputs.values() if tensor is not None]
    return [output, final, *torch.autograd.grad(loss, leaves)]


def _assert_close(ours, theirs, rtol=1e-6):
    """Each tensor within `rtol` of its largest value (float32 rounding: the op order differs)."""
    for index, (mine, expected) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.dtype == expected.dtype and mine.shape == expected.shape, index
        scale = expected.abs().max().clamp_min(1e-30)
        assert ((mine - expected).abs().max() / scale).item() < rtol, index


@pytest.mark.parametrize("length,block_tokens", [(1, None), (37, None), (150, None), (150, 32), (301, 16)],
                         ids=["one-token", "short", "one-block", "blocks", "many-blocks"])
def test_same_results_and_gradients_as_the_transformers_fallback(length, block_tokens):
    inputs = _inputs(length)
    _assert_close(_run(mamba2_chunk_scan, inputs, block_tokens=block_tokens), _run(FALLBACK, inputs))


def test_without_initial_state_d_or_dt_bias_and_one_group_per_head():
    inputs = _inputs(70, groups=4, state=False)
    inputs.update(D=None, dt_bias=None)
    _assert_close(_run(mamba2_chunk_scan, inputs, block_tokens=32), _run(FALLBACK, inputs))


def test_packed_documents_restart_the_state():
    inputs = {name: None if tensor is None else tensor[:1] if tensor.dim() > 1 else tensor
              for name, tensor in _inputs(50, state=False).items()}
    common = dict(chunk_size=16, dt_softplus=True, block_tokens=16)
    by_bounds = mamba2_chunk_scan(**inputs, **common, cu_seqlens=torch.tensor([0, 20, 50]))
    by_index = mamba2_chunk_scan(**inputs, **common, seq_idx=torch.tensor([[0] * 20 + [1] * 30]))
    pieces = []
    for start, end in ((0, 20), (20, 50)):
        cut = {name: t[:, start:end] if t is not None and t.dim() > 1 else t for name, t in inputs.items()}
        pieces.append(mamba2_chunk_scan(**cut, **common))
    one_by_one = torch.cat(pieces, dim=1)
    whole = mamba2_chunk_scan(**inputs, **common)
    assert torch.equal(by_bounds, one_by_one) and torch.equal(by_index, one_by_one)
    assert not torch.allclose(by_bounds[:, 20:], whole[:, 20:])  # the second document does read the first without


def test_the_planner_plans_the_block_the_scan_runs():
    assert layer_kinds.SSD_BLOCK_TOKENS == ssd.BLOCK_TOKENS  # (the planner does not import the mixers)


def _saved_bytes_per_token(function, length: int, **options) -> float:
    """What autograd keeps for the scan's backward (each storage once, its inputs left out), per token; 8 heads of
    8 × 16 states, chunks of 64 tokens."""
    inputs = _inputs(length, batch=1, heads=8, width=8, groups=2, size=16, state=False)
    given = {tensor.untyped_storage().data_ptr() for tensor in inputs.values() if tensor is not None}
    sizes = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in given:
            sizes[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(**inputs, chunk_size=64, dt_softplus=True, **options)
    return sum(sizes.values()) / length


def test_what_autograd_keeps_per_token_does_not_grow_with_the_row():
    """Ours keeps the state entering each block but the first (fp32 heads × 8 × 16: at most that per block of
    tokens); transformers' fallback keeps the c × c decays and scores per head and chunk position, the B and C
    repeated to the heads, and the recurrence's `[chunks + 1]²` decays per head: more per token as the row grows."""
    ours = [_saved_bytes_per_token(mamba2_chunk_scan, length, block_tokens=256) for length in (1024, 4096)]
    theirs = [_saved_bytes_per_token(FALLBACK, length) for length in (1024, 4096)]
    bound = 4 * 8 * 8 * 16 / 256  # one state per block of 256 tokens
    assert 0 < ours[0] <= ours[1] <= bound, ours
    assert theirs[1] > theirs[0] > 200 * bound, theirs


def _mamba2_batch(model, length=40, seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded row
    return tokens, mask


def _loss_and_grads(model, tokens, mask):
    model.zero_grad()
    loss = model(input_ids=tokens, attention_mask=mask, labels=tokens, use_cache=False).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_every_mamba2_family_trains_as_with_the_fallback_calling_ours_during_its_call_only(family, packed,
                                                                                          monkeypatch):
    """The families' mixers prepared at SP 1 (as the strategy prepares them): transformers' fallback against ours,
    chunks of 8 tokens in blocks of 16, a padded row (and, packed, documents restarting the positions: each runs on
    its own); ours called during the mixers' calls only."""
    model = family_model(family).train()
    mixers = token_mixer_modules(model)
    namespace = sys.modules[type(mixers[0][1]).__module__].__dict__
    fallback = namespace["mamba2_chunk_scan"]
    for _, mixer in mixers:
        mixer.chunk_size = 8
    monkeypatch.setattr(ssd, "BLOCK_TOKENS", 16)
    tokens, mask = _mamba2_batch(model)
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None].expand(2, -1) if packed else None
    calls = []

    def spy(*args, **kwargs):
        calls.append(namespace["mamba2_chunk_scan"] is spy)
        return mamba2_chunk_scan(*args, **kwargs)

    results = {}
    for name, ours in (("fallback", None), ("ours", spy)):
        if ours is None:
            monkeypatch.delitem(kernels.LINEAR_TIME, "mamba2_chunk_scan")
        else:
            monkeypatch.setitem(kernels.LINEAR_TIME, "mamba2_chunk_scan", ours)
        handles, _ = install_mixers(mixers, None, positions=lambda: positions)
        try:
            results[name] = _loss_and_grads(model, tokens, mask)
        finally:
            for handle in handles:
                handle.remove()
    assert calls and all(calls), calls
    assert namespace["mamba2_chunk_scan"] is fallback  # put back after each call
    torch.testing.assert_close(results["ours"][0], results["fallback"][0], rtol=1e-6, atol=0)
    _assert_close(results["ours"][1:], results["fallback"][1:], rtol=1e-5)


def test_mamba_ssm_where_installed_is_never_replaced(monkeypatch):
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    package = types.ModuleType("stand_in_mamba_ssm")
    package.mamba_chunk_scan_combined = lambda *args, **kwargs: "mamba_ssm"
    monkeypatch.setitem(sys.modules, "stand_in_mamba_ssm", package)

    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, **kwargs):
        return "torch"

    mamba2_chunk_scan.__module__ = "transformers.models.stand_in.modeling_stand_in"

    class Mixer(torch.nn.Module):
        def forward(self, hidden):
            return hidden

    namespace = Mixer.forward.__globals__
    for installed, replaced in (("stand_in_mamba_ssm", False), ("not_installed_mamba_ssm", True)):
        bound = use_kernel_func_from_hub_with_fallback("mamba_chunk_scan_combined", installed)(mamba2_chunk_scan)
        monkeypatch.setitem(namespace, "mamba2_chunk_scan", bound)
        assert ("mamba2_chunk_scan" in kernels.LinearTimeKernels(Mixer).replacements) is replaced, installed
