"""Outputs of a sequence-parallel forward pass, as a predict step wants them.

Each SP rank holds the logits of its shard only, `[batch, seq/P, vocab]`. Gathering them is the one thing that
needs memory proportional to `seq × vocab` on one rank, so it happens only when asked for:

- `"last"`: the logits at the last real position of every row, `[batch, vocab]`, on every rank;
- `"log_probs"`: the log-probability of every target token, `[batch, seq]` (0 where the label is ignored);
- `"full"`: all logits, `[batch, seq, vocab]`, on every rank.

Lengths include the padding the strategy added to reach a multiple of the SP size (its labels are ignored).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.loss import IGNORE_INDEX

OutputKind = Literal["last", "log_probs", "full"]


def sequence_outputs(
    logits: torch.Tensor,
    kind: OutputKind,
    sequence_parallel_group=None,
    labels: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Assemble `kind` from this rank's `logits` shard (see the module docstring).

    `labels` (aligned with the logits, as the strategy delivers them) are needed for `"log_probs"`;
    `attention_mask` (this rank's shard) tells `"last"` where each row really ends (default: the last position).
    """
    group = sequence_parallel_group
    if kind == "full":
        return all_gather_sequence(logits, group, seq_dim=1)
    if kind == "log_probs":
        if labels is None:
            raise ValueError("sequence_outputs(kind='log_probs') needs the labels of the batch")
        valid = labels != ignore_index
        targets = labels.masked_fill(~valid, 0).unsqueeze(-1)
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets).squeeze(-1) * valid
        return all_gather_sequence(log_probs, group, seq_dim=1)
    if kind == "last":
        return _last_position_logits(logits, group, attention_mask)
    raise ValueError(f"kind must be 'last', 'log_probs' or 'full', got {kind!r}")


def _last_position_logits(logits: torch.Tensor, group, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    batch, local_len, _ = logits.shape
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if attention_mask is None:
        full_mask = torch.ones(batch, local_len * size, dtype=torch.bool, device=logits.device)
    else:
        full_mask = all_gather_sequence(attention_mask.bool(), group, seq_dim=1)
    # Index of the last real token of each row (right padding), in global positions.
    positions = torch.arange(full_mask.size(1), device=logits.device)
    last = (full_mask * positions).amax(dim=1)
    owner, offset = last // local_len, last % local_len
    rows = torch.arange(batch, device=logits.device)
    picked = logits[rows, offset] * (owner == rank).unsqueeze(-1).to(logits.dtype)
    if group is not None and size > 1:
        # Exactly one rank contributes each row; the others add zeros.
        dist.all_reduce(picked, group=group)
    return picked
