"""The whole rows of a batch, described once where the batch is cut instead of gathered back in every layer.

Every attention layer needs the same whole-row picture of a batch (where documents start, which tokens are padding)
but holds only its shard of `position_ids` and of the padding mask. Left to itself, each layer gathers both from the
SP group and reduces them on the host to decide whether anything is packed or padded: for a 32-layer model 32 pairs
of all-gathers and 32 GPU→CPU syncs per forward, again in every recompute under activation checkpointing, for an
answer that is the same in every layer.

The `SequenceSharder` sees the whole rows before it cuts them, so it publishes them (`BatchRows`, no collective)
into a `BatchRowsSlot` that the attention modules read; `UlyssesDeepSpeedStrategy` owns one slot and hands it to its
sharder, its native `UlyssesAttention` modules and its Hugging Face models. The attention core uses the published
rows only when it is handed the very `position_ids` shard the sharder produced (same storage, shape, strides and
in-place version, so also its `detach()`ed copy in a recompute); any other call (tensors a user made, a model run
without the sharder) gathers, as before. Both paths build the same `DocumentMask`, and the decision depends only on
code that every rank of the SP group runs alike, so all ranks take the same path.

The padding mask cannot be matched the same way (Hugging Face models convert it to bool before the attention sees
it), so a mask given to the attention is taken to be the batch's own `attention_mask`; one given without the batch
having one makes the attention gather. The one `DocumentMask` of a batch serves every layer, and what is derived from
it (flash's `cu_seqlens`, the ring's refusal decision) is computed once.
"""

from __future__ import annotations

import torch

from lightning_ulysses.attention.documents import DocumentMask
from lightning_ulysses.parallel.views import view_key


def _is_view(tensor: torch.Tensor | None, key: tuple | None) -> bool:
    """Whether `tensor` is the published shard whose `view_key` is `key` (or an unmodified alias of it)."""
    return tensor is not None and key is not None and view_key(tensor) == key


class BatchRows:
    """The whole (length-padded) rows of one batch, published by the sharder that cut it.

    `position_ids`: the whole rows, or None when the sharder filled them in (one document per row: `0..seq-1`, or
    the family's `PositionRule`); `padding_mask`: the whole rows' `attention_mask` (1 = real token), or None when the batch has none;
    `shard_position_ids`/`shard_padding_mask`: this rank's shards of them, as the model receives them (positions
    None only when the sharder left them out); `shard_input_ids`: this rank's shard of the batch's tokens;
    `unpadded_length`: the rows' length before the sharder padded them to a multiple of the SP size.
    """

    def __init__(self, batch_size: int, position_ids: torch.Tensor | None, padding_mask: torch.Tensor | None,
                 shard_position_ids: torch.Tensor | None, shard_padding_mask: torch.Tensor | None,
                 shard_input_ids: torch.Tensor | None = None, unpadded_length: int | None = None):
        self.batch_size = batch_size
        self.position_ids = position_ids
        self.padding_mask = None if padding_mask is None else padding_mask.bool()
        # Kept alive, so that their storages cannot be reused by another tensor while the batch is current.
        self._shards = (shard_position_ids, shard_input_ids)
        self.shard_position_ids = shard_position_ids
        self._shard_view, self._input_view = (None if shard is None else view_key(shard) for shard in self._shards)
        self._shard_padding_mask_shape = None if shard_padding_mask is None else shard_padding_mask.shape
        self._shard_shape = None if shard_input_ids is None else tuple(shard_input_ids.shape)
        self.unpadded_length = unpadded_length
        self._documents: dict[bool, DocumentMask | None] = {}

    def holds_input_ids(self, input_ids: torch.Tensor | None) -> bool:
        """Whether `input_ids` are this batch's token shard as the sharder cut it (or an unmodified alias)."""
        return _is_view(input_ids, self._input_view)

    def holds_position_ids(self, position_ids: torch.Tensor | None) -> bool:
        """Whether `position_ids` are this batch's position shard as the sharder cut it (or an unmodified alias)."""
        return _is_view(position_ids, self._shard_view)

    def unpadded_length_of(self, shard: torch.Tensor) -> int | None:
        """The batch's unpadded row length when `shard` has the shape of its shards (a tensor of this batch)."""
        return self.unpadded_length if tuple(shard.shape) == self._shard_shape else None

    def describes(self, position_ids: torch.Tensor | None, padding_mask: torch.Tensor | None) -> bool:
        """Whether an attention handed these shards runs on this batch (metadata only: no sync, no collective)."""
        if not self.holds_position_ids(position_ids):
            return False
        return padding_mask is None or padding_mask.shape == self._shard_padding_mask_shape

    def documents(self, with_padding: bool) -> DocumentMask | None:
        """The `DocumentMask` of the whole rows (with or without their padding), built on first use, then shared."""
        if with_padding not in self._documents:
            self._documents[with_padding] = DocumentMask.from_rows(
                self.batch_size, self.position_ids, self.padding_mask if with_padding else None
            )
        return self._documents[with_padding]


class BatchRowsSlot:
    """Where a `SequenceSharder` publishes the `BatchRows` of the batch it cut last, for the attention to read.

    Shared, not copied, by `copy.deepcopy` (an EMA copy of a model runs on the same batches).
    """

    def __init__(self) -> None:
        self.rows: BatchRows | None = None

    def __deepcopy__(self, memo):
        return self

    def documents_for(self, position_ids: torch.Tensor | None,
                      padding_mask: torch.Tensor | None) -> tuple[bool, DocumentMask | None]:
        """(whether the published rows describe these shards, their `DocumentMask` if so)."""
        rows = self.rows
        if rows is None or not rows.describes(position_ids, padding_mask):
            return False, None
        return True, rows.documents(with_padding=padding_mask is not None)
