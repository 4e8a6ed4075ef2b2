"""The Ulysses attention core, shared by the Hugging Face integration and by native models.

Each SP rank holds `seq/P` tokens of every head. Before attention an all-to-all turns that into all `seq`
tokens of `heads/P` heads; the local attention runs unchanged on full sequences; a second all-to-all turns the
output back. With fewer KV heads than SP ranks (GQA/MQA) each KV head is replicated so that every rank gets
the one KV head its query heads use; replication is a `repeat_interleave`, so its gradient sums back exactly.

When the SP group is split into `ulysses_size × ring_size` (`hybrid_attention`), the all-to-alls run inside the
Ulysses sub-group only and ring attention (attention/ring.py) takes the place of the local attention, spanning
the ring sub-group: the SP size is then no longer capped by the head counts.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.attention.all_to_all import heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention.ring import ring_attention


def validate_head_counts(num_heads: int, num_key_value_heads: int, sequence_parallel_size: int) -> None:
    """Raise a fix-naming error unless Ulysses can split these heads over `sequence_parallel_size` ranks."""
    sp = sequence_parallel_size
    if num_heads % sp != 0:
        valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"num_attention_heads({num_heads}) is not divisible by sequence_parallel_size({sp}): Ulysses gives every"
            f" SP rank heads/sp whole heads. Use a sequence_parallel_size in {valid} (and dividing the number of"
            " processes), or a model whose head count is a multiple of it."
        )
    if num_key_value_heads % sp != 0 and sp % num_key_value_heads != 0:
        raise ValueError(
            f"num_key_value_heads({num_key_value_heads}) and sequence_parallel_size({sp}) must divide one another:"
            " KV heads are either split over the SP ranks (kv % sp == 0) or replicated (sp % kv == 0). Use a"
            f" sequence_parallel_size that divides or is a multiple of {num_key_value_heads}."
        )
    if num_heads % num_key_value_heads != 0:
        raise ValueError(f"num_attention_heads({num_heads}) must be a multiple of num_key_value_heads({num_key_value_heads})")


def resolve_ring_size(head_counts: list[tuple[int, int]], sequence_parallel_size: int, ring_size: int | None) -> int:
    """How many of the SP ranks form the ring (the rest split heads with Ulysses), for models with these
    `(heads, kv_heads)` pairs.

    `ring_size=None` (automatic): the largest Ulysses degree that every pair allows (`validate_head_counts`: heads
    split evenly, KV heads split or replicated), the ring takes the rest — pure Ulysses whenever the heads allow
    it. An explicit `ring_size` is checked against the heads (its divisibility of the SP size is the layout's).
    """
    sp = sequence_parallel_size

    def failure(ulysses_size: int) -> ValueError | None:
        for num_heads, num_key_value_heads in head_counts:
            try:
                validate_head_counts(num_heads, num_key_value_heads, ulysses_size)
            except ValueError as error:
                return error
        return None

    inconsistent = failure(1)
    if inconsistent is not None:
        raise inconsistent  # no split at all works: the model itself is inconsistent
    valid = [ring for ring in range(1, sp + 1) if sp % ring == 0 and failure(sp // ring) is None]
    if ring_size is None:
        return valid[0]
    error = failure(sp // ring_size)
    if error is not None:
        raise ValueError(
            f"ring_size({ring_size}) leaves ulysses_size = sequence_parallel_size({sp}) / ring_size = {sp // ring_size},"
            f" which the model's heads cannot be split over ({error}). Use a ring_size in {valid}, or ring_size=None"
            f" (automatic, here {valid[0]})."
        )
    return ring_size


def kv_replication_factor(num_key_value_heads: int, sequence_parallel_size: int) -> int:
    """How many copies of each KV head are needed so that every SP rank receives at least one."""
    return max(1, sequence_parallel_size // num_key_value_heads)


def scatter_heads_gather_sequence(query, key, value, group, head_dim: int, seq_dim: int):
    """Validate, replicate KV heads where needed, and run the first all-to-all on q, k and v."""
    sp = dist.get_world_size(group)
    validate_head_counts(query.size(head_dim), key.size(head_dim), sp)
    factor = kv_replication_factor(key.size(head_dim), sp)
    if factor > 1:
        key = key.repeat_interleave(factor, dim=head_dim)
        value = value.repeat_interleave(factor, dim=head_dim)
    return tuple(sequence_to_heads(t, group, head_dim=head_dim, seq_dim=seq_dim) for t in (query, key, value))


def hybrid_attention(query, key, value, ulysses_group, ring_group, is_causal: bool, scale: float | None = None):
    """Ulysses all-to-all inside `ulysses_group`, ring attention across `ring_group`, all-to-all back.

    q/k/v: `[batch, heads, tokens, dim]` of this SP rank's tokens in the zig-zag layout (`layout.ShardOrder`);
    after the all-to-all each rank holds its ring rank's two chunks for `heads / ulysses_size` heads, the same
    heads as the other ranks of its ring. Either group may be None (pure ring / pure Ulysses).
    """
    ulysses = ProcessGroupHandle(ulysses_group).world_size > 1
    if ulysses:
        query, key, value = scatter_heads_gather_sequence(query, key, value, ulysses_group, head_dim=1, seq_dim=2)
    output = ring_attention(query, key, value, ring_group, is_causal, scale)
    return heads_to_sequence(output, ulysses_group, head_dim=1, seq_dim=2) if ulysses else output


class ProcessGroupHandle:
    """Holds a process group on a module without making the module un-copyable.

    Process groups are communicator handles, not data: a deep copy of a module (EMA copies, `copy.deepcopy`
    in callbacks) must share them rather than fail trying to copy them.
    """

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)


class UlyssesAttention(nn.Module):
    """Wraps any local attention callable with the Ulysses all-to-alls, for models that are not Hugging Face's.

    `local_attention(query, key, value, **kwargs)` takes and returns `[batch, heads, seq, head_dim]` tensors
    (the layout of `F.scaled_dot_product_attention`, the default); with fewer KV heads than query heads it must
    handle GQA itself (e.g. `enable_gqa=True` for SDPA). `UlyssesDeepSpeedStrategy` binds the SP group at
    setup; unbound (or with an SP group of one rank) this is exactly `local_attention`.

    With a ring (`ring_size > 1`) the ring computes softmax attention itself (its blocks must return their
    log-sum-exp), so it cannot call an opaque `local_attention`: declare what that is with `causal=True/False`
    (plain softmax attention with the default scale, or `scale`). `num_heads`/`num_key_value_heads` let the
    strategy pick the Ulysses × ring split automatically (`ring_size=None`).
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
        *,
        causal: bool | None = None,
        scale: float | None = None,
        num_heads: int | None = None,
        num_key_value_heads: int | None = None,
    ):
        super().__init__()
        self.local_attention = local_attention
        self.causal, self.scale = causal, scale
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        self._group = ProcessGroupHandle(None)
        self._ring = ProcessGroupHandle(None)

    def bind(self, sequence_parallel_group, ring_group=None) -> None:
        """Heads are scattered over `sequence_parallel_group` (the Ulysses group); K/V blocks pass around `ring_group`."""
        if ring_group is not None and self.causal is None:
            raise ValueError(
                "ring attention computes softmax attention itself instead of calling local_attention: construct"
                " UlyssesAttention(..., causal=True) (or causal=False) to declare that local_attention is plain"
                " softmax attention, or use ring_size=1 (pure Ulysses)."
            )
        self._group = ProcessGroupHandle(sequence_parallel_group)
        self._ring = ProcessGroupHandle(ring_group)

    def bind_parallel_groups(self, groups) -> None:
        """Called by `UlyssesDeepSpeedStrategy` with its `SequenceParallelGroups` at setup, and with None to unbind."""
        sharded = groups is not None and groups.sequence_parallel_world_size > 1
        self.bind(groups.ulysses_group if sharded else None, groups.ring_group if sharded else None)

    @property
    def sequence_parallel_group(self):
        return self._group.group

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
        group = self._group.group
        if self._ring.group is not None:
            if kwargs:
                raise TypeError(f"ring attention takes no extra attention arguments, got {sorted(kwargs)}")
            return hybrid_attention(query, key, value, group, self._ring.group, self.causal, self.scale)
        if self._group.world_size == 1:
            return self.local_attention(query, key, value, **kwargs)
        query, key, value = scatter_heads_gather_sequence(query, key, value, group, head_dim=1, seq_dim=2)
        output = self.local_attention(query, key, value, **kwargs)
        return heads_to_sequence(output, group, head_dim=1, seq_dim=2)
