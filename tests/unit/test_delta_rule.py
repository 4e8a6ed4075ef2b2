"""Our linear-time gated delta rule (lightning_ulysses/mixers/delta_rule.py) and where prepared mixers call it
(mixers/kernels.py): the same results as transformers' PyTorch fallback, to the bit; backward work linear in the
row's length where the fallback's is quadratic; packed documents restart the state; the fallback's name bound to
ours only during a prepared mixer's call."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.qwen3_next import modeling_qwen3_next

from lightning_ulysses.hf import token_mixer_modules
from lightning_ulysses.mixers import install_mixers, kernels
from lightning_ulysses.mixers.delta_rule import chunk_gated_delta_rule
from tests.distributed.families import family_model

FALLBACK = modeling_qwen3_next.torch_chunk_gated_delta_rule
GDN_FAMILIES = ("qwen3_next", "qwen3_5_text", "olmo_hybrid")


def _inputs(length: int, heads: int = 4, width: int = 8, seed: int = 0, state: bool = False):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    query, key, value = make(2, length, heads, width), make(2, length, heads, width), make(2, length, heads, width)
    g = (-torch.rand(2, length, heads, generator=generator)).requires_grad_()
    beta = torch.rand(2, length, heads, generator=generator).requires_grad_()
    initial = make(2, heads, width, width) if state else None
    return query, key, value, g, beta, initial


def _run(function, inputs, chunk_size: int = 64):
    *tensors, initial = inputs
    output, final = function(*tensors, chunk_size=chunk_size, initial_state=initial, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
    loss = output.square().sum() + final.sum()
    leaves = [tensor for tensor in inputs if tensor is not None]
    return output, final, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("length", [1, 64, 150])
def test_same_results_as_the_transformers_fallback_to_the_bit(length):
    inputs = _inputs(length, state=True)
    expected, ours = _run(FALLBACK, inputs), _run(chunk_gated_delta_rule, inputs)
    assert torch.equal(ours[0], expected[0])  # output
    assert torch.equal(ours[1], expected[1])  # final state
    for mine, theirs in zip(ours[2], expected[2]):
        assert torch.equal(mine, theirs)


def test_value_heads_grouped_under_key_heads_read_their_key_head():
    # transformers' newer fallbacks take one query/key per key head, its value heads following it; ours as well
    query, key, value, g, beta, _ = _inputs(40, heads=4)
    grouped = chunk_gated_delta_rule(query[:, :, :2], key[:, :, :2], value, g, beta, use_qk_l2norm_in_kernel=True)[0]
    repeated = chunk_gated_delta_rule(query[:, :, :2].repeat_interleave(2, dim=2),
                                      key[:, :, :2].repeat_interleave(2, dim=2), value, g, beta,
                                      use_qk_l2norm_in_kernel=True)[0]
    assert torch.equal(grouped, repeated)


def test_packed_documents_restart_the_state():
    query, key, value, g, beta, _ = (x[:1] if x is not None else None for x in _inputs(50))
    bounds = torch.tensor([0, 20, 50])
    packed = chunk_gated_delta_rule(query, key, value, g, beta, cu_seqlens=bounds, use_qk_l2norm_in_kernel=True)[0]
    one_by_one = torch.cat([chunk_gated_delta_rule(query[:, a:b], key[:, a:b], value[:, a:b], g[:, a:b], beta[:, a:b],
                                                   use_qk_l2norm_in_kernel=True)[0] for a, b in ((0, 20), (20, 50))], 1)
    whole = chunk_gated_delta_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel=True)[0]
    assert torch.equal(packed, one_by_one)
    assert not torch.allclose(packed[:, 20:], whole[:, 20:])  # the second document does read the first without


class _ElementsWritten(TorchDispatchMode):
    """Counts the elements every operation writes (its outputs' sizes): the memory traffic of what runs under it."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.elements += tensor.numel()
        return out


def _backward_elements(function, length: int) -> int:
    # chunks of 4 tokens: many chunks in a short row, where a per-chunk whole-row gradient dominates
    *tensors, _ = _inputs(length, heads=2, width=4)
    output, _ = function(*tensors, chunk_size=4, use_qk_l2norm_in_kernel=True)
    counter = _ElementsWritten()
    with counter:
        output.sum().backward()
    return counter.elements


def test_backward_work_grows_linearly_with_the_row_where_the_fallback_grows_quadratically():
    ours = _backward_elements(chunk_gated_delta_rule, 1024) / _backward_elements(chunk_gated_delta_rule, 512)
    theirs = _backward_elements(FALLBACK, 1024) / _backward_elements(FALLBACK, 512)
    assert ours < 2.2  # twice the row, twice the work
    assert theirs > 3.0  # the measure sees the quadratic term where there is one


@pytest.mark.parametrize("family", GDN_FAMILIES)
def test_a_prepared_mixer_calls_ours_during_its_call_only(family, monkeypatch):
    path, mixer = token_mixer_modules(family_model(family))[0]
    namespace = sys.modules[type(mixer).__module__].__dict__
    fallback = namespace["torch_chunk_gated_delta_rule"]
    calls = []

    def spy(*args, **kwargs):
        calls.append(namespace["torch_chunk_gated_delta_rule"] is spy)
        return chunk_gated_delta_rule(*args, **kwargs)

    monkeypatch.setitem(kernels.LINEAR_TIME, "torch_chunk_gated_delta_rule", spy)
    hidden = torch.randn(1, 70, mixer.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = mixer(hidden)
    handles, whole_rows = install_mixers([(path, mixer)], None)  # SP 1: the mixer itself, under the split's call
    try:
        output = mixer(hidden)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [True]
    assert namespace["torch_chunk_gated_delta_rule"] is fallback  # put back after the call
    assert torch.equal(output, expected)


def test_flash_linear_attention_where_installed_is_never_replaced(monkeypatch):
    # transformers binds the fallback's name through its own decorator, which wraps fla's function where fla
    # imports (a stand-in package here) and its PyTorch function where not; only the latter is ours to replace.
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    fla = types.ModuleType("stand_in_fla")
    fla.chunk_gated_delta_rule = lambda *args, **kwargs: "fla"
    monkeypatch.setitem(sys.modules, "stand_in_fla", fla)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        return "torch"

    torch_chunk_gated_delta_rule.__module__ = "transformers.models.stand_in.modeling_stand_in"

    class Mixer(torch.nn.Module):
        def forward(self, hidden):
            return hidden

    namespace = Mixer.forward.__globals__
    for package, replaced in (("stand_in_fla", False), ("not_installed_fla", True)):
        bound = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", package)(torch_chunk_gated_delta_rule)
        monkeypatch.setitem(namespace, "torch_chunk_gated_delta_rule", bound)
        assert bool(kernels.LinearTimeKernels(Mixer).replacements) is replaced, package
