"""The SP ranks a token mixer splits its units over, and the collectives the split needs across them.

Without a ring they are the Ulysses group. With one (hybrid Ulysses × ring: the attention's K/V blocks pass around
`ring` ranks because its KV heads do not split further), a mixer's units still split over all `ulysses × ring`
ranks of the SP group — its heads are its own, not the attention's. The SP group is not a process group of its own
here, so each collective runs in two stages over the two sub-groups, SP rank `ring_rank · ulysses + ulysses_rank`
(`ShardOrder.of_groups`), and the rows are put in natural order afterwards: with a ring, the shards are cut
zig-zag (`ShardOrder`), so gathering them in SP-rank order gives the row in "shard order".

The ranks may hold different numbers of channels (`widths[q]`: SP rank q's; a mixer whose units do not divide by
the SP size gives some ranks one unit more: channels.py), so the exchanges move pieces of per-rank sizes:
`to_head_rows`: `[batch, seq/P, Σ widths]` (SP rank q's channels, rank after rank) → every token, natural order, of
this rank's channels `[batch, seq, widths[rank]]`; `to_shard` is its inverse. Over a ring, first the Ulysses
exchange (the channels of SP ranks `(r, u)`, for every ring rank r, → Ulysses rank `u`), then the ring's (→ ring
rank `r`): the received tokens are in SP-rank order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import all_gather_sequence, all_to_all
from lightning_ulysses.attention.copy_engine import CollectiveTransport
from lightning_ulysses.parallel.layout import ShardOrder


class _ExchangePieces(torch.autograd.Function):
    """Piece p to rank p of `group`, one piece back from each: `all_to_all_single` with per-rank split sizes
    (gloo and NCCL both take unequal and empty splits; gloo's list `all_to_all` takes equal pieces only:
    docs/internals.md). Its backward is the same exchange of the gradients, the other way."""

    @staticmethod
    def forward(ctx, group, receive_shapes, *pieces):
        ctx.group, ctx.send_shapes = group, [piece.shape for piece in pieces]
        return _all_to_all_pieces(group, pieces, receive_shapes)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_all_to_all_pieces(ctx.group, grads, ctx.send_shapes))


def _all_to_all_pieces(group, pieces, receive_shapes) -> tuple[torch.Tensor, ...]:
    sends = [piece.numel() for piece in pieces]
    receives = [shape.numel() for shape in map(torch.Size, receive_shapes)]
    flat = torch.cat([piece.reshape(-1) for piece in pieces])
    received = flat.new_empty(sum(receives))
    dist.all_to_all_single(received, flat, receives, sends, group=group)
    return tuple(part.view(shape) for part, shape in zip(received.split(receives), receive_shapes))


class SequenceRanks:
    """`ulysses`, `ring`: the sub-groups (None: one rank); `transport`: how the Ulysses all-to-alls move their
    bytes (the ring's take the collective)."""

    def __init__(self, ulysses=None, ring=None, transport=None):
        sizes = [1 if group is None else dist.get_world_size(group) for group in (ulysses, ring)]
        self.ulysses, self.ring = (group if size > 1 else None for group, size in zip((ulysses, ring), sizes))
        self.ulysses_size, self.ring_size = sizes
        self.transport = transport
        self.order, self.rank = ShardOrder.of_groups(self.ulysses, self.ring)
        self.ulysses_rank, self.ring_rank = self.rank % self.ulysses_size, self.rank // self.ulysses_size
        self.size = self.order.sequence_parallel_size
        self._natural: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _permutations(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard order → natural order, natural → shard order) index permutations of a row of `length` tokens."""
        key = (length, device)
        if key not in self._natural:
            shard_order = torch.cat([self.order.positions(length, rank) for rank in range(self.size)])
            self._natural[key] = (torch.argsort(shard_order).to(device), shard_order.to(device))
        return self._natural[key]

    def _exchange(self, pieces: list[torch.Tensor], receive_shapes: list, group) -> list[torch.Tensor]:
        """Piece p to rank p of `group`; returns the piece from each rank (of `receive_shapes`). Equal pieces on the
        Ulysses group go through its transport (a copy engine moves equal pieces only), the others through
        `all_to_all_single` with split sizes."""
        if group is None:
            return list(pieces)
        equal = len({piece.shape for piece in pieces} | {torch.Size(shape) for shape in receive_shapes}) == 1
        if group is self.ulysses and equal and self.transport is not None \
                and not isinstance(self.transport, CollectiveTransport):
            return list(all_to_all(torch.stack(pieces), group, 0, 0, transport=self.transport).unbind(0))
        return list(_ExchangePieces.apply(group, [tuple(shape) for shape in receive_shapes], *pieces))

    def _grid(self, widths: list[int]) -> list[list[int]]:
        """`widths` by (ring rank, Ulysses rank)."""
        return [widths[ring * self.ulysses_size:(ring + 1) * self.ulysses_size] for ring in range(self.ring_size)]

    def to_head_rows(self, shard: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """`[batch, seq/P, Σ widths]`, SP rank q's `widths[q]` channels rank after rank → `[batch, seq, widths[rank]]`."""
        batch, length, _ = shard.shape
        mine = widths[self.rank]
        grid = self._grid(widths)
        pieces = shard.split(widths, dim=-1)  # SP rank q = ring · ulysses_size + u
        # to Ulysses rank u: the channels of (r, u) for every ring rank r
        to_ulysses = [torch.cat([pieces[ring * self.ulysses_size + u] for ring in range(self.ring_size)], dim=-1)
                      for u in range(self.ulysses_size)]
        ours = sum(row[self.ulysses_rank] for row in grid)
        received = self._exchange(to_ulysses, [(batch, length, ours)] * self.ulysses_size, self.ulysses)
        if self.ring is None:
            return torch.cat(received, dim=1)
        # each Ulysses peer's channels of (r, my u) for every r → ring rank r, the peers' tokens in Ulysses order
        by_ring = [piece.split([row[self.ulysses_rank] for row in grid], dim=-1) for piece in received]
        to_ring = [torch.cat([parts[ring] for parts in by_ring], dim=1) for ring in range(self.ring_size)]
        rows = torch.cat(self._exchange(to_ring, [(batch, self.ulysses_size * length, mine)] * self.ring_size,
                                        self.ring), dim=1)
        return rows.index_select(1, self._permutations(rows.size(1), rows.device)[0])

    def to_shard(self, rows: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """`[batch, seq, widths[rank]]` → `[batch, seq/P, Σ widths]`: the inverse of `to_head_rows`."""
        batch, whole, mine = rows.shape
        length = whole // self.size
        grid = self._grid(widths)
        if self.ring is not None:
            rows = rows.index_select(1, self._permutations(whole, rows.device)[1])
            # to ring rank r: the tokens of SP ranks (r, u) for every u; from ring rank r: (my r, u)'s tokens of its
            # channels
            received = self._exchange(list(rows.split(self.ulysses_size * length, dim=1)),
                                      [(batch, self.ulysses_size * length, grid[ring][self.ulysses_rank])
                                       for ring in range(self.ring_size)], self.ring)
            by_ulysses = [piece.split(length, dim=1) for piece in received]
            to_ulysses = [torch.cat([parts[u] for parts in by_ulysses], dim=-1) for u in range(self.ulysses_size)]
        else:
            to_ulysses = list(rows.split(length, dim=1))
        received = self._exchange(to_ulysses, [(batch, length, sum(row[u] for row in grid))
                                               for u in range(self.ulysses_size)], self.ulysses)
        # from Ulysses rank u: the channels of (r, u) for every r, ring rank after ring rank
        by_ring = [piece.split([row[u] for row in grid], dim=-1) for u, piece in enumerate(received)]
        return torch.cat([by_ring[u][ring] for ring in range(self.ring_size) for u in range(self.ulysses_size)],
                         dim=-1)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over every SP rank, in place."""
        for group in (self.ulysses, self.ring):
            if group is not None:
                dist.all_reduce(tensor, group=group)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Whole rows of a tensor that needs no gradient (masks, positions), in natural order."""
        rows = all_gather_sequence(shard, self.ulysses, seq_dim=1)
        return all_gather_sequence(rows, self.ring, seq_dim=1, order=self.order if self.ring is not None else None)
