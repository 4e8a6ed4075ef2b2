"""The ring's block kernels: which kind the SDPA priority picks, and the cuDNN kind's conventions.

The cuDNN kernels run on CUDA only, so here they are stood in for by CPU ops that keep cuDNN's conventions as
measured on an H200 (torch 2.11, cuDNN 9.19): the log-sum-exp comes back `[batch, heads, rows, 1]` fp32 in natural
log with the softmax scale applied, fewer KV heads than query heads are taken as they are (the backward returns dK/dV
with the KV heads), and the backward is handed that log-sum-exp back with the trailing 1. What can be wrong on our
side (the log-sum-exp's layout, the KV heads, the arguments' order) is then checked against full attention in fp32.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses.attention import ring
from lightning_ulysses.attention.backends import sdpa_priority
from lightning_ulysses.attention.ring import (BlockAttentionKernel, block_kernel_kind, lse_from_cudnn, lse_to_cudnn,
                                              ring_attention, sdpa_kernel_order)

_aten = torch.ops.aten


def test_the_sdpa_priority_in_force_picks_the_block_kernel():
    assert sdpa_kernel_order()[0] == "flash"  # torch's own order
    with sdpa_priority(("cudnn",)):  # what the strategy sets for sdpa_kernel_priority=["cudnn"] (and "auto" on Hopper)
        assert sdpa_kernel_order()[0] == "cudnn"
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            assert "cudnn" not in sdpa_kernel_order()  # switched off process-wide: not used by the ring either
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    for dtype in (torch.bfloat16, torch.float16):
        assert block_kernel_kind("cuda", dtype, ("cudnn", "flash")) == "cuda_cudnn"
        assert block_kernel_kind("cuda", dtype, ("flash", "cudnn")) == "cuda_flash"
        assert block_kernel_kind("cuda", dtype, ()) == "cuda_flash"
    assert block_kernel_kind("cuda", torch.float32, ("cudnn", "flash")) == "cuda_efficient"
    assert block_kernel_kind("cpu", torch.bfloat16, ("cudnn", "flash")) == "cpu_flash"


def test_cudnn_log_sum_exp_is_read_and_handed_back_in_the_ring_convention():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 8, 4, generator=generator), torch.randn(2, 3, 8, 4, generator=generator)
    # the flash convention, checked on the CPU flash kernel: [batch, heads, rows], natural log of the scaled scores
    _, flash_lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, 0.0, False, scale=0.3)
    expected = torch.logsumexp(0.3 * q @ k.transpose(-1, -2), dim=-1)
    torch.testing.assert_close(flash_lse, expected)
    cudnn_lse = expected.unsqueeze(-1)  # cuDNN's [batch, heads, rows, 1], same values (H200 measurement)
    torch.testing.assert_close(lse_from_cudnn(cudnn_lse), flash_lse)
    assert lse_from_cudnn(expected) is expected  # an older torch's [batch, heads, rows]: as it is
    one_row = expected[:, :, :1].unsqueeze(-1)
    assert lse_from_cudnn(one_row).shape == (2, 3, 1)  # a one-row block keeps its row (no squeeze(-1))
    rows = expected[:, :, 4:]  # the ring hands the backward a row slice of its merged log-sum-exp: strided
    back = lse_to_cudnn(rows, kernel_dim=4)
    assert back.shape == (2, 3, 4, 1) and back.is_contiguous() and torch.equal(back[..., 0], rows)
    assert lse_to_cudnn(rows, kernel_dim=3).shape == (2, 3, 4)


class StandInCudnn:
    """CPU stand-ins for aten's cuDNN attention ops with cuDNN's conventions (see the module docstring)."""

    def __init__(self, takes_fewer_kv_heads: bool = True, refuses: bool = False):
        self.takes_fewer_kv_heads, self.refuses = takes_fewer_kv_heads, refuses
        self.kv_heads_seen: list[int] = []

    def _check(self, q, k):
        if self.refuses or (q.size(1) != k.size(1) and not self.takes_fewer_kv_heads):
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
        self.kv_heads_seen.append(k.size(1))
        return q.size(1) // k.size(1)

    def forward(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        groups = self._check(q, k)
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        seed, offset = torch.tensor(11), torch.tensor(12)
        return out, lse.unsqueeze(-1), None, None, q.size(2), k.size(2), seed, offset, None

    def backward(self, grad_out, q, k, v, out, lse, seed, offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, *, scale):
        assert lse.shape == (*q.shape[:3], 1) and lse.is_contiguous() and lse.dtype == torch.float32
        assert (seed.item(), offset.item()) == (11, 12) and attn_bias is cum_seq_q is cum_seq_k is None
        assert (max_q, max_k, dropout_p) == (q.size(2), k.size(2), 0.0)
        kv_heads, groups = k.size(1), self._check(q, k)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), out, lse[..., 0], 0.0,
            is_causal, scale=scale)
        return dq, *(g.unflatten(1, (kv_heads, groups)).sum(2) for g in (dk, dv))


@pytest.fixture
def stand_in(monkeypatch):
    def install(**kwargs):
        ops = StandInCudnn(**kwargs)
        monkeypatch.setattr(ring, "_cudnn_forward", ops.forward)
        monkeypatch.setattr(ring, "_cudnn_backward", ops.backward)
        monkeypatch.setattr(ring, "_decided", {})
        # as on a CUDA device in bf16 with cuDNN first; the tensors stay on the CPU, in fp32
        monkeypatch.setattr(ring, "block_kernel_kind", lambda *_: "cuda_cudnn")
        return ops

    return install


def _inputs(heads, kv_heads, rows=12, dim=8):
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, rows, dim, generator=generator, requires_grad=True)
    k = torch.randn(2, kv_heads, rows, dim, generator=generator, requires_grad=True)
    v = torch.randn(2, kv_heads, rows, dim, generator=generator, requires_grad=True)
    return q, k, v, torch.randn(2, heads, rows, dim, generator=generator)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("takes_fewer_kv_heads", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_the_cudnn_kind_equals_full_attention(stand_in, heads, kv_heads, takes_fewer_kv_heads, causal):
    ops = stand_in(takes_fewer_kv_heads=takes_fewer_kv_heads)
    q, k, v, grad_out = _inputs(heads, kv_heads)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.4, enable_gqa=True)
    expected = [reference, *torch.autograd.grad(reference, (q, k, v), grad_out)]
    out = ring_attention(q, k, v, None, causal, 0.4)
    for mine, full in zip([out, *torch.autograd.grad(out, (q, k, v), grad_out)], expected):
        torch.testing.assert_close(mine, full, atol=1e-5, rtol=0)
    # the ring's own calls (after the probe's) hand cuDNN the model's KV heads unless it refused them
    assert set(ops.kv_heads_seen[-2:]) == {kv_heads if takes_fewer_kv_heads else heads}


@pytest.mark.parametrize("rows, columns, causal", [(slice(0, 12), slice(0, 6), False), (slice(6, 12), slice(0, 12),
                                                                                         False)])
def test_the_cudnn_kind_equals_flash_on_the_rings_rectangular_blocks(stand_in, rows, columns, causal):
    """The blocks a ring step > 0 attends (all rows × the first half of the columns, the second half of the rows ×
    all columns): output, log-sum-exp and gradients as the flash kind gives them."""
    stand_in()
    q, k, v, grad_out = _inputs(4, 2)
    blocks = q[:, :, rows].detach(), k[:, :, columns].detach(), v[:, :, columns].detach()
    results = []
    for kernel in (BlockAttentionKernel("cuda_cudnn", 0.4, native_gqa=True), BlockAttentionKernel("cpu_flash", 0.4)):
        out, lse = kernel.forward(*blocks, causal)
        results.append([out, lse, *kernel.backward(grad_out[:, :, rows], *blocks, out, lse, causal)])
    for mine, flash in zip(*results):
        torch.testing.assert_close(mine, flash, atol=1e-6, rtol=0)


def test_cudnn_refusals_fall_back_once_with_one_log_line(stand_in, caplog):
    q, k, _, _ = _inputs(4, 2)
    caplog.set_level(logging.INFO, logger="lightning.pytorch.ulysses")
    stand_in(takes_fewer_kv_heads=False)
    assert ring._decide_cudnn(q, k, None, None) == ("cuda_cudnn", False)  # cuDNN, KV heads repeated
    stand_in(refuses=True)
    assert ring._decide_cudnn(q, k, None, None) == ("cuda_flash", False)
    assert ring._decide_cudnn(q, k, None, None) == ("cuda_flash", False)  # decided once: no second line
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and "KV heads repeated" in lines[0] and "flash (cuDNN refused" in lines[1]


class StandInFa4:
    """CPU stand-ins for FlashAttention-4's two entry points with its conventions (flash-attn-4 4.0.0b40): `[batch,
    seq, heads, dim]` layouts, fewer KV heads taken as they are, a `[batch, heads, rows]` fp32 natural-log
    log-sum-exp, and a backward that differentiates against the output and log-sum-exp it is handed (the flash
    identity the ring relies on: CPU flash's backward, which reads them too)."""

    def __init__(self):
        self.calls: list[str] = []

    @staticmethod
    def _heads_first(q, k, v):
        groups = q.size(2) // k.size(2)
        return q.transpose(1, 2), *(t.transpose(1, 2).repeat_interleave(groups, 1) for t in (k, v))

    def forward(self, q, k, v, softmax_scale=None, causal=False, window_size_left=None, window_size_right=None,
                return_lse=False, **varlen):
        assert return_lse and window_size_left is window_size_right is None and not varlen
        self.calls.append("forward")
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(*self._heads_first(q, k, v), 0.0, causal,
                                                                     scale=softmax_scale)
        return out.transpose(1, 2), lse, None, None, None

    def backward(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False):
        assert lse.shape == (q.size(0), q.size(2), q.size(1)) and lse.dtype == torch.float32
        self.calls.append("backward")
        kv_heads = k.size(2)
        query, key, value = self._heads_first(q, k, v)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), query, key, value, out.transpose(1, 2), lse, 0.0, causal, scale=softmax_scale)
        dk, dv = (g.unflatten(1, (kv_heads, g.size(1) // kv_heads)).sum(2) for g in (dk, dv))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@pytest.fixture
def fa4_stand_in(monkeypatch):
    import sys
    import types

    from lightning_ulysses.attention import backends

    ops = StandInFa4()
    package, cute, interface = (types.ModuleType(name) for name in ("flash_attn", "flash_attn.cute",
                                                                     "flash_attn.cute.interface"))
    interface._flash_attn_fwd, interface._flash_attn_bwd = ops.forward, ops.backward
    package.cute, cute.interface, package.__path__, cute.__path__ = cute, interface, [], []
    for module in (package, cute, interface):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return ops, backends


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("rows, columns, causal", [(slice(0, 12), slice(0, 12), True),
                                                   (slice(0, 12), slice(0, 6), False),
                                                   (slice(6, 12), slice(0, 12), False)])
def test_the_fa4_kind_equals_flash_on_the_rings_blocks(fa4_stand_in, heads, kv_heads, rows, columns, causal):
    """The ring's three block shapes through FA4's entry points (layouts transposed, KV heads as they are, the
    backward against the log-sum-exp handed to it): output, log-sum-exp and gradients as the flash kind gives."""
    ops, _ = fa4_stand_in
    q, k, v, grad_out = _inputs(heads, kv_heads)
    blocks = q[:, :, rows].detach(), k[:, :, columns].detach(), v[:, :, columns].detach()
    results = []
    for kernel in (BlockAttentionKernel("cuda_fa4", 0.4, native_gqa=True), BlockAttentionKernel("cpu_flash", 0.4)):
        out, lse = kernel.forward(*blocks, causal)
        results.append([out, lse, *kernel.backward(grad_out[:, :, rows], *blocks, out, lse, causal)])
    assert ops.calls == ["forward", "backward"]
    for mine, flash in zip(*results):
        torch.testing.assert_close(mine, flash, atol=1e-6, rtol=0)


def test_the_ring_takes_fa4_where_the_priority_puts_it_first_and_it_serves(fa4_stand_in, monkeypatch):
    _, backends = fa4_stand_in
    q, k = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    served = []  # as on a GPU where FA4 takes this head dim and dtype (fa4_serves checks the device)
    monkeypatch.setattr(backends, "fa4_serves", lambda query, dropout, pattern: served.append(query) or True)
    monkeypatch.setattr(backends, "_fa4_first", [True])
    kernel = BlockAttentionKernel.for_inputs(q, k, 0.1)
    assert (kernel.kind, kernel.native_gqa) == ("cuda_fa4", True) and served == [q]
    monkeypatch.setattr(ring, "block_kernel_kind", lambda *_: "cuda_flash")
    assert BlockAttentionKernel.for_inputs(q.float(), k.float(), 0.1).kind == "cuda_flash"  # fp32 blocks: not FA4
    monkeypatch.setattr(backends, "_fa4_first", [False])  # FA4 not first: SDPA's kernels, as before
    assert BlockAttentionKernel.for_inputs(q, k, 0.1).kind == "cuda_flash"
    monkeypatch.setattr(backends, "_fa4_first", [True])
    monkeypatch.setattr(backends, "fa4_serves", lambda query, dropout, pattern: False)  # e.g. on the CPU
    assert BlockAttentionKernel.for_inputs(q, k, 0.1).kind == "cuda_flash"
