"""The arguments a token mixer is called with, made whole-row: what both ways of running a mixer under sequence
parallelism (whole rows, `whole_rows.py`; split by heads, `head_split.py`) do alike to everything but the hidden
states.

A mixer is called by its decoder layer with this rank's shard of the hidden states and of the per-token arguments
(padding mask, positions); its own computation then runs on whole rows (of every channel, or of this rank's heads),
so those arguments are replaced by their whole rows. A cache is the one argument that needs a rule of its own:
transformers' hybrid models create one in every forward by default (`use_cache=True`, training included), and
hand it to each mixer to record its convolution and recurrent state into. A cache that holds no earlier tokens for
the mixer's layer records a prefill, which needs nothing from it: the mixer runs without it (its state is then not
recorded). Decoding from a cache needs that state: `inference.generate` decoding a hybrid model is refused here,
and a sharded forward handed a cache that already holds tokens is refused where the model is entered
(hf/positions.py `_CacheCheck`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# The attribute of the "ulysses" mask interface's marker for windowed layers (hf/mask_interface.py `_mark`).
MASK_MARKER = "_lightning_ulysses_pattern"
CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values", "past_key_value", "layer_past", "state")


def whole_row_argument(name: str, value: Any, hidden: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor],
                       whole_length: int, where: str, decoding: bool) -> Any:
    """`value` of the mixer's argument `name` made whole-row; `hidden` is this rank's shard of the hidden states,
    `gather` makes a shard `[batch, seq/P, ...]` whole (no gradient), `where` names the mixer in messages,
    `decoding`: whether `inference.generate` is decoding with the model."""
    batch, length = hidden.shape[:2]
    if name == "attention_mask":
        return whole_padding_mask(value, hidden, gather, where)
    if name == "position_ids" and isinstance(value, torch.Tensor):
        return gather(value)
    if name == "cache_position" and isinstance(value, torch.Tensor):
        return torch.arange(whole_length, device=value.device)
    if name in CACHE_ARGUMENTS or name == "use_cache":
        if value in (None, False) or not decoding:
            return None if name != "use_cache" else value  # a prefill records nothing it needs (module docstring)
        raise NotImplementedError(
            f"{where} cannot record its state for decoding under sequence parallelism (its recurrence runs on whole"
            " rows of this rank's share). Generate with sequence_parallel_size=1.")
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == length and value.size(0) in (1, batch):
        raise NotImplementedError(
            f"{where} takes {name!r} shaped like this rank's shard of the sequence, which lightning_ulysses does not"
            " know how to make whole: train this model with sequence_parallel_size=1.")
    return value


def shard_padding_mask(value: Any, hidden: torch.Tensor, where: str) -> torch.Tensor | None:
    """The 2-D padding mask `[batch, seq/P]` a mixer was handed for its shard (None: no padding), unwrapped from the
    "ulysses" mask interface's marker (a recurrent block handed the attention's mask, like RecurrentGemma's, reads
    no window from it)."""
    value = getattr(value, MASK_MARKER, (value, None))[0] if value is not None else None
    if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 2):
        raise NotImplementedError(
            f"{where} got a {getattr(value, 'dim', lambda: '?')()}-D attention mask; under sequence parallelism it"
            " takes 2-D padding masks only.")
    return value


def whole_padding_mask(value: Any, hidden: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor],
                       where: str) -> torch.Tensor | None:
    """The whole rows' 2-D padding mask, or None when no row holds padding.

    transformers drops a shard's all-ones mask, so whether a rank was handed one depends on its shard: every rank
    gathers one (all ones where it had none), so that all take the same path."""
    value = shard_padding_mask(value, hidden, where)
    batch, length = hidden.shape[:2]
    shard = torch.ones(batch, length, dtype=torch.long, device=hidden.device) if value is None else value
    rows = gather(shard)
    return None if bool(rows.bool().all()) else rows


class PackedDocuments:
    """The packed documents of a model's current forward, for all its mixers: per row, the `(start, end)` of each
    document of the whole rows, read from the model's `position_ids` (documents restart them, as the attention reads
    them: attention/documents.py); None when every row is one sequence or the model was given no positions.

    `positions()` is the shard of the latest forward's positions; `gather` makes a shard whole (so every rank of the
    group gets the same answer and takes the same path). Read once per forward (one host sync), not once per mixer:
    the answer is kept for the positions tensor it was read from."""

    def __init__(self, positions: Callable[[], Any], gather: Callable[[torch.Tensor], torch.Tensor]):
        self.positions, self.gather = positions, gather
        self._read: tuple[Any, list[list[tuple[int, int]]] | None] = (None, None)

    def spans(self, batch: int, length: int) -> list[list[tuple[int, int]]] | None:
        positions = self.positions()
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.size(-1) != length:
            return None
        if self._read[0] is not positions:
            self._read = (positions, self._spans(positions, batch))
        return self._read[1]

    def _spans(self, positions: torch.Tensor, batch: int) -> list[list[tuple[int, int]]] | None:
        starts = self.gather(positions.expand(batch, -1).contiguous()).diff(dim=1) != 1
        if not bool(starts.any()):
            return None
        documents = []
        for row in starts.tolist():
            cuts = [0] + [index + 1 for index, start in enumerate(row) if start] + [len(row) + 1]
            documents.append(list(zip(cuts[:-1], cuts[1:])))
        return documents
