"""Cut a full-length batch along the sequence for one SP rank.

Everything here is local arithmetic on the batch (no communication), so a bad batch fails on every rank of the
SP group alike, before any collective.

- `labels` are cut as they are, unshifted, exactly as the user's batch holds them (padding appended as ignored
  labels): a step that reads `batch["labels"]` sees what it would see without the strategy. The loss shifts them
  (the target of t is label t+1) across shard boundaries itself (`loss.shift_sharded_labels`: one small integer
  all-gather), so no target is lost where a shard ends; a loss computed by hand from this rank's shard alone cannot
  be, and the strategy refuses it at SP > 1 (it differs between the SP ranks: `integration.logged_values`).
- `position_ids` are made global when absent and the sequence is cut: a model left to itself would number each
  shard from 0. They are the ones the model would number the whole rows with: `0..seq-1` for most families, the
  family's `PositionRule` (families/) for the few that count real tokens only (OPT). Given ones are cut as they are: packed rows (several documents per row, positions
  restarting at 0) keep their per-document positions, and the attention gathers them to keep documents apart.
  Whole-row document descriptions (`cu_seq_lens_q`, ... of flash-attention collators) cannot be cut and are
  rejected: positions carry the same information shard by shard.
- `attention_mask` (a 2-D padding mask) is cut like the tokens; the attention gathers it back whole.
- With a ring (`ring_size > 1`) the shards follow the zig-zag layout of `layout.ShardOrder` (two chunks per
  ring rank, for causal load balance) instead of contiguous slices; every key above is cut the same way, and
  whatever gathers the sequence back (`all_gather_sequence(..., order=...)`) restores the natural order.
- Every other entry passes through untouched.
- Given a `BatchRowsSlot` (the strategy passes its own), the sharder publishes the whole rows of each batch it cuts
  (positions, padding mask; attention/rows.py) there, so that the attention layers read packed documents and padding
  from them instead of gathering them back in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from lightning_ulysses.adapters import PositionRule
from lightning_ulysses.attention.rows import BatchRows, BatchRowsSlot
from lightning_ulysses.parallel.layout import ShardOrder
from lightning_ulysses.training.loss import IGNORE_INDEX

SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
WHOLE_ROW_DOCUMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
SequencePadding = Literal["pad", "error"]


def check_sequence_padding(value: Any) -> SequencePadding:
    if value not in ("pad", "error"):
        raise ValueError(f"sequence_padding must be 'pad' or 'error', got {value!r}")
    return value


class SequenceSharder:
    """Fills in global positions, pads (or rejects) lengths and keeps this rank's slice of every sequence key."""

    def __init__(
        self,
        sequence_parallel_size: int,
        sequence_parallel_rank: int,
        sequence_padding: SequencePadding = "pad",
        pad_token_id: int = 0,
        ring_size: int = 1,
        batch_rows: BatchRowsSlot | None = None,
        position_rule: PositionRule | None = None,
    ):
        if sequence_padding not in ("pad", "error"):
            raise ValueError(f"sequence_padding must be 'pad' or 'error', got {sequence_padding!r}")
        self.sequence_parallel_size = sequence_parallel_size
        self.sequence_parallel_rank = sequence_parallel_rank
        self.sequence_padding = sequence_padding
        self.pad_token_id = pad_token_id
        self.order = ShardOrder(sequence_parallel_size, ring_size)
        # The length of the last batch's rows before padding: where `inference.sequence_outputs(kind="last")` finds
        # each row's last real token when the batch carries no attention mask.
        self.unpadded_length: int | None = None
        self.batch_rows = batch_rows
        # How the models number a row they are given no positions for (families/; None: 0..seq-1, padding included).
        self.position_rule = position_rule

    def __call__(self, batch: Any) -> Any:
        if self.batch_rows is not None:
            self.batch_rows.rows = None  # until this batch is cut: a batch that fails to shard leaves nothing stale
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            if self.sequence_parallel_size == 1:
                return batch  # nothing to cut: the user's module sees exactly what it returned
            raise TypeError(
                "Under sequence parallelism each batch must be a dict with at least 'input_ids' [batch, seq] (plus"
                f" optional {', '.join(SEQUENCE_KEYS[1:])}), so the strategy knows what to cut along the sequence;"
                f" got {type(batch).__name__}{'' if not isinstance(batch, Mapping) else ' without input_ids'}."
                " Return such a dict from your Dataset/collate_fn."
            )
        batch = dict(batch)
        seq_len = self.unpadded_length = batch["input_ids"].size(1)
        self._check_shapes(batch, seq_len)
        if self.sequence_parallel_size > 1:
            self._check_no_whole_row_documents(batch)
        padded_len = self._padded_length(seq_len)
        if padded_len != seq_len:
            batch = _pad(batch, padded_len - seq_len, self.pad_token_id)
        positions_given = "position_ids" in batch
        if not positions_given:
            # The model's own positions would be shard-local (0..seq/P-1 on every rank) under SP; at SP 1 they are
            # right, but filling them in keeps one rule for every SP size and lets the attention recognise the
            # batch's rows (one document per row) without inspecting positions in every layer.
            input_ids = batch["input_ids"]
            if self.position_rule is not None and "attention_mask" in batch:
                batch["position_ids"] = self.position_rule.positions(batch["attention_mask"])
            else:
                batch["position_ids"] = torch.arange(padded_len, device=input_ids.device).expand(input_ids.size(0), -1)
        whole_rows = dict(batch)
        for key in SEQUENCE_KEYS:
            if key in batch:
                batch[key] = self.order.shard(batch[key], self.sequence_parallel_rank, dim=1)
        if self.batch_rows is not None:
            # Positions the sharder filled in hold one document per row: nothing to look for in them.
            self.batch_rows.rows = BatchRows(
                batch["input_ids"].size(0), whole_rows["position_ids"] if positions_given else None,
                whole_rows.get("attention_mask"), batch["position_ids"], batch.get("attention_mask"),
                shard_input_ids=batch["input_ids"], unpadded_length=seq_len,
            )
        return batch

    def _padded_length(self, seq_len: int) -> int:
        sp, multiple = self.sequence_parallel_size, self.order.length_multiple
        if seq_len % multiple == 0:
            return seq_len
        if self.sequence_padding == "error":
            ring = "" if multiple == sp else f" and 2 × ring_size({self.order.ring_size}) (zig-zag chunks)"
            raise ValueError(
                f"sequence length {seq_len} is not divisible by sequence_parallel_size({sp}){ring}. Pad your batches"
                f" to a multiple of {multiple} (e.g. a collator with pad_to_multiple_of={multiple}) or construct the"
                " strategy with sequence_padding='pad' to let it pad with ignored labels."
            )
        return seq_len + (multiple - seq_len % multiple)

    @staticmethod
    def _check_shapes(batch: dict, seq_len: int) -> None:
        for key in SEQUENCE_KEYS:
            value = batch.get(key)
            if value is None:
                batch.pop(key, None)
                continue
            if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.size(1) != seq_len:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"batch[{key!r}] must be a [batch, seq] tensor with seq = input_ids.size(1) = {seq_len};"
                    f" got {shape}."
                )

    @staticmethod
    def _check_no_whole_row_documents(batch: dict) -> None:
        present = [key for key in WHOLE_ROW_DOCUMENT_KEYS if key in batch]
        if present:
            raise ValueError(
                f"batch[{present[0]!r}] describes packed documents of the whole row, which cannot be cut along the"
                " sequence. Under sequence parallelism documents are read from position_ids restarting at 0 (per"
                " document): leave out the flash-attention kwargs (e.g. DataCollatorWithFlattening("
                "return_flash_attn_kwargs=False, return_seq_idx=False)) or pack with lightning_ulysses.data.pack_documents."
            )


def _pad(batch: dict, extra: int, pad_token_id: int) -> dict:
    """Append `extra` positions at the end: ignored labels, masked-out tokens, continuing positions."""

    def extend(tensor: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([tensor, torch.full_like(tensor[:, :1], fill).expand(-1, extra)], dim=1)

    batch["input_ids"] = extend(batch["input_ids"], pad_token_id)
    if "labels" in batch:
        batch["labels"] = extend(batch["labels"], IGNORE_INDEX)
    if "attention_mask" in batch:
        batch["attention_mask"] = extend(batch["attention_mask"], 0)
    if "position_ids" in batch:
        positions = batch["position_ids"]
        steps = torch.arange(1, extra + 1, device=positions.device, dtype=positions.dtype)
        batch["position_ids"] = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    return batch


def batch_fingerprint(batch: Any) -> torch.Tensor:
    """A fixed number of int64s that differ, with overwhelming likelihood, between two different full-length batches:
    the shape, then for each sequence key whether it is present and its plain and position-weighted sums. Every rank
    of an SP group must cut the same batch; comparing fingerprints (one tiny all-gather) catches ranks fed different
    samples. The length never depends on the batch, so ranks can compare without agreeing on a size first."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        return torch.zeros(2 + 3 * len(SEQUENCE_KEYS), dtype=torch.long)
    input_ids = batch["input_ids"]
    numbers = [torch.tensor(list(input_ids.shape[:2]), dtype=torch.long, device=input_ids.device)]
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            value = value.long()
            weights = torch.arange(1, value.size(1) + 1, device=value.device)
            numbers.append(torch.stack([torch.ones_like(value.sum()), value.sum(), (value * weights).sum()]))
        else:
            numbers.append(torch.zeros(3, dtype=torch.long, device=input_ids.device))
    return torch.cat(numbers)
