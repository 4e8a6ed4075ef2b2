"""Which channels of a token mixer's projections belong to which SP rank, and the two all-to-alls that move them.

A mixer split by heads gives each SP rank a contiguous range of its *units* (value heads of Gated DeltaNet, channels
of a short convolution, ...), in rank order: `⌈U/P⌉` units to each of the first `U mod P` ranks, `⌊U/P⌋` to the
others (`unit_range`; every rank the same number when they divide). A projection's output channels are laid out in
segments (Qwen3.5's `in_proj_qkv`: every query head, then every key head, then every value head), each segment
unit-major: `units × width` channels, the `width` channels of unit 0 first. A segment can also be *replicated*:
channels every rank needs whole; or *shared*: `width` channels per *group*, where the units are cut in `groups`
consecutive runs that read one group each (Mamba2's B and C, Gated DeltaNet's key heads read by its value heads).
A layout can also be *grouped* (`by_group`): group after group, each group's segments (Qwen3-Next's
`in_proj_qkvz`: per key head its query, key, and its value heads' values and gates).

The groups a rank takes (`ChannelLayout.slots`): a mixer's own code gives each of its `n` groups `units / n`
consecutive units (`repeat_interleave`), so a rank's view must read equally many of its units from each group it
holds. Where its units read whole groups, or all read one, those groups (once each); else — its units cut across
a group boundary unevenly, as an uneven split or groups that do not divide by the SP size may do — one copy of
its group per unit (the copies' channels are projected once and exchanged to each slot that reads them; their
gradients sum back through the exchange).

`ChannelExchange.to_head_rows`: this rank's tokens of every channel `[batch, seq/P, C]` → every token of this rank's
channels `[batch, seq, C_local]` (the channels of each segment, segment by segment, as the mixer's own code lays
them out for its units). `to_shard` is its inverse for an output projection's input (no replicated or shared
channels there). The ranks' channel counts may differ: the exchanges move pieces of per-rank sizes (ranks.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import torch

from lightning_ulysses.mixers.ranks import SequenceRanks


def unit_range(units: int, parts: int, rank: int) -> range:
    """The units of rank `rank` when `units` split over `parts` ranks: contiguous, in rank order, one more for each
    of the first `units mod parts` ranks."""
    base, extra = divmod(units, parts)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True)
class Replicated:
    """A segment of `channels` channels that every rank takes whole."""

    channels: int


@dataclass(frozen=True)
class Shared:
    """A segment of `width` channels per group of the layout (its `groups`): a rank takes those of its slots."""

    width: int


@dataclass(frozen=True)
class ChannelLayout:
    """`segments` in order, each an int (channels per unit, `units` of them, unit-major), `Replicated` or `Shared`
    (channels per group: unit `u` reads group `u // (units / groups)`); `by_group`: group after group, each with its
    segments (of its own units and itself)."""

    units: int
    segments: tuple[int | Replicated | Shared, ...]
    groups: int | None = None  # None: as many as units
    by_group: bool = False

    def __post_init__(self):
        if self.units % self.group_count:
            raise ValueError(f"{self.units} units do not read {self.group_count} groups equally")
        if self.by_group and any(isinstance(segment, Replicated) for segment in self.segments):
            raise ValueError("a layout grouped by group holds no replicated segment")

    @property
    def group_count(self) -> int:
        return self.units if self.groups is None else self.groups

    @property
    def per_group(self) -> int:
        return self.units // self.group_count

    def _width(self, segment) -> int:
        """Channels of `segment` in the whole layout (per group block when `by_group`)."""
        if isinstance(segment, Replicated):
            return segment.channels
        count = (1 if self.by_group else self.group_count) if isinstance(segment, Shared) else \
            (self.per_group if self.by_group else self.units)
        return count * (segment.width if isinstance(segment, Shared) else segment)

    @property
    def channels(self) -> int:
        blocks = self.group_count if self.by_group else 1
        return blocks * sum(self._width(segment) for segment in self.segments)

    def slots(self, rank: int, parts: int) -> tuple[int, ...]:
        """The groups of rank `rank`'s view, in order (module docstring): each group its units read, once, when
        they read equally many from each; else the group of each of its units."""
        read = [unit // self.per_group for unit in unit_range(self.units, parts, rank)]
        counts = Counter(read)
        return tuple(counts) if len(set(counts.values())) == 1 else tuple(read)

    def local_channels(self, rank: int, parts: int) -> torch.Tensor:
        """The channels (indices into the whole layout) of rank `rank` of `parts`, in the local layout's order."""
        units, slots = unit_range(self.units, parts, rank), self.slots(rank, parts)
        if not self.by_group:
            pieces, offset = [], 0
            for segment in self.segments:
                if isinstance(segment, Replicated):
                    pieces.append(torch.arange(offset, offset + segment.channels))
                elif isinstance(segment, Shared):
                    pieces += [torch.arange(offset + group * segment.width, offset + (group + 1) * segment.width)
                               for group in slots]
                else:
                    pieces.append(torch.arange(offset + units.start * segment, offset + units.stop * segment))
                offset += self._width(segment)
            return torch.cat(pieces)
        block = sum(self._width(segment) for segment in self.segments)
        per_slot = len(units) // len(slots)
        pieces = []
        for index, group in enumerate(slots):
            first = units.start + index * per_slot - group * self.per_group  # the slot's first unit within its group
            offset = group * block
            for segment in self.segments:
                if isinstance(segment, Shared):
                    pieces.append(torch.arange(offset, offset + segment.width))
                else:
                    pieces.append(torch.arange(offset + first * segment, offset + (first + per_slot) * segment))
                offset += self._width(segment)
        return torch.cat(pieces)

    def rank_major(self, parts: int) -> torch.Tensor:
        """Every rank's local channels, rank after rank (replicated and shared channels once per rank reading them)."""
        return torch.cat([self.local_channels(rank, parts) for rank in range(parts)])


class ChannelExchange:
    """The all-to-alls of one layout over the SP ranks (indices built once, moved to the data's device once)."""

    def __init__(self, layout: ChannelLayout, ranks: SequenceRanks):
        parts = ranks.size
        if layout.units < parts:
            raise ValueError(f"{layout.units} units cannot be split over {parts} ranks")
        self.layout, self.ranks, self.parts = layout, ranks, parts
        self.widths = [len(layout.local_channels(rank, parts)) for rank in range(parts)]
        self._device_indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @cached_property
    def _order(self) -> torch.Tensor | None:
        """The rank-major order of the channels; None when it is the layout's own (no copy needed)."""
        order = self.layout.rank_major(self.parts)
        return None if torch.equal(order, torch.arange(self.layout.channels)) else order

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device_indices:
            order = self._order
            self._device_indices[device] = (order.to(device), torch.argsort(order).to(device))
        return self._device_indices[device]

    def to_head_rows(self, shard: torch.Tensor) -> torch.Tensor:
        """`[batch, seq/P, C]` → `[batch, seq, C_local]`."""
        if self._order is not None:
            shard = shard.index_select(-1, self._on(shard.device)[0])
        return self.ranks.to_head_rows(shard, self.widths)

    def to_shard(self, rows: torch.Tensor) -> torch.Tensor:
        """`[batch, seq, C_local]` → `[batch, seq/P, C]` in the whole layout's channel order."""
        shard = self.ranks.to_shard(rows, self.widths)
        if self._order is not None:
            shard = shard.index_select(-1, self._on(shard.device)[1])
        return shard
