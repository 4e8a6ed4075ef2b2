"""Mamba2's chunked scan (SSD) in PyTorch, block by block, keeping for backward only its inputs and a state per block.

A Mamba2 head keeps one `[head_dim, state_size]` state; at each token it decays it by `exp(A·dt)`, adds the token's
`dt·x ⊗ B` and reads it with the token's `C`; `D·x` skips past the scan. Chunked (state space duality), a chunk of
`c` tokens is a masked `C·Bᵀ` "attention" weighted by the decays between its positions (`c × c` per head), plus
what the state entering the chunk contributes; the states entering the chunks are a recurrence over chunks.

Why our own: where mamba_ssm is not installed (a CPU, or a GPU image without it), transformers' Mamba2 families
(Mamba2, Nemotron-H, Bamba, Zamba2, Falcon-H1, Granite-MoE-hybrid) fall back to a PyTorch version that computes every
chunk of the row at once and leaves autograd, for backward, the whole row's `c × c` decays and scores per head, B and
C repeated from their groups to every head, and the recurrence over all chunks (a `[chunks + 1]²` decay per head):
about 1 MB per token per layer at Nemotron-H-8B's widths (docs/internals.md), so one layer's backward outgrows a GPU
long before the rest of the model does. Here the row runs in blocks of `BLOCK_TOKENS` tokens (whole chunks) that
carry the state from one to the next; autograd keeps only the inputs and the state entering each block, and the
backward recomputes one block at a time, last to first, carrying the state's gradient back: its transient memory is
one block's, whatever the row's length. Within a block the arithmetic is transformers' (the same decays, products
and recurrence over the block's chunks), save that `C·Bᵀ` and the products with B and C run once per group instead
of once per head; a row of one block differs from transformers' only by rounding, and so does a longer one (its
later blocks start from a carried state instead of a sum over every earlier chunk).

`cu_seqlens` (documents packed in one row) or `seq_idx` (a document index per token): the state restarts at every
document (each runs on its own), which transformers' fallback refuses.

The scan runs inside a `recompute_region(TOKEN_MIXER)`: a checkpointed layer with `keep_token_mixer_outputs` keeps its
forward's products for the layer's recompute (`memory/checkpointing.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lightning_ulysses.parallel.recompute_regions import TOKEN_MIXER, recompute_region

# Tokens per block (rounded down to whole chunks, at least one): what one block's recompute holds in backward
# (roughly 16 fp32 values per head per chunk position per token: about 1 GB for 4096 tokens of 128 heads, chunks of
# 128 tokens; a rank split by heads holds its heads only).
BLOCK_TOKENS = 4096


def mamba2_chunk_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, chunk_size: int, D: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                      dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                      return_final_states: bool = False, z: torch.Tensor | None = None,
                      seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      block_tokens: int | None = None, **_unused):
    """The chunked SSD scan over whole rows; the signature of mamba_ssm's `mamba_chunk_scan_combined` as transformers
    calls it (`mamba2_chunk_scan`).

    `hidden_states`: `[batch, seq, heads, head_dim]`; `dt`: `[batch, seq, heads]` (before `dt_bias`, softplus and the
    limits); `A`: `[heads]` (negative); `B`, `C`: `[batch, seq, groups, state]` (head `h` reads group
    `h // (heads / groups)`); `D`, `dt_bias`: `[heads]`; `initial_states`: `[batch, heads, head_dim, state]`. Returns
    the output `[batch, seq, heads, head_dim]` in float32 (as transformers' fallback), `D` skip included, and the
    final state (float32) when `return_final_states`. `block_tokens`: tokens per block (default `BLOCK_TOKENS`).
    """
    if z is not None:  # (transformers' callers pass None; its fallback would ignore a gate, mamba_ssm's kernel not)
        raise NotImplementedError("mamba2_chunk_scan: a gate `z` inside the scan is not supported; gate its output")
    blocks = max(1, (block_tokens or BLOCK_TOKENS) // chunk_size)
    options = (chunk_size, blocks, dt_softplus, (float(dt_limit[0]), float(dt_limit[1])))
    with recompute_region(TOKEN_MIXER):
        if cu_seqlens is not None or seq_idx is not None:
            output, final = _per_document(hidden_states, dt, A, B, C, D, dt_bias, initial_states, options,
                                          return_final_states, cu_seqlens, seq_idx)
        else:
            output, final = _scan(hidden_states, dt, A, B, C, D, dt_bias, initial_states, options)
    return (output, final) if return_final_states else output


def _scan(x, dt, A, B, C, D, dt_bias, initial_states, options):
    tensors = (x, dt, A, B, C, D, dt_bias, initial_states)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _BlockwiseScan.apply(options, *tensors)
    with torch.no_grad():  # (the same operations as the autograd function's forward: a kept-outputs replay sees them)
        return _forward_blocks(options, *tensors)[:2]


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """`[..., c]` → `[..., c, c]`: entry (i, j) the sum of `a` over positions j+1 … i (0 on the diagonal), −inf above
    it; summed as cumulative sums of masked copies (no difference of two long sums: stable)."""
    c = a.size(-1)
    strictly_lower = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., None].expand(*a.shape, c).masked_fill(~strictly_lower, 0).cumsum(dim=-2)
    return sums.masked_fill(~strictly_lower.logical_or(torch.eye(c, dtype=torch.bool, device=a.device)), -math.inf)


def _block(x, dt, A, B, C, D, dt_bias, state, chunk_size, dt_softplus, dt_limit):
    """One block of whole chunks (the last may end short): its output `[batch, tokens, heads, head_dim]` (float32)
    and the state leaving it (`state`: entering it, or None for zeros)."""
    batch, length, heads, width = x.shape
    groups, size = B.shape[-2:]
    per_group = heads // groups
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    x = x.float()
    skip = None if D is None else D[..., None] * x
    x = x * dt[..., None].float()
    log_decay = A.to(torch.float32) * dt.float()
    pad = (chunk_size - length % chunk_size) % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [batch, chunks, chunk, ...], zero past the row's end
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    # heads as [group, head within group]: B and C are read per group, never repeated to the heads
    x = chunked(x).view(batch, chunks, chunk_size, groups, per_group, width)
    B, C = chunked(B.float()), chunked(C.float())
    log_decay = chunked(log_decay).permute(0, 3, 1, 2)  # [batch, heads, chunks, chunk]
    cumulative = log_decay.cumsum(dim=-1)  # from the chunk's start to each position

    # within each chunk: C·Bᵀ per group, weighted per head by the decay between the positions (causal)
    scores = torch.einsum("bklgn,bksgn->bkgls", C, B)
    decays = _segment_sums(log_decay).exp().view(batch, groups, per_group, chunks, chunk_size, chunk_size)
    weights = scores[:, :, :, None] * decays.permute(0, 3, 1, 2, 4, 5)  # [batch, chunks, groups, per_group, l, s]
    within = torch.einsum("bkgrls,bksgrp->bklgrp", weights, x)

    # each chunk's contribution to the state at its end
    to_end = (cumulative[..., -1:] - cumulative).exp()  # [batch, heads, chunks, chunk]
    x_to_end = x * to_end.permute(0, 2, 3, 1).reshape(batch, chunks, chunk_size, groups, per_group, 1)
    contributions = torch.einsum("bklgn,bklgrp->bkgrpn", B, x_to_end).reshape(batch, chunks, heads, width, size)

    # the states entering each chunk and leaving the block: over the block's chunks, each state decayed to every later
    # chunk's start (the block's entering state counts as the contribution of a chunk before the first)
    entering = (torch.zeros_like(contributions[:, :1]) if state is None
                else state[:, None].to(dtype=contributions.dtype, device=contributions.device))
    contributions = torch.cat([entering, contributions], dim=1)
    between = _segment_sums(F.pad(cumulative[..., -1], (1, 0))).exp()  # [batch, heads, chunks + 1, chunks + 1]
    states = torch.einsum("bhcz,bzhpn->bchpn", between, contributions)
    # (the state leaving the block is kept for the next block's backward: a copy of its own, not a view that would
    # hold every chunk's state alive)
    entering, leaving = states[:, :-1], states[:, -1].clone()

    # what the state entering each chunk gives its positions, decayed from the chunk's start
    from_start = cumulative.exp().permute(0, 2, 3, 1).reshape(batch, chunks, chunk_size, groups, per_group, 1)
    entering = entering.view(batch, chunks, groups, per_group, width, size)
    carried = torch.einsum("bklgn,bkgrpn->bklgrp", C, entering) * from_start

    output = (within + carried).reshape(batch, chunks * chunk_size, heads, width)[:, :length]
    if skip is not None:
        output = output + skip
    return output, leaving


def _forward_blocks(options, x, dt, A, B, C, D, dt_bias, initial_states):
    """The row block by block: its output, the final state, and the state entering each block (None: zeros)."""
    chunk_size, chunks_per_block, dt_softplus, dt_limit = options
    step = chunk_size * chunks_per_block
    state, outputs, entering = initial_states, [], []
    for start in range(0, max(x.size(1), 1), step):
        end = start + step
        entering.append(state)
        output, state = _block(x[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], D, dt_bias,
                               state, chunk_size, dt_softplus, dt_limit)
        outputs.append(output)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return output, state, entering


class _BlockwiseScan(torch.autograd.Function):
    """The scan keeping only its inputs and the state entering each block; backward recomputes a block at a time."""

    @staticmethod
    def forward(ctx, options, x, dt, A, B, C, D, dt_bias, initial_states):
        output, final, entering = _forward_blocks(options, x, dt, A, B, C, D, dt_bias, initial_states)
        ctx.options = options
        ctx.set_materialize_grads(False)  # (an unused final state: no gradient to carry)
        # the recompute runs under the autocast the forward ran under (a product in bf16 there is one here too)
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.initial_given = [state is not None for state in entering]
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, *[state for state in entering if state is not None])
        return output, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, output_grad, final_grad):
        x, dt, A, B, C, D, dt_bias, *given = ctx.saved_tensors
        given = iter(given)
        entering = [next(given) if present else None for present in ctx.initial_given]
        chunk_size, chunks_per_block, dt_softplus, dt_limit = ctx.options
        step = chunk_size * chunks_per_block
        wanted = ctx.needs_input_grad[1:]  # x, dt, A, B, C, D, dt_bias, initial_states
        shared = {index: None for index in (2, 5, 6) if wanted[index]}  # A, D, dt_bias: summed over the blocks
        per_token = {index: [] for index in (0, 1, 3, 4) if wanted[index]}  # x, dt, B, C: joined once
        state_grad = final_grad
        device, autocast, dtype = ctx.autocast
        starts = list(range(0, max(x.size(1), 1), step))
        for block, start in reversed(list(enumerate(starts))):
            end = start + step
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=autocast):
                inputs = [t[:, start:end] for t in (x, dt)] + [A] + [t[:, start:end] for t in (B, C)] + [D, dt_bias]
                inputs = [None if t is None else t.detach().requires_grad_(index in shared or index in per_token)
                          for index, t in enumerate(inputs)]
                state = entering[block]
                state_needed = state is not None and (block > 0 or wanted[7])
                if state is not None:
                    state = state.detach().requires_grad_(state_needed)
                output, leaving = _block(*inputs[:7], state, chunk_size, dt_softplus, dt_limit)
            indices = sorted({*shared, *per_token})
            sources = [inputs[index] for index in indices] + ([state] if state_needed else [])
            block_grad = None if output_grad is None else output_grad[:, start:end]
            pairs = [(o, g) for o, g in ((output, block_grad), (leaving, state_grad)) if g is not None]
            grads = (torch.autograd.grad([o for o, _ in pairs], sources, [g for _, g in pairs], allow_unused=True)
                     if pairs else [None] * len(sources))
            state_grad = grads[-1] if state_needed else None  # carried back to the block before
            for index, grad in zip(indices, grads):
                if index in shared:
                    if grad is not None:
                        shared[index] = grad if shared[index] is None else shared[index] + grad
                else:
                    per_token[index].append(torch.zeros_like(inputs[index]) if grad is None else grad)
        result = [None] * 8
        for index, pieces in per_token.items():
            result[index] = torch.cat(pieces[::-1], dim=1) if len(pieces) > 1 else pieces[0]
        for index, total in shared.items():
            result[index] = total
        if wanted[7]:
            result[7] = state_grad
        return (None, *result)


def _document_bounds(length: int, batch: int, cu_seqlens, seq_idx) -> list[list[tuple[int, int]]]:
    """Per row, the `(start, end)` of each document."""
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"cu_seqlens describes documents packed in one row; got a batch of {batch} rows")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != length:
            raise ValueError(f"cu_seqlens {bounds} does not cover the row of {length} tokens")
        return [list(zip(bounds[:-1], bounds[1:]))]
    rows = []
    for row in seq_idx.expand(batch, length).tolist():
        cuts = [0] + [i for i in range(1, length) if row[i] != row[i - 1]] + [length]
        rows.append(list(zip(cuts[:-1], cuts[1:])))
    return rows


def _per_document(x, dt, A, B, C, D, dt_bias, initial_states, options, return_final_states, cu_seqlens, seq_idx):
    """Packed documents: each runs on its own, from no state (or, with `cu_seqlens`, its row of `initial_states`);
    the final states are each document's (`cu_seqlens`), as mamba_ssm's variable-length scan returns them."""
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise NotImplementedError("mamba2_chunk_scan: with seq_idx, no initial or final states (pass cu_seqlens)")
    outputs, finals = [], []
    for row, spans in enumerate(_document_bounds(x.size(1), x.size(0), cu_seqlens, seq_idx)):
        pieces = []
        for index, (start, end) in enumerate(spans):
            state = None if initial_states is None else initial_states[index:index + 1]
            output, final = _scan(x[row:row + 1, start:end], dt[row:row + 1, start:end], A,
                                  B[row:row + 1, start:end], C[row:row + 1, start:end], D, dt_bias, state, options)
            pieces.append(output)
            finals.append(final)
        outputs.append(torch.cat(pieces, dim=1))
    return torch.cat(outputs, dim=0), (torch.cat(finals) if return_final_states else None)
