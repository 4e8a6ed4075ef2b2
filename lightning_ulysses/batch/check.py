"""Whether the ranks of a sequence-parallel group were handed the same batch.

Every rank of an SP group cuts its shard out of the same sequences. Ranks fed different samples (an
`IterableDataset` sharded by global rank, a sampler of the user's own over the whole world) raise nothing: they
train silently wrong. `SameBatchCheck` compares a fixed-length fingerprint of each checked batch
(`sharding.batch_fingerprint`) over the SP group with one tiny all-gather, and raises on every rank of the group
alike, naming the fix.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_ulysses.batch.sharding import batch_fingerprint
from lightning_ulysses.parallel.layout import SequenceParallelGroups

CheckBatches = Literal["first", "every", "never"]
FIRST_BATCHES_CHECKED = 2  # per loop stage, with `check_batches="first"`


def check_batches_option(value: Any) -> CheckBatches:
    if value not in ("first", "every", "never"):
        raise ValueError(f"check_batches must be 'first', 'every' or 'never', got {value!r}")
    return value


class SameBatchCheck:
    """`"first"`: the first `FIRST_BATCHES_CHECKED` batches of every loop stage; `"every"`: each batch
    (debugging); `"never"`."""

    def __init__(self, mode: CheckBatches) -> None:
        self.mode = check_batches_option(mode)
        self._checked: dict[Any, int] = {}  # per loop stage: how many batches were compared over SP

    def __call__(self, batch: Any, groups: SequenceParallelGroups, stage: Any, device: torch.device,
                 global_rank: int) -> None:
        """Raise, on every rank of the SP group alike, if its ranks were handed different batches."""
        if groups.sequence_parallel_world_size == 1 or self.mode == "never":
            return
        checked = self._checked.get(stage, 0)
        if self.mode == "first" and checked >= FIRST_BATCHES_CHECKED:
            return
        self._checked[stage] = checked + 1
        fingerprint = batch_fingerprint(batch).to(device)
        gathered = [torch.empty_like(fingerprint) for _ in range(groups.sequence_parallel_world_size)]
        dist.all_gather(gathered, fingerprint, group=groups.sequence_parallel_group)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            return
        ranks = next(g for g in groups.layout.sequence_parallel_groups() if global_rank in g)
        raise ValueError(
            f"The ranks {ranks} of one sequence-parallel group were given different batches (stage {stage}, batch"
            f" {checked}). Every rank of an SP group must load the same samples (they share each"
            " sequence): use the strategy's distributed sampler (Lightning adds it; a sampler of your own should take"
            " num_replicas=strategy.data_parallel_world_size, rank=strategy.data_parallel_rank), and shard an"
            " IterableDataset by strategy.data_parallel_rank, not by global rank."
        )
