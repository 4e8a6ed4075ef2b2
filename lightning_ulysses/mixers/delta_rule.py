"""The gated delta rule in PyTorch, chunked, in time and memory linear in the row's length.

Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid, ...) keeps one `[key_dim, value_dim]` state per value head and,
at each token, decays it by `exp(g)`, corrects what it predicts for the token's key towards the token's value with
step `beta` (the delta rule), and reads it with the token's query. Chunked (the WY form), a chunk of `C` tokens is
a few matmuls: within the chunk, a unit-lower-triangular system turns the `C` sequential corrections into one
(`solve_triangular`); across chunks, the state is carried from one chunk to the next.

Why our own: where flash-linear-attention is not installed (a CPU, or a GPU whose Triton fla refuses), transformers
falls back to a PyTorch version whose loop over chunks indexes each chunk out of whole-row tensors and writes each
chunk's output into a preallocated tensor in place. Autograd's backward of each such index and write materialises
a gradient of the whole row, once per chunk: its backward is quadratic in the row's length (on an H200, one layer
of Qwen3-Next's widths: 1.5 s at 32K, 21 s at 128K; 90% of it filling and adding those whole-row gradients). Here
each tensor is taken apart into its chunks once (`unbind`) and the chunks' outputs are joined once (`stack`),
whose backwards are linear. The arithmetic is the same (the same operations in the same order), so its results
match the fallback's to the last bit on the rows both take.

`cu_seqlens` (packed documents, one row): the state restarts at every document boundary — each document runs on
its own — where transformers' fallback silently ignores the boundaries.

The rule runs inside a `recompute_region(TOKEN_MIXER)`: a checkpointed layer with `keep_token_mixer_outputs` keeps
its products (slow per byte to recompute: many small ones per chunk) and recomputes the rest
(`memory/checkpointing.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_ulysses.parallel.recompute_regions import TOKEN_MIXER, recompute_region


def _l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # as flash-linear-attention normalises (and transformers' fallback with it): x / sqrt(|x|^2 + eps)
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **_unused) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole rows; the signature of flash-linear-attention's `chunk_gated_delta_rule`.

    `query`, `key`: `[batch, seq, key_heads, key_dim]`; `value`: `[batch, seq, value_heads, value_dim]` (each key
    head serves `value_heads / key_heads` consecutive value heads); `g` (log decay, ≤ 0) and `beta`:
    `[batch, seq, value_heads]`; `initial_state`: `[batch, value_heads, key_dim, value_dim]`. Returns the output
    `[batch, seq, value_heads, value_dim]` in `query`'s dtype, and the final state when `output_final_state`.
    """
    with recompute_region(TOKEN_MIXER):
        return _chunk_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                                       use_qk_l2norm_in_kernel, cu_seqlens)


def _chunk_gated_delta_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, cu_seqlens):
    if cu_seqlens is not None:
        return _per_document(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens)
    dtype = query.dtype
    batch, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if key_heads != value_heads:
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    # [batch, heads, seq, dim] in float32: the state accumulates over the whole row
    query, key, value, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = _l2_normalised(query), _l2_normalised(key)
    query = query * key_dim ** -0.5

    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, chunks, chunk_size, ...]
        return x.reshape(x.shape[0], x.shape[1], chunks, chunk_size, *x.shape[3:])

    value_step, key_step = chunked(value * beta.unsqueeze(-1)), chunked(key * beta.unsqueeze(-1))
    query, key, g = chunked(query), chunked(key), chunked(g)
    decay = g.cumsum(dim=-1)  # log decay from the chunk's start to each position
    # decay between positions j ≤ i of a chunk (0 above the diagonal: the future)
    above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()
    # the chunk's corrections, solved at once: (I + strictly-lower(beta k k^T decay)) x = rhs
    corrections = (key_step @ key.transpose(-1, -2)) * pairwise
    within = (query @ key.transpose(-1, -2)) * pairwise  # the causal query-key products inside a chunk
    values = torch.linalg.solve_triangular(corrections, value_step, upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(corrections, key_step * decay.exp().unsqueeze(-1), upper=False,
                                                unitriangular=True)
    query = query * decay.exp().unsqueeze(-1)
    key = key * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]

    state = (torch.zeros(batch, value_heads, key_dim, value_dim, dtype=values.dtype, device=values.device)
             if initial_state is None else initial_state.to(values))
    outputs = []
    # (each chunk's tensors taken apart once: indexing a chunk out of the whole tensor would, in backward, build a
    # whole-size gradient per chunk; unbind's backward joins the chunks' gradients once)
    for values_i, reads_i, query_i, within_i, key_i, decay_i in zip(
            *(x.unbind(dim=2) for x in (values, state_reads, query, within, key, chunk_decay))):
        new_values = values_i - reads_i @ state  # what the state does not already predict
        outputs.append(query_i @ state + within_i @ new_values)
        state = state * decay_i + key_i.transpose(-1, -2) @ new_values
    output = torch.stack(outputs, dim=2).reshape(batch, value_heads, -1, value_dim)[:, :, :length]
    output = output.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
    return output, (state if output_final_state else None)


def _per_document(query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm,
                  cu_seqlens):
    """Packed documents in one row: each runs on its own, from `initial_state`'s row for it (or none)."""
    if query.size(0) != 1:
        raise ValueError(f"cu_seqlens describes documents packed in one row; got a batch of {query.size(0)} rows")
    bounds = cu_seqlens.tolist()
    outputs, states = [], []
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else initial_state[index:index + 1]
        output, final = _chunk_gated_delta_rule(
            query[:, start:end], key[:, start:end], value[:, start:end], g[:, start:end], beta[:, start:end],
            chunk_size, state, output_final_state, use_qk_l2norm, None)
        outputs.append(output)
        states.append(final)
    return torch.cat(outputs, dim=1), (torch.cat(states) if output_final_state else None)
