"""Which tokens of a whole row may attend to which: packed documents, padding, sliding windows and chunks.

A row may hold several documents. A token whose `position_ids` entry does not continue the previous token's by
one (in practice: a restart at 0) starts a new document, the rule transformers applies to packed rows
(`masking_utils.find_packed_sequence_indices`). A query attends to the keys of its own document (causally, for
causal models) that are not padding (2-D `attention_mask`), Hugging Face's padding semantics: a left-padding
query has no key at all and its output is zero, as in transformers' own sdpa and flash paths.

The structure must be built from the *whole* row: under sequence parallelism that is the rows the sharder published
for the batch (attention/rows.py) or else the positions and mask gathered after the all-to-all, identical on every
rank of the SP group either way, so every rank makes the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class AttentionPattern:
    """Causal attention narrowed to a sliding window and/or to chunks, as transformers' overlays define them.

    `sliding_window`: a query sees the keys fewer than this many tokens before it (`kv > q - window`);
    `chunk_size`: a query sees the keys of its own chunk only, chunks counted from the row's first real token
    (transformers' `left_padding` offset) or, in packed rows, from its document's first token (the positions
    transformers remaps packed rows to). Both measured on the whole row.
    """

    sliding_window: Optional[int] = None
    chunk_size: Optional[int] = None

    def __bool__(self) -> bool:
        return self.sliding_window is not None or self.chunk_size is not None

    def allowed(self, seq: int, documents: Optional["DocumentMask"], device) -> torch.Tensor:
        """`[batch or 1, seq, seq]` boolean: where the pattern lets query `q` (dim 1) see key `k` (dim 2)."""
        index = torch.arange(seq, device=device)
        allowed = torch.ones(1, seq, seq, dtype=torch.bool, device=device)
        if self.sliding_window is not None:
            allowed = allowed & ((index[:, None] - index[None, :]) < self.sliding_window)[None]
        if self.chunk_size is not None:
            chunks = self.chunk_ids(seq, documents, device)
            allowed = allowed & (chunks[:, :, None] == chunks[:, None, :])
        return allowed

    def chunk_ids(self, seq: int, documents: Optional["DocumentMask"], device) -> torch.Tensor:
        """`[batch or 1, seq]`: the chunk of every token (see the class docstring)."""
        index = torch.arange(seq, device=device)[None]
        if documents is not None and documents.document_ids is not None:
            starts = torch.ones_like(documents.document_ids, dtype=torch.bool)
            starts[:, 1:] = documents.document_ids[:, 1:] != documents.document_ids[:, :-1]
            first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
            offsets = index - first  # each token's position within its document
        elif documents is not None and documents.real_tokens is not None:
            left_padding = (~documents.real_tokens).long().cumprod(dim=1).sum(dim=1, keepdim=True)
            offsets = index - left_padding
        else:
            offsets = index
        return torch.div(offsets, self.chunk_size, rounding_mode="floor")


def allowed_mask(batch: int, seq: int, documents: Optional["DocumentMask"], is_causal: bool,
                 pattern: Optional[AttentionPattern], device) -> torch.Tensor:
    """`[batch, 1, seq, seq]` boolean (True = attend): documents, padding, causality and the pattern together."""
    allowed = (documents.dense_mask(is_causal) if documents is not None else
               torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None, None].expand(batch, 1, seq, seq)
               if is_causal else torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=device))
    if pattern:
        allowed = allowed & pattern.allowed(seq, documents, device)[:, None]
    return allowed


@dataclass(frozen=True)
class DocumentMask:
    """`document_ids[b, t]` (non-decreasing per row; None: one document per row) and `real_tokens[b, t]` (False
    for padding; None: no padding). At least one of the two is set."""

    document_ids: Optional[torch.Tensor]
    real_tokens: Optional[torch.Tensor]
    # What is derived from the mask with a host sync (flash's cu_seqlens, the ring's refusal), computed once: when the
    # sharder describes a batch (attention/rows.py) one DocumentMask serves every attention layer of the batch.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: Any, compute: Callable[[], Any]) -> Any:
        """`compute()`, the first time `key` is asked for; the same value afterwards."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @classmethod
    def from_rows(
        cls, batch_size: int, position_ids: Optional[torch.Tensor] = None, padding_mask: Optional[torch.Tensor] = None
    ) -> Optional["DocumentMask"]:
        """The mask of whole rows, or None when every row is one unpadded sequence (plain causal attention).

        `position_ids` and `padding_mask` (True/1 = real token) are `[batch or 1, seq]` for the whole rows. Costs
        one host sync per given input; the rows are whole, so the answer is the same on every SP rank.
        """
        document_ids = real_tokens = None
        if position_ids is not None:
            starts = position_ids.expand(batch_size, -1).diff(dim=1) != 1
            if bool(starts.any()):
                document_ids = torch.nn.functional.pad(starts.long().cumsum(dim=1), (1, 0))
        if padding_mask is not None:
            real = padding_mask.bool().expand(batch_size, -1)
            if not bool(real.all()):
                real_tokens = real
        if document_ids is None and real_tokens is None:
            return None
        return cls(document_ids, real_tokens)

    def dense_mask(self, is_causal: bool) -> torch.Tensor:
        """`[batch, 1, seq, seq]` boolean mask for SDPA (True = attend). Quadratic in memory: long rows want flash."""
        reference = self.document_ids if self.document_ids is not None else self.real_tokens
        batch, seq = reference.shape
        allowed = torch.ones(batch, seq, seq, dtype=torch.bool, device=reference.device)
        if self.document_ids is not None:
            allowed = self.document_ids[:, :, None] == self.document_ids[:, None, :]
        if self.real_tokens is not None:
            allowed = allowed & self.real_tokens[:, None, :]
        if is_causal:
            allowed = allowed & torch.ones(seq, seq, dtype=torch.bool, device=reference.device).tril()
        return allowed[:, None]

    def varlen_layout(self) -> tuple[Optional[torch.Tensor], torch.Tensor, int]:
        """For the variable-length flash kernels, over the rows flattened one after another: the flat indices of
        the real tokens (None: all), `cu_seqlens` (int32) of the documents among them, and the longest one.

        Padding is dropped rather than masked (the kernels have no key mask); its outputs are zero.
        """
        return self.derived("varlen_layout", self._varlen_layout)

    def _varlen_layout(self) -> tuple[Optional[torch.Tensor], torch.Tensor, int]:
        reference = self.document_ids if self.document_ids is not None else self.real_tokens
        batch, seq = reference.shape
        rows = torch.arange(batch, device=reference.device)[:, None].expand(batch, seq).reshape(-1)
        documents = self.document_ids.reshape(-1) if self.document_ids is not None else torch.zeros_like(rows)
        kept = None
        if self.real_tokens is not None:
            kept = self.real_tokens.reshape(-1).nonzero().reshape(-1)
            rows, documents = rows[kept], documents[kept]
        starts = torch.ones_like(rows, dtype=torch.bool)
        starts[1:] = (rows[1:] != rows[:-1]) | (documents[1:] != documents[:-1])
        offsets = starts.nonzero().reshape(-1)
        total = torch.tensor([rows.numel()], device=rows.device, dtype=offsets.dtype)
        cu_seqlens = torch.cat([offsets, total]).to(torch.int32)
        return kept, cu_seqlens, int(cu_seqlens.diff().max()) if cu_seqlens.numel() > 1 else 0

    def mask_mod(self, is_causal: bool, pattern: Optional[AttentionPattern] = None):
        """The `mask_mod(batch, head, query, key)` of flex attention."""
        return mask_mod(self, is_causal, pattern)


def mask_mod(documents: Optional[DocumentMask], is_causal: bool, pattern: Optional[AttentionPattern] = None,
             seq: Optional[int] = None, device=None):
    """The `mask_mod(batch, head, query, key)` of flex attention for these documents (None: one unpadded sequence
    per row, then `seq` and `device` give the row) and pattern."""
    document_ids = None if documents is None else documents.document_ids
    real_tokens = None if documents is None else documents.real_tokens
    window = pattern.sliding_window if pattern else None
    chunks = None
    if pattern and pattern.chunk_size is not None:
        reference = document_ids if document_ids is not None else real_tokens
        if reference is not None:
            seq, device = reference.size(1), reference.device
        chunks = pattern.chunk_ids(seq, documents, device)

    def allowed(batch, head, query, key):
        result = query >= key if is_causal else query == query
        if document_ids is not None:
            result = result & (document_ids[batch, query] == document_ids[batch, key])
        if real_tokens is not None:
            result = result & real_tokens[batch, key]
        if window is not None:
            result = result & (query - key < window)
        if chunks is not None:
            row = batch if chunks.size(0) > 1 else 0
            result = result & (chunks[row, query] == chunks[row, key])
        return result

    return allowed
