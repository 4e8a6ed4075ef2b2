"""`sdpa_kernel_priority` with "fa4": FlashAttention-4's CuTe kernels serve the calls they compute exactly, SDPA the
others (one process). FA4 runs on Hopper GPUs only, so here a stand-in module of its two entry points (same
signatures and layouts: `[batch, seq, heads, dim]`, or `[tokens, heads, dim]` with `cu_seqlens` keywords, GQA by
fewer KV heads, a `(out, lse)` tuple) computes in float64 per document; what is tested is our side: the layouts,
the keywords, padding dropped and put back, and which calls reach the kernel. The GPU's own numbers are in
`benchmarks/results/2026-12-04-h200-attention-kernels/` (largest difference from cuDNN: 0.004 in the output,
as flash's)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses.attention import backends
from lightning_ulysses.attention.documents import DocumentMask

calls: list[str] = []


def _attend(q, k, v, causal, scale):
    """[seq, heads, dim] → [seq, heads, dim], in float64 (the reference's precision)."""
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None].double() for t in (q, k, v)), is_causal=causal,
                                         scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out[0].transpose(0, 1).to(q.dtype)


def _documents(q, cu_seqlens_q):
    """(start, end) of each document of a `[tokens, heads, dim]` call, or None for `[batch, seq, heads, dim]` rows."""
    if cu_seqlens_q is None:
        return None
    assert cu_seqlens_q.dtype == torch.int32
    bounds = cu_seqlens_q.tolist()
    return list(zip(bounds, bounds[1:]))


def _forward(q, k, v, causal, scale, documents):
    if documents is None:
        return torch.stack([_attend(*rows, causal, scale) for rows in zip(q, k, v)])
    return torch.cat([_attend(q[a:b], k[a:b], v[a:b], causal, scale) for a, b in documents])


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    softmax_scale=None, causal=False, window_size_left=None, window_size_right=None,
                    return_lse=False, **options):
    """The wheel's forward entry point as our operator calls it: (out, lse, p, row_max, o_lo)."""
    assert qv is None and return_lse and window_size_left is None and not options
    documents = _documents(q, cu_seqlens_q)
    if documents is not None:
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max(b - a for a, b in documents)
    calls.append("forward" if documents is None else "varlen forward")
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32)  # not read by the stand-in's backward
    return _forward(q, k, v, causal, softmax_scale, documents), lse, None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, window_size_left=None,
                    window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, **options):
    calls.append("backward")
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        result = _forward(*inputs, causal, softmax_scale, _documents(q, cu_seqlens_q))
        grads = torch.autograd.grad(result, inputs, dout.double())
    return tuple(g.to(q.dtype) for g in grads)


@pytest.fixture
def stand_in(monkeypatch):
    package, cute, interface = (types.ModuleType(name) for name in ("flash_attn", "flash_attn.cute",
                                                                     "flash_attn.cute.interface"))
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    package.cute, cute.interface, package.__path__, cute.__path__ = cute, interface, [], []
    for module in (package, cute, interface):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    # the stand-in serves CPU tensors; every other condition of `fa4_serves` holds as on the GPU
    served = backends.fa4_serves
    monkeypatch.setattr(backends, "fa4_serves", lambda q, dropout, pattern: served(_on_gpu(q), dropout, pattern))
    calls.clear()
    yield


class _on_gpu:
    """A CPU tensor's face as `fa4_serves` reads it, with `is_cuda` true."""

    def __init__(self, tensor):
        self.tensor, self.is_cuda, self.dtype, self.device = tensor, True, tensor.dtype, torch.device("cuda")

    def size(self, dim):
        return self.tensor.size(dim)


def _qkv(batch=2, seq=12, heads=4, kv_heads=2, dim=16, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(batch, n, seq, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads)]


def _reference(q, k, v, documents):
    """Per document, in float64, as `[batch, seq, heads, dim]`; padded tokens 0."""
    out = torch.zeros(q.size(0), q.size(2), q.size(1), q.size(3), dtype=torch.float64)
    for row in range(q.size(0)):
        for start, end in documents[row]:
            out[row, start:end] = _attend(*(t[row, :, start:end].transpose(0, 1) for t in (q, k, v)), True,
                                          None).double()
    return out


def test_fa4_serves_plain_rows_under_the_priority_and_sdpa_outside_it(stand_in):
    q, k, v = _qkv()
    with backends.sdpa_priority(("fa4", "math")):
        out = backends.local_attention(q, k, v, "sdpa")
    assert calls == ["forward"]
    expected = _reference(q, k, v, [[(0, 12)]] * 2)
    assert (out.double() - expected).abs().max() < 1e-2  # bf16 output
    calls.clear()
    backends.local_attention(q, k, v, "sdpa")  # outside the priority: SDPA
    assert calls == []


def test_fa4_packed_rows_run_the_varlen_kernel_with_padding_dropped_and_zeroed(stand_in):
    q, k, v = _qkv()
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, 10:] = False
    documents = DocumentMask.from_rows(2, position_ids, padding)
    with backends.sdpa_priority(("fa4",)):
        out = backends.local_attention(q, k, v, "sdpa", documents)
    assert calls == ["varlen forward"]
    expected = _reference(q, k, v, [[(0, 4), (4, 7), (7, 12)], [(0, 6), (6, 10)]])
    assert (out.double() - expected).abs().max() < 1e-2
    assert out[1, 10:].abs().max() == 0  # padding positions: zeros, as the flash path returns them


@pytest.mark.parametrize("case", ["fp32 without autocast", "dropout", "head dim 12", "chunked"])
def test_calls_fa4_cannot_serve_exactly_stay_with_sdpa(stand_in, case):
    from lightning_ulysses.attention.documents import AttentionPattern

    q, k, v = _qkv(dtype=torch.float32 if case == "fp32 without autocast" else torch.bfloat16,
                   dim=12 if case == "head dim 12" else 16)
    pattern = AttentionPattern(chunk_size=4) if case == "chunked" else None
    with backends.sdpa_priority(("fa4",)):
        backends.local_attention(q, k, v, "sdpa", None, dropout_p=0.1 if case == "dropout" else 0.0, pattern=pattern)
    assert calls == []


def test_fa4_gradients_and_a_checkpointed_recompute_replays_its_outputs(stand_in):
    """The operator's backward gives SDPA's gradients; under `keep_attention_outputs`' recording, a recompute
    replays the forward's outputs instead of running the kernel again (FA4 is one of the kernels it keeps)."""
    from lightning_ulysses.memory.checkpointing import ATTENTION, _KeptOutputs

    q, k, v = (t.requires_grad_() for t in _qkv())
    grad = torch.randn(2, 12, 4, 16).bfloat16()
    with backends.sdpa_priority(("fa4",)):
        out = backends.local_attention(q, k, v, "sdpa")
    grads = torch.autograd.grad(out, (q, k, v), grad)
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(
        F.scaled_dot_product_attention(*reference, is_causal=True, enable_gqa=True).transpose(1, 2), reference,
        grad.double())
    assert calls == ["forward", "backward"]
    for got, want in zip(grads, expected):
        assert (got.double() - want).abs().max() < 2e-2  # bf16 inputs
    calls.clear()
    recorder = _KeptOutputs(None, frozenset({ATTENTION}))
    with torch.no_grad(), recorder, backends.sdpa_priority(("fa4",)):  # the checkpointed forward
        kept = backends.local_attention(q, k, v, "sdpa")
    with recorder.replaying(), backends.sdpa_priority(("fa4",)):  # the recompute
        replayed = backends.local_attention(q, k, v, "sdpa")
    assert calls == ["forward"]  # the recompute ran no kernel
    assert torch.equal(replayed, kept)
    torch.autograd.grad(replayed, (q, k, v), grad)
    assert calls == ["forward", "backward"]  # and its backward is the kernel's


def test_the_priority_names_fa4_only_where_it_is_installed(monkeypatch):
    monkeypatch.setattr(backends, "fa4_installed", lambda: False)
    with pytest.raises(ImportError, match="pip install flash-attn-4"):
        backends.check_sdpa_kernel_priority(("fa4", "cudnn"))
    monkeypatch.setattr(backends, "fa4_installed", lambda: True)
    assert backends.check_sdpa_kernel_priority(("fa4", "cudnn")) == ("fa4", "cudnn")


def test_sdpa_order_of_the_other_names_holds_beside_fa4():
    before = torch._C._get_sdp_priority_order()
    with backends.sdpa_priority(("fa4", "math")):
        assert backends._fa4_first[0]
        assert torch._C._get_sdp_priority_order()[0] == int(torch.nn.attention.SDPBackend.MATH)
    assert not backends._fa4_first[0]
    assert torch._C._get_sdp_priority_order() == before


def test_auto_picks_fa4_then_cudnn_on_hopper_only_where_installed(monkeypatch):
    from lightning_ulysses.planning import auto

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    cuda = torch.device("cuda")
    monkeypatch.setattr(auto, "fa4_installed", lambda: True)
    assert auto.auto_sdpa_kernel(cuda) == ("fa4", "cudnn")
    monkeypatch.setattr(auto, "fa4_installed", lambda: False)
    assert auto.auto_sdpa_kernel(cuda) == ("cudnn",)
    assert auto.auto_sdpa_kernel(torch.device("cpu")) is None
