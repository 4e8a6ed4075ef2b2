"""The Ulysses attention core, shared by the Hugging Face integration and by native models.

Each SP rank holds `seq/P` tokens of every head. Before attention an all-to-all turns that into all `seq`
tokens of `heads/P` heads; the local attention runs unchanged on full sequences; a second all-to-all turns the
output back. With fewer KV heads than SP ranks (GQA/MQA) each KV head is replicated so that every rank gets
the one KV head its query heads use; replication is a `repeat_interleave`, so its gradient sums back exactly.

`ulysses_attention` is the one core both model families run: `UlyssesAttention` (native models) and the
Hugging Face attention function (hf/forward.py) call it with a backend name (attention/backends.py). Packed
documents and padding are read from the whole-row positions and mask (attention/documents.py): those the sharder
published for the batch (attention/rows.py), or else gathered from the SP group in every call.

When the SP group is split into `ulysses_size × ring_size` (hybrid Ulysses × ring), the all-to-alls run inside
the Ulysses sub-group only and ring attention (attention/ring.py) takes the place of the local attention,
spanning the ring sub-group: the SP size is then no longer capped by the head counts. The ring computes plain
softmax attention masked by position only, so it refuses rows it cannot mask that way (packed documents, left or
inner padding), deciding from the same gathered whole rows on every rank.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_ulysses.attention.all_to_all import all_gather_sequence, start_exchange
from lightning_ulysses.attention.backends import BACKENDS, check_backend, local_attention
from lightning_ulysses.attention.documents import AttentionPattern, DocumentMask
from lightning_ulysses.attention.ring import ring_attention
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.parallel.layout import ShardOrder


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
        " (the hybrid Ulysses + ring layout: the strategy's ring_size, automatic when None)."
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


def check_overlap_head_groups(value) -> int:
    """Raise a fix-naming error unless `value` is a valid `overlap_head_groups` (a whole number >= 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"overlap_head_groups must be a whole number >= 1 (1: no overlap, 2: two head groups whose all-to-alls"
            f" overlap each other's attention), got {value!r}"
        )
    return value


def usable_head_groups(num_heads: int, num_key_value_heads: int, sequence_parallel_size: int, requested: int) -> int:
    """The most head groups, at most `requested`, that split evenly: every group must give each SP rank whole
    query heads and whole KV heads (after KV replication), so that each group is a Ulysses exchange of its own."""
    check_overlap_head_groups(requested)
    kv_heads = num_key_value_heads * kv_replication_factor(num_key_value_heads, sequence_parallel_size)
    return max(g for g in range(1, requested + 1)
               if num_heads % (g * sequence_parallel_size) == 0 and kv_heads % (g * sequence_parallel_size) == 0)


def exchange_and_attend(query, key, value, group, attend: Callable, head_groups: int = 1,
                        transport=None) -> torch.Tensor:
    """Ulysses around `attend`: `[batch, heads, seq/P, dim]` q/k/v → all-to-all → `attend(q, k, v)` on all tokens of
    heads/P heads (returns `[batch, seq, heads/P, dim]`) → all-to-all back → `[batch, seq/P, heads, dim]`.

    `head_groups` > 1 cuts the heads into groups (`usable_head_groups`: fewer when the heads do not split that
    many ways) and pipelines them: every group's q/k/v exchange is launched at once, and each group's attention
    runs while the next group's inputs and the previous group's output are in flight. Backward, run by autograd in
    reverse creation order, does the same with the gradients. Only the first exchange and the last stay exposed.
    `transport`: how the all-to-alls move their bytes (`start_exchange`; None: the collective all-to-all).
    (Measured on 2 × H200, NCCL's all-to-all kernels slow a compute-bound attention kernel beside them by about
    the time they overlap: 2 groups gain ~1.5% at 32K tokens, nothing at 128K.) Attention heads are independent, so the result is that of one group, whatever the grouping. (Under a ring,
    `ulysses_attention` passes one group: the ring exchanges K/V blocks between its own block computations.)
    """
    sp = dist.get_world_size(group)
    validate_head_counts(query.size(1), key.size(1), sp)
    factor = kv_replication_factor(key.size(1), sp)
    if factor > 1:
        key = key.repeat_interleave(factor, dim=1)
        value = value.repeat_interleave(factor, dim=1)
    groups = usable_head_groups(query.size(1), key.size(1), sp, head_groups)
    pieces = zip(*(tensor.chunk(groups, dim=1) for tensor in (query, key, value)))
    # q/k/v of every group: heads scattered, tokens gathered; all launched before the first is waited for
    incoming = [[start_exchange(t, group, split_dim=1, join_dim=2, transport=transport) for t in qkv] for qkv in pieces]
    outgoing = []
    for exchanges in incoming:
        output = attend(*(exchange.finish() for exchange in exchanges))
        # tokens scattered, heads gathered
        outgoing.append(start_exchange(output, group, split_dim=1, join_dim=2, transport=transport))
    outputs = [exchange.finish() for exchange in outgoing]
    return outputs[0] if groups == 1 else torch.cat(outputs, dim=2)


def local_heads(num_heads: int, sequence_parallel_size: int, rank: int) -> slice:
    """The query heads SP rank `rank` attends over after the exchange of one head group (`exchange_and_attend`)."""
    share = num_heads // sequence_parallel_size
    return slice(rank * share, (rank + 1) * share)


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

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    backend: Optional[str] = "sdpa",
    position_ids: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    ring_group=None,
    batch_rows: Optional[BatchRowsSlot] = None,
    head_groups: int = 1,
    pattern: Optional[AttentionPattern] = None,
    local: Optional[Callable] = None,
    transport=None,
) -> torch.Tensor:
    """Attention of this rank's shard: `[batch, heads, seq/P, dim]` q/k/v → `[batch, seq/P, heads, dim]`.

    `position_ids` (global positions, `[batch or 1, seq/P]`) mark packed documents where they do not continue by
    one; `padding_mask` (`[batch, seq/P]`, 1 = real token) marks padding. Both are gathered whole, so a document
    crossing a shard boundary stays one document. `group` None (or of one rank): plain local attention.

    `ring_group` (hybrid Ulysses × ring; shards in the zig-zag layout of `layout.ShardOrder`): heads are scattered
    over `group` (the Ulysses sub-group) only, and ring attention across `ring_group` replaces the local attention
    (`backend` is not called; it may then be None).

    `batch_rows`: where the sharder published the whole rows of its last batch (attention/rows.py); when they are
    the rows of these shards, nothing is gathered and the batch's one `DocumentMask` is reused.

    `head_groups`: pipeline the all-to-alls with the attention of head groups (`exchange_and_attend`).

    `pattern`: a sliding window and/or chunks (`AttentionPattern`), applied on the whole rows after the exchange.
    `local`: the model's own attention in place of the backend, `local(q, k, v, documents, pattern)` on whole rows of
    this rank's heads (`[batch, heads/P, seq, dim]` → `[batch, seq, heads/P, dim]`); heads are then exchanged in one
    group, contiguous per rank (`local_heads`).

    `transport`: how the Ulysses all-to-alls move their bytes (`exchange_and_attend`).
    """
    ring = ProcessGroupHandle(ring_group).world_size > 1
    if ring and (pattern or local is not None):
        what = "sliding windows or chunked attention" if pattern else "the model's own attention function"
        raise NotImplementedError(
            f"ring attention (ring_size > 1) computes plain causal softmax attention and cannot apply {what}: use"
            " ring_size=1 (pure Ulysses: a sequence_parallel_size the heads divide)."
        )
    if ring and dropout_p:
        raise NotImplementedError(
            "ring attention (ring_size > 1) has no attention dropout: set the model's attention dropout to 0, or use"
            " ring_size=1 (pure Ulysses)."
        )
    described, documents = (False, None) if batch_rows is None else batch_rows.documents_for(position_ids, padding_mask)
    if not described:
        if position_ids is not None:
            position_ids = _whole_rows(position_ids, group, ring_group)
        if padding_mask is not None:
            padding_mask = _whole_rows(padding_mask.bool(), group, ring_group)
        documents = DocumentMask.from_rows(query.size(0), position_ids, padding_mask)
    if ring:
        _check_ring_can_mask(documents, is_causal)

        def attend(q, k, v):
            return ring_attention(q, k, v, ring_group, is_causal, scale).transpose(1, 2)
    elif local is not None:

        def attend(q, k, v):
            return local(q, k, v, documents, pattern)

        head_groups = 1
    else:

        def attend(q, k, v):
            return local_attention(q, k, v, backend, documents, is_causal, scale, dropout_p, pattern)

    if ProcessGroupHandle(group).world_size == 1:
        return attend(query, key, value)
    # the ring exchanges K/V blocks itself, between its own blocks' compute: its heads go in one group
    return exchange_and_attend(query, key, value, group, attend, 1 if ring else head_groups, transport)


def _whole_rows(shard: torch.Tensor, ulysses_group, ring_group) -> torch.Tensor:
    """This SP rank's `[batch, tokens]` slice of a row tensor (positions, padding mask) → the whole rows in natural
    order, identical on every rank of the SP group (so every rank takes the same masking decisions)."""
    order, _ = ShardOrder.of_groups(ulysses_group, ring_group)
    # Ulysses pieces, then ring portions: SP-rank (shard) order (SP rank = ring rank · ulysses_size + ulysses rank).
    rows = all_gather_sequence(shard, ulysses_group, seq_dim=1)
    return order.restore(all_gather_sequence(rows, ring_group, seq_dim=1), dim=1)


def _check_ring_can_mask(documents: Optional[DocumentMask], is_causal: bool) -> None:
    """Ring attention masks by position only. That is exact for one document per row, padded (if at all) at the
    end of the rows of a causal model: no real token attends to a later one, and padded positions carry ignored
    labels. Anything else is refused; `documents` describes the whole rows, so every rank raises alike."""
    if documents is None:
        return
    refusal = documents.derived(("ring_refusal", is_causal), lambda: _ring_refusal(documents, is_causal))
    if refusal is not None:
        raise NotImplementedError(refusal)


def _ring_refusal(documents: DocumentMask, is_causal: bool) -> Optional[str]:
    """Why ring attention cannot mask these rows (see `_check_ring_can_mask`), or None."""
    real = documents.real_tokens
    if real is not None and not (is_causal and bool((real[:, :-1] >= real[:, 1:]).all())):
        return (
            "Ring attention (ring_size > 1) supports padding only at the end of rows of causal models; this batch"
            " has left or inner padding. Pad on the right (tokenizer.padding_side='right'), or use ring_size=1."
        )
    if documents.document_ids is not None:
        starts = documents.document_ids.diff(dim=1) != 0
        if real is not None:
            starts = starts & real[:, 1:]  # positions restarting inside the right padding separate no real tokens
        if bool(starts.any()):
            return (
                "Ring attention (ring_size > 1) masks by position only, so it cannot keep packed documents apart:"
                " position_ids restart inside a row. Use ring_size=1 (pure Ulysses attention handles packed rows),"
                " or unpacked rows (one document per row, e.g. pack_documents=False)."
            )
    return None


class UlyssesAttention(nn.Module):
    """Ulysses attention for models that are not Hugging Face's.

    `backend` is a backend name (`"sdpa"`, `"flash_attention_2"`, `"flash_attention_3"`, `"flex_attention"`):
    `forward(q, k, v, position_ids=None, attention_mask=None, *, is_causal=causal, scale=scale, dropout_p=0.0)`
    then runs `ulysses_attention`, the core Hugging Face models use too, so packed rows (`position_ids`) and
    padding (`attention_mask`) are handled, sharded or not. `backend` may instead be your own local attention
    callable `fn(q, k, v, **kwargs)`, which sees whole rows of its heads and must handle GQA (e.g.
    `enable_gqa=True`) and any masking itself. q, k, v and the output are `[batch, heads, seq, head_dim]`.
    `UlyssesDeepSpeedStrategy` binds the SP group at setup; unbound (or with an SP group of one rank) nothing is
    exchanged.

    `causal`/`scale`: the defaults of `forward`'s `is_causal` (True when None) and `scale` for a backend name.
    With a ring (`ring_size > 1`) ring attention replaces the local attention and computes softmax attention
    itself (its blocks must return their log-sum-exp), so it cannot call an opaque callable: a callable backend
    must then be declared plain softmax attention with `causal=True/False` (and `scale`, if not the default).
    `num_heads`/`num_key_value_heads` let the strategy pick the Ulysses × ring split automatically
    (`ring_size=None`). `overlap_head_groups`: pipeline this many head groups with their all-to-alls
    (`exchange_and_attend`); None: the strategy's `overlap_head_groups` (1 unbound).
    """

    def __init__(
        self,
        backend: Union[str, Callable[..., torch.Tensor]] = "sdpa",
        *,
        causal: Optional[bool] = None,
        scale: Optional[float] = None,
        num_heads: Optional[int] = None,
        num_key_value_heads: Optional[int] = None,
        overlap_head_groups: Optional[int] = None,
    ):
        super().__init__()
        if not callable(backend) and backend not in BACKENDS:
            check_backend(backend)  # raises the fix-naming error
        self.backend = backend
        self.causal, self.scale = causal, scale
        self.num_heads, self.num_key_value_heads = num_heads, num_key_value_heads
        if overlap_head_groups is not None:
            check_overlap_head_groups(overlap_head_groups)
        self.overlap_head_groups = overlap_head_groups
        self._bound_head_groups: Optional[int] = None
        self._group = ProcessGroupHandle(None)
        self._ring = ProcessGroupHandle(None)
        self._batch_rows: Optional[BatchRowsSlot] = None
        self._transport = None  # the strategy's choice of all-to-all (`bind_transport`); None: the collective one

    def bind(self, sequence_parallel_group, ring_group=None) -> None:
        """Heads are scattered over `sequence_parallel_group` (the Ulysses group); K/V blocks pass around `ring_group`."""
        if ring_group is not None and callable(self.backend) and self.causal is None:
            raise ValueError(
                "ring attention computes softmax attention itself instead of calling your local attention callable:"
                " construct UlyssesAttention(..., causal=True) (or causal=False) to declare that it is plain softmax"
                " attention, pass a backend name (e.g. UlyssesAttention('sdpa')), or use ring_size=1 (pure Ulysses)."
            )
        self._group = ProcessGroupHandle(sequence_parallel_group)
        self._ring = ProcessGroupHandle(ring_group)

    def bind_parallel_groups(self, groups) -> None:
        """Called by `UlyssesDeepSpeedStrategy` with its `SequenceParallelGroups` at setup, and with None to unbind."""
        if groups is not None and not callable(self.backend):
            check_backend(self.backend)  # an unavailable backend fails at setup, before any collective
        sharded = groups is not None and groups.sequence_parallel_world_size > 1
        self.bind(groups.ulysses_group if sharded else None, groups.ring_group if sharded else None)

    def bind_batch_rows(self, batch_rows: Optional[BatchRowsSlot]) -> None:
        """Read the whole rows of each batch from `batch_rows`, where a `SequenceSharder` publishes them (the
        strategy binds its own at setup); None: gather positions and padding mask in every call."""
        self._batch_rows = batch_rows

    def bind_transport(self, transport) -> None:
        """Move this module's all-to-alls with `transport` (`copy_engine.py`, the strategy's agreed `exchange`);
        None: the collective all-to-all."""
        self._transport = transport

    @property
    def sequence_parallel_group(self):
        return self._group.group

    def bind_head_groups(self, head_groups: Optional[int]) -> None:
        """The strategy's `overlap_head_groups`, used unless this module was given its own; None unbinds."""
        self._bound_head_groups = head_groups

    @property
    def head_groups(self) -> int:
        """Head groups pipelined with the all-to-alls (`exchange_and_attend`): this module's own
        `overlap_head_groups`, else the strategy's, else 1 (no overlap)."""
        return self.overlap_head_groups or self._bound_head_groups or 1

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs) -> torch.Tensor:
        group = self._group.group if self._group.world_size > 1 else None
        ring_group = self._ring.group if self._ring.world_size > 1 else None
        options = {"is_causal": True if self.causal is None else self.causal, "scale": self.scale}
        backend = self.backend
        if callable(backend):
            if position_ids is not None or attention_mask is not None:
                raise TypeError(
                    "UlyssesAttention with a custom local attention callable does not read position_ids or"
                    " attention_mask (packed documents, padding): pass a backend name, e.g. UlyssesAttention('sdpa')."
                )
            if ring_group is None:
                return self._custom_attention(query, key, value, group, **kwargs)
            if kwargs:  # the ring replaces the callable (declared plain softmax attention, see bind)
                raise TypeError(f"ring attention takes no extra attention arguments, got {sorted(kwargs)}")
            backend = None
        options.update(kwargs)
        output = ulysses_attention(query, key, value, group, backend, position_ids, attention_mask,
                                   ring_group=ring_group, batch_rows=self._batch_rows, head_groups=self.head_groups,
                                   transport=self._transport, **options)
        return output.transpose(1, 2)

    def _custom_attention(self, query, key, value, group, **kwargs):
        if group is None:
            return self.backend(query, key, value, **kwargs)

        def attend(q, k, v):
            return self.backend(q, k, v, **kwargs).transpose(1, 2)

        output = exchange_and_attend(query, key, value, group, attend, self.head_groups, self._transport)
        return output.transpose(1, 2)
