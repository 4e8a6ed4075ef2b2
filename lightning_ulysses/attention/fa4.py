"""FlashAttention-4's CuTe kernels (`flash-attn-4`, `flash_attn.cute`) as one torch operator.

The wheel's public functions are `torch.autograd.Function`s that launch their kernels outside torch's dispatcher, so
what works on SDPA's kernels by watching the dispatcher would not see them: `keep_attention_outputs` records the
attention kernels' outputs in a checkpointed layer's forward and replays them in its recompute (a dispatch mode,
memory/checkpointing.py). Registered as the operator `lightning_ulysses::fa4_attention` (forward: output and
log-sum-exp; its backward through autograd), FA4 is one more kernel that mode records, and the recompute skips it as
it skips cuDNN's.

It calls the wheel's forward and backward entry points, `_flash_attn_fwd` / `_flash_attn_bwd` of
`flash_attn.cute.interface` (verified on flash-attn-4 4.0.0b40: the functions its own autograd Function calls, with
the arguments used here; docs/internals.md). The log-sum-exp is an output for the backward only: the attention
backends drop it, so its gradient is never anything but zero and is not passed on.

Ring attention (attention/ring.py) attends its blocks with the operator's forward (output and log-sum-exp, which
it merges block by block) and differentiates each block with `block_backward` against the *merged* output and
log-sum-exp, as it does with SDPA's kernels (the flash backward identity); its own autograd Function holds them.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

OPERATOR_NAME = "lightning_ulysses::fa4_attention"


def _interface():
    return importlib.import_module("flash_attn.cute.interface")


def _window(size: int) -> Optional[int]:
    return None if size < 0 else size


@torch.library.custom_op(OPERATOR_NAME, mutates_args=())
def fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                  max_seqlen: int, scale: Optional[float], causal: bool, window_left: int,
                  window_right: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `[batch, seq, heads, dim]` rows, or of `[tokens, heads, dim]` documents at `cu_seqlens` (int32;
    `max_seqlen` the longest); GQA by fewer key/value heads; windows: -1 for none. Returns (output, log-sum-exp)."""
    varlen = {} if cu_seqlens is None else {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens,
                                             "max_seqlen_q": max_seqlen, "max_seqlen_k": max_seqlen}
    output, log_sumexp, *_ = _interface()._flash_attn_fwd(
        query, key, value, softmax_scale=scale, causal=causal, window_size_left=_window(window_left),
        window_size_right=_window(window_right), return_lse=True, **varlen)
    return output, log_sumexp


def _save(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, max_seqlen, scale, causal, window_left, window_right = inputs
    ctx.save_for_backward(query, key, value, output[0], output[1], cu_seqlens)
    ctx.options = dict(softmax_scale=scale, causal=causal, window_size_left=_window(window_left),
                       window_size_right=_window(window_right))
    if cu_seqlens is not None:
        ctx.options.update(max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


def _backward(ctx, grad_output, grad_log_sumexp):
    query, key, value, output, log_sumexp, cu_seqlens = ctx.saved_tensors
    varlen = {} if cu_seqlens is None else {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens}
    dq, dk, dv = _interface()._flash_attn_bwd(query, key, value, output, grad_output.contiguous(), log_sumexp,
                                              **ctx.options, **varlen)[:3]
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd(OPERATOR_NAME, _backward, setup_context=_save)


def block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float],
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp `[batch, heads, rows]`, fp32, natural log of the scaled scores) of `[batch, rows, heads,
    dim]` queries on `[batch, cols, kv_heads, dim]` keys and values."""
    return torch.ops.lightning_ulysses.fa4_attention(query, key, value, None, 0, scale, causal, -1, -1)


def block_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                   grad_output: torch.Tensor, log_sumexp: torch.Tensor, scale: Optional[float],
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk (KV heads), dv of one block against the `output` and `log_sumexp` given (the ring's merged ones),
    layouts as `block_forward`'s."""
    return tuple(_interface()._flash_attn_bwd(query, key, value, output, grad_output.contiguous(), log_sumexp,
                                              softmax_scale=scale, causal=causal)[:3])


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
           max_seqlen: int = 0, scale: Optional[float] = None, causal: bool = True,
           window: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """The attention output alone, as the flash kernels' `flash_attn_func` / `flash_attn_varlen_func` return it."""
    left, right = window if window is not None else (-1, -1)
    return torch.ops.lightning_ulysses.fa4_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal,
                                                     left, right)[0]
