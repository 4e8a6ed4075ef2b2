"""Ulysses attention with the all-to-alls overlapped with attention compute (head-chunk pipelining).

Plain Ulysses runs all-to-all(q, k, v) → attention → all-to-all(out) strictly one after the other, so the
exchanges are pure overhead (the gap between SP 2 and the ideal 2× at 32K tokens). Attention heads are
independent, so the heads are cut into `chunks` groups and pipelined: while the attention of group i runs, the
all-to-alls of group i+1's q/k/v (forward) or of group i−1's outputs are in flight on the communicator's own
stream (NCCL); backward does the same with dOut, dQ, dK, dV. Only the first input exchange and the last output
exchange stay exposed, each `1/chunks` of the total.

The attention of a head group is PyTorch's fused SDPA kernel with its log-sum-exp (`ring.BlockAttentionKernel`),
and backward is a custom autograd Function that re-uses the saved outputs, so memory is that of plain Ulysses.
This is an opt-in experiment (`benchmarks/attention_layer.py --overlap`), not wired into the strategy: it is
kept only if the GPU measurements show it pays.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import start_all_to_all
from lightning_ulysses.attention.ring import BlockAttentionKernel


def _exchange_inputs(tensors, group):
    # [batch, heads/C, tokens/P, dim] → [batch, heads/(C·P), tokens, dim]
    return [start_all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in tensors]


def _exchange_outputs(tensors, group):
    # [batch, heads/(C·P), tokens, dim] → [batch, heads/C, tokens/P, dim]
    return [start_all_to_all(t, group, scatter_dim=2, gather_dim=1) for t in tensors]


class _PipelinedUlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, is_causal: bool, scale, chunks: int):
        kernel = BlockAttentionKernel(query, scale)
        pieces = [t.chunk(chunks, dim=1) for t in (query, key, value)]
        incoming = _exchange_inputs([p[0] for p in pieces], group)
        outgoing, saved = [], []
        for index in range(chunks):
            q, k, v = (exchange.wait() for exchange in incoming)
            if index + 1 < chunks:
                incoming = _exchange_inputs([p[index + 1] for p in pieces], group)
            out, lse = kernel.forward(q, k, v, is_causal)
            outgoing += _exchange_outputs([out], group)
            saved += [q, k, v, out, lse]
        output = torch.cat([exchange.wait() for exchange in outgoing], dim=1)
        ctx.save_for_backward(*saved)
        ctx.group, ctx.is_causal, ctx.kernel, ctx.chunks = group, is_causal, kernel, chunks
        return output

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        grads = grad_output.contiguous().chunk(ctx.chunks, dim=1)
        incoming = _exchange_inputs([grads[0]], ctx.group)[0]
        outgoing = []
        for index in range(ctx.chunks):
            grad = incoming.wait()
            if index + 1 < ctx.chunks:
                incoming = _exchange_inputs([grads[index + 1]], ctx.group)[0]
            q, k, v, out, lse = saved[5 * index: 5 * index + 5]
            outgoing.append(_exchange_outputs(ctx.kernel.backward(grad, q, k, v, out, lse, ctx.is_causal), ctx.group))
        grad_query, grad_key, grad_value = (
            torch.cat([exchanges[i].wait() for exchanges in outgoing], dim=1) for i in range(3)
        )
        return grad_query, grad_key, grad_value, None, None, None, None


def pipelined_ulysses_attention(query, key, value, group, is_causal: bool = True, scale: float | None = None,
                                chunks: int = 4) -> torch.Tensor:
    """Ulysses attention over `group` with its all-to-alls overlapped with compute, exact, with backward.

    q: `[batch, heads, tokens/P, dim]`, k/v: `[batch, kv_heads, tokens/P, dim]` (contiguous shards) →
    `[batch, heads, tokens/P, dim]`. Each of the `chunks` head groups must split evenly over the P ranks:
    `heads % (chunks·P) == 0` and `kv_heads % (chunks·P) == 0` (no KV replication here).
    """
    size = dist.get_world_size(group)
    if query.size(1) % (chunks * size) or key.size(1) % (chunks * size):
        raise ValueError(
            f"pipelined Ulysses needs heads ({query.size(1)}) and KV heads ({key.size(1)}) divisible by"
            f" chunks × sequence_parallel_size = {chunks} × {size}: use fewer chunks."
        )
    return _PipelinedUlyssesAttention.apply(query, key, value, group, is_causal, scale, chunks)
