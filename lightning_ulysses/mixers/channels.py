"""Which channels of a token mixer's projections belong to which SP rank, and the two all-to-alls that move them.

A mixer split by heads gives each SP rank a contiguous range of its *units* (key heads of Gated DeltaNet, channels
of a short convolution, ...). A projection's output channels are laid out in segments (Qwen3.5's `in_proj_qkv`:
every query head, then every key head, then every value head), each segment unit-major: `units × width` channels,
the `width` channels of unit 0 first. A segment can also be *replicated*: channels every rank needs whole; or
*shared*: channels of groups that consecutive units read together (Mamba2's B and C: each of `n_groups` groups
serves a contiguous range of heads), of which each rank takes the groups its units read (whole groups when the
groups divide by the SP size, else the one group its units all read, which the ranks around it take too).

`to_head_rows`: this rank's tokens of every channel `[batch, seq/P, C]` → every token of this rank's channels
`[batch, seq, C_local]` (the channels of each segment, segment by segment, as the mixer's own code lays them out
for fewer units). `to_shard` is its inverse for an output projection's input (no replicated channels there).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lightning_ulysses.mixers.ranks import SequenceRanks


@dataclass(frozen=True)
class Replicated:
    """A segment of `channels` channels that every rank takes whole."""

    channels: int


@dataclass(frozen=True)
class Shared:
    """A segment of `groups × width` channels, group-major, that the units read by groups: unit `u` reads group
    `u // (units / groups)`. A rank takes the groups its units read."""

    groups: int
    width: int


@dataclass(frozen=True)
class ChannelLayout:
    """`segments` in order, each an int (channels per unit, `units` of them, unit-major), `Replicated` or `Shared`."""

    units: int
    segments: tuple[int | Replicated | Shared, ...]

    @property
    def channels(self) -> int:
        return sum(s.channels if isinstance(s, Replicated) else s.groups * s.width if isinstance(s, Shared)
                   else self.units * s for s in self.segments)

    def local_channels(self, rank: int, parts: int) -> torch.Tensor:
        """The channels (indices into the whole layout) of rank `rank` of `parts`, in the local layout's order."""
        units = self.units // parts
        pieces, offset = [], 0
        for segment in self.segments:
            if isinstance(segment, Replicated):
                pieces.append(torch.arange(offset, offset + segment.channels))
                offset += segment.channels
                continue
            if isinstance(segment, Shared):
                per_group = self.units // segment.groups  # units reading each group
                first, last = rank * units // per_group, ((rank + 1) * units - 1) // per_group
                pieces.append(torch.arange(offset + first * segment.width, offset + (last + 1) * segment.width))
                offset += segment.groups * segment.width
                continue
            start = offset + rank * units * segment
            pieces.append(torch.arange(start, start + units * segment))
            offset += self.units * segment
        return torch.cat(pieces)

    def is_rank_major(self, parts: int) -> bool:
        """Whether rank r's channels are already the r-th contiguous slice (no reordering needed)."""
        return len(self.segments) == 1 and isinstance(self.segments[0], int) or parts == 1

    def rank_major(self, parts: int) -> torch.Tensor:
        """Every rank's local channels, rank after rank (replicated channels appear once per rank)."""
        return torch.cat([self.local_channels(rank, parts) for rank in range(parts)])


class ChannelExchange:
    """The all-to-alls of one layout over the SP ranks (indices built once, moved to the data's device once)."""

    def __init__(self, layout: ChannelLayout, ranks: SequenceRanks):
        parts = ranks.size
        if layout.units % parts:
            raise ValueError(f"{layout.units} units cannot be split over {parts} ranks")
        if len({len(layout.local_channels(rank, parts)) for rank in range(parts)}) != 1:
            # (shared groups that neither divide by the ranks nor the ranks by them): the exchange sends equal pieces
            raise ValueError(f"{layout} gives the {parts} ranks unequal numbers of channels")
        self.layout, self.ranks, self.parts = layout, ranks, parts
        self._indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @cached_property
    def _order(self) -> torch.Tensor | None:
        return None if self.layout.is_rank_major(self.parts) else self.layout.rank_major(self.parts)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._indices:
            order = self._order
            self._indices[device] = (order.to(device), torch.argsort(order).to(device))
        return self._indices[device]

    def to_head_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """`[batch, seq/P, C]` → `[batch, seq, C_local]`."""
        if self._order is not None:
            shard = shard.index_select(-1, self._on(shard.device)[0])
        batch, length, channels = shard.shape
        return self.ranks.to_head_rows(shard.reshape(batch, length, self.parts, channels // self.parts))

    def to_shard(self, rows: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, C_local]` → `[batch, seq/P, C]` in the whole layout's channel order."""
        batch, length, local = rows.shape
        shard = self.ranks.to_shard(rows).reshape(batch, length // self.parts, self.parts * local)
        if self._order is not None:
            shard = shard.index_select(-1, self._on(shard.device)[1])
        return shard
