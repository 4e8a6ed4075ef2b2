"""The Ulysses attention core, shared by the Hugging Face integration and by native models.

Each SP rank holds `seq/P` tokens of every head. Before attention an all-to-all turns that into all `seq`
tokens of `heads/P` heads; the local attention runs unchanged on full sequences; a second all-to-all turns the
output back. With fewer KV heads than SP ranks (GQA/MQA) each KV head is replicated so that every rank gets
the one KV head its query heads use; replication is a `repeat_interleave`, so its gradient sums back exactly.

`ulysses_attention` is the one core both model families run: `UlyssesAttention` (native models) and the
Hugging Face attention function (attention/hf.py) call it with a backend name (attention/backends.py). Packed
documents and padding are read from the *gathered* whole-row positions and mask (attention/documents.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses.attention.all_to_all import all_gather_sequence, heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention.backends import BACKENDS, check_backend, local_attention
from lightning_ulysses.attention.documents import DocumentMask


def valid_sequence_parallel_sizes(num_heads: int, num_key_value_heads: int) -> list[int]:
    """SP sizes Ulysses can split these heads over: they divide the heads and divide or are divided by the KV heads."""
    return [
        size for size in range(1, num_heads + 1)
        if num_heads % size == 0 and (num_key_value_heads % size == 0 or size % num_key_value_heads == 0)
    ]


def validate_head_counts(num_heads: int, num_key_value_heads: int, sequence_parallel_size: int) -> None:
    """Raise a fix-naming error unless Ulysses can split these heads over `sequence_parallel_size` ranks.

    Head counts the SP size does not divide are rejected rather than split unevenly: the rank with the most heads
    sets the attention time (ceil(heads / sp) heads), so an uneven split is no faster than the next valid size
    below it, and with GQA it would also have to send some KV heads to two ranks.
    """
    sp = sequence_parallel_size
    if num_heads % num_key_value_heads != 0:
        raise ValueError(f"num_attention_heads({num_heads}) must be a multiple of num_key_value_heads({num_key_value_heads})")
    valid = valid_sequence_parallel_sizes(num_heads, num_key_value_heads)
    if sp in valid:
        return
    fix = (
        f" Use a sequence_parallel_size in {valid} (and dividing the number of processes); for SP sizes the heads"
        " do not divide (or larger than the heads), run ring attention across the ranks beyond a valid Ulysses size"
        " (the hybrid Ulysses + ring layout)."
    )
    if num_heads % sp != 0:
        raise ValueError(
            f"num_attention_heads({num_heads}) is not divisible by sequence_parallel_size({sp}): Ulysses gives every"
            f" SP rank heads/sp whole heads, and does not split heads unevenly.{fix}"
        )
    raise ValueError(
        f"num_key_value_heads({num_key_value_heads}) and sequence_parallel_size({sp}) must divide one another:"
        " KV heads are either split over the SP ranks (kv % sp == 0) or replicated (sp % kv == 0)." + fix
    )


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


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    backend: str = "sdpa",
    position_ids: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of this rank's shard: `[batch, heads, seq/P, dim]` q/k/v → `[batch, seq/P, heads, dim]`.

    `position_ids` (global positions, `[batch or 1, seq/P]`) mark packed documents where they do not continue by
    one; `padding_mask` (`[batch, seq/P]`, 1 = real token) marks padding. Both are gathered whole, so a document
    crossing a shard boundary stays one document. `group` None (or of one rank): plain local attention.
    """
    sharded = group is not None and dist.get_world_size(group) > 1
    if sharded:
        query, key, value = scatter_heads_gather_sequence(query, key, value, group, head_dim=1, seq_dim=2)
        if position_ids is not None:
            position_ids = all_gather_sequence(position_ids, group, seq_dim=1)
        if padding_mask is not None:
            padding_mask = all_gather_sequence(padding_mask.bool(), group, seq_dim=1)
    documents = DocumentMask.from_rows(query.size(0), position_ids, padding_mask)
    output = local_attention(query, key, value, backend, documents, is_causal, scale, dropout_p)
    # output: [batch, seq, heads/P, dim] -> [batch, seq/P, heads, dim]
    return heads_to_sequence(output, group, head_dim=2, seq_dim=1) if sharded else output


class UlyssesAttention(nn.Module):
    """Ulysses attention for models that are not Hugging Face's.

    `backend` is a backend name (`"sdpa"`, `"flash_attention_2"`, `"flash_attention_3"`, `"flex_attention"`):
    `forward(q, k, v, position_ids=None, attention_mask=None, *, is_causal=True, scale=None, dropout_p=0.0)` then
    runs `ulysses_attention`, the core Hugging Face models use too, so packed rows (`position_ids`) and padding
    (`attention_mask`) are handled, sharded or not. `backend` may instead be your own local attention callable
    `fn(q, k, v, **kwargs)`, which sees whole rows of its heads and must handle GQA (e.g. `enable_gqa=True`) and
    any masking itself. q, k, v and the output are `[batch, heads, seq, head_dim]`. `UlyssesDeepSpeedStrategy`
    binds the SP group at setup; unbound (or with an SP group of one rank) nothing is exchanged.
    """

    def __init__(self, backend: Union[str, Callable[..., torch.Tensor]] = "sdpa"):
        super().__init__()
        if not callable(backend) and backend not in BACKENDS:
            check_backend(backend)  # raises the fix-naming error
        self.backend = backend
        self._group = ProcessGroupHandle(None)

    def bind(self, sequence_parallel_group) -> None:
        self._group = ProcessGroupHandle(sequence_parallel_group)

    def bind_parallel_groups(self, groups) -> None:
        """Called by `UlyssesDeepSpeedStrategy` with its `SequenceParallelGroups` at setup, and with None to unbind."""
        if groups is not None and not callable(self.backend):
            check_backend(self.backend)  # an unavailable backend fails at setup, before any collective
        sharded = groups is not None and groups.sequence_parallel_world_size > 1
        self.bind(groups.sequence_parallel_group if sharded else None)

    @property
    def sequence_parallel_group(self):
        return self._group.group

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs) -> torch.Tensor:
        group = self._group.group if self._group.world_size > 1 else None
        if callable(self.backend):
            return self._custom_attention(query, key, value, group, position_ids, attention_mask, **kwargs)
        output = ulysses_attention(query, key, value, group, self.backend, position_ids, attention_mask, **kwargs)
        return output.transpose(1, 2)

    def _custom_attention(self, query, key, value, group, position_ids, attention_mask, **kwargs):
        if position_ids is not None or attention_mask is not None:
            raise TypeError(
                "UlyssesAttention with a custom local attention callable does not read position_ids or"
                " attention_mask (packed documents, padding): pass a backend name, e.g. UlyssesAttention('sdpa')."
            )
        if group is None:
            return self.backend(query, key, value, **kwargs)
        query, key, value = scatter_heads_gather_sequence(query, key, value, group, head_dim=1, seq_dim=2)
        output = self.backend(query, key, value, **kwargs)
        return heads_to_sequence(output, group, head_dim=1, seq_dim=2)
