"""Decoding from a sequence-parallel prefill (`lightning_ulysses.integration.inference.generate`): the state on the binding and
the exact attention of one new token over a KV cache split across the SP group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class DecodeState:
    """Set by `lightning_ulysses.integration.inference.generate` while it decodes from a sequence-parallel prefill.

    After the prefill, every rank's KV cache holds its own shard of the prompt (`shard_length` positions starting
    at `first_position`, as `ShardOrder` cut it; the last ones padding beyond `prompt_length`), followed by every
    generated token (appended on all ranks alike, so they are counted on SP rank 0 only).
    """

    prompt_length: int
    shard_length: int
    first_position: int
    rank: int
    prefilled: bool = False


def _decode_attention(query, key, value, state: DecodeState, group, scaling: Optional[float]) -> torch.Tensor:
    """One new token attending to a KV cache that is split over the SP group: exact softmax across ranks.

    Each rank scores the query against the keys it owns, then the per-rank maxima, normalisers and weighted
    values are combined (the log-sum-exp merge of flash-decoding), so no rank ever gathers the cache.
    query: [batch, heads, 1, dim]; key/value: [batch, kv_heads, shard + generated, dim] → [batch, 1, heads, dim].
    """
    heads, cached = query.size(1), key.size(2)
    key = key.repeat_interleave(heads // key.size(1), dim=1).float()
    value = value.repeat_interleave(heads // value.size(1), dim=1).float()
    scaling = scaling if scaling is not None else query.size(-1) ** -0.5
    scores = (query.float() @ key.transpose(-1, -2)) * scaling  # [batch, heads, 1, cached]
    index = torch.arange(cached, device=query.device)
    prompt = (index < state.shard_length) & (state.first_position + index < state.prompt_length)
    generated = (index >= state.shard_length) & (state.rank == 0)
    scores = scores.masked_fill(~(prompt | generated), float("-inf"))
    local_max = scores.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isinf(local_max), torch.zeros_like(local_max), local_max)
    weights = torch.exp(scores - safe_max)
    pieces = [weights.sum(dim=-1, keepdim=True), weights @ value, local_max]
    gathered = [[torch.empty_like(t) for _ in range(dist.get_world_size(group))] for t in pieces]
    for out, piece in zip(gathered, pieces):
        dist.all_gather(out, piece.contiguous(), group=group)
    sums, outputs, maxima = (torch.stack(g) for g in gathered)
    global_max = maxima.amax(dim=0)
    scale = torch.where(torch.isinf(maxima), torch.zeros_like(maxima), torch.exp(maxima - global_max))
    output = (scale * outputs).sum(dim=0) / (scale * sums).sum(dim=0)
    return output.to(query.dtype).transpose(1, 2)
