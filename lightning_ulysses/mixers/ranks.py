"""The SP ranks a token mixer splits its units over, and the collectives the split needs across them.

Without a ring they are the Ulysses group. With one (hybrid Ulysses × ring: the attention's K/V blocks pass around
`ring` ranks because its KV heads do not split further), a mixer's units still split over all `ulysses × ring`
ranks of the SP group — its heads are its own, not the attention's. The SP group is not a process group of its own
here, so each collective runs in two stages over the two sub-groups, SP rank `ring_rank · ulysses + ulysses_rank`
(`ShardOrder.of_groups`), and the rows are put in natural order afterwards: with a ring, the shards are cut
zig-zag (`ShardOrder`), so gathering them in SP-rank order gives the row in "shard order".

`to_head_rows`: `[batch, seq/P, P, C/P]` (piece `p` of the channels is SP rank `p`'s) → every token, natural
order, of this rank's piece `[batch, seq, C/P]`; `to_shard` is its inverse. Over the ring dimension first the
Ulysses all-to-all (pieces `(r, u)` → Ulysses rank `u`), then the ring's (→ ring rank `r`): the received tokens are
in SP-rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import all_gather_sequence, all_to_all
from lightning_ulysses.parallel.layout import ShardOrder


class SequenceRanks:
    """`ulysses`, `ring`: the sub-groups (None: one rank); `transport`: how the Ulysses all-to-alls move their
    bytes (the ring's take the collective)."""

    def __init__(self, ulysses=None, ring=None, transport=None):
        sizes = [1 if group is None else dist.get_world_size(group) for group in (ulysses, ring)]
        self.ulysses, self.ring = (group if size > 1 else None for group, size in zip((ulysses, ring), sizes))
        self.ulysses_size, self.ring_size = sizes
        self.transport = transport
        self.order, self.rank = ShardOrder.of_groups(self.ulysses, self.ring)
        self.size = self.order.sequence_parallel_size
        self._natural: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _permutations(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard order → natural order, natural → shard order) index permutations of a row of `length` tokens."""
        key = (length, device)
        if key not in self._natural:
            shard_order = torch.cat([self.order.positions(length, rank) for rank in range(self.size)])
            self._natural[key] = (torch.argsort(shard_order).to(device), shard_order.to(device))
        return self._natural[key]

    def to_head_rows(self, pieces: torch.Tensor) -> torch.Tensor:
        batch, length, parts, width = pieces.shape
        if self.ring is None:
            rows = all_to_all(pieces, self.ulysses, scatter_dim=2, gather_dim=1, transport=self.transport)
            return rows.reshape(batch, length * parts, width)
        grid = pieces.reshape(batch, length, self.ring_size, self.ulysses_size, width)
        grid = all_to_all(grid, self.ulysses, scatter_dim=3, gather_dim=1, transport=self.transport)
        rows = all_to_all(grid, self.ring, scatter_dim=2, gather_dim=1).reshape(batch, length * parts, width)
        return rows.index_select(1, self._permutations(rows.size(1), rows.device)[0])

    def to_shard(self, rows: torch.Tensor) -> torch.Tensor:
        batch, length, width = rows.shape
        if self.ring is None:
            return all_to_all(rows.reshape(batch, length, 1, width), self.ulysses, scatter_dim=1, gather_dim=2,
                              transport=self.transport)
        rows = rows.index_select(1, self._permutations(length, rows.device)[1])
        grid = all_to_all(rows.reshape(batch, length, 1, 1, width), self.ring, scatter_dim=1, gather_dim=2)
        grid = all_to_all(grid, self.ulysses, scatter_dim=1, gather_dim=3, transport=self.transport)
        return grid.reshape(batch, length // self.size, self.size, width)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over every SP rank, in place."""
        for group in (self.ulysses, self.ring):
            if group is not None:
                dist.all_reduce(tensor, group=group)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Whole rows of a tensor that needs no gradient (masks, positions), in natural order."""
        rows = all_gather_sequence(shard, self.ulysses, seq_dim=1)
        return all_gather_sequence(rows, self.ring, seq_dim=1, order=self.order if self.ring is not None else None)
