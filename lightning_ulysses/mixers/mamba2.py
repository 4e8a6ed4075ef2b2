"""Mamba2 mixers (Mamba2, Bamba, Nemotron-H, Falcon-H1, Granite 4 hybrid, Zamba2) split by heads.

One linear projects `[z | x | B | C | dt]`: a gate and an input of `head_dim` channels per head, B and C of
`state_size` channels per *group* (`n_groups` groups; head `h` reads group `h // (num_heads / n_groups)`, so each
group serves a contiguous range of heads) and one step per head; a depthwise convolution runs over `[x | B | C]`;
`A_log`, `D` and `dt_bias` hold one value per head. The unit is a head: a rank takes a contiguous range of heads
(⌈heads/SP⌉ or ⌊heads/SP⌋ of them) and the groups of B and C those heads read (`Shared`, channels.py `slots`):
whole groups where its heads are whole groups, the one group its heads all read (every rank, for the usual
`n_groups = 1`), or — where its heads read unequal parts of two groups — one copy of its group per head. A group
read by several ranks is projected once but exchanged to, and convolved on, each rank that reads it.

The gated RMSNorm over the scan's output normalises each group of `intermediate_size / n_groups` channels. When
every rank holds whole groups the norm runs unchanged (Falcon-H1's counting this rank's groups); else a group
spans ranks, and the view's norm is a stand-in whose sum of squares is summed over the SP group
(`_GatedRMSNormOverRanks`): the same choice on every rank, since the stand-in's sum is a collective.
Falcon-H1 also multiplies its input by `ssm_in_multiplier` (done on the shard) and the projection by its muP
vector (a buffer sliced like the projection), and its norm may be absent or gate after normalising.

On GPU: in training without a cache, these mixers hand the projected states to mamba_ssm's fused
`mamba_split_conv1d_scan_combined` where it is installed, which normalises and projects out itself from
`norm.weight` and `out_proj.weight`, around the split. The view is therefore not in training mode, which is all
that selects that path (the mixers read `self.training` nowhere else): it takes the path that calls the modules,
with the same causal-conv1d and mamba_ssm kernels for the convolution and the scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_ulysses.fences import _torch_private as torch_private
from lightning_ulysses.mixers.channels import ChannelLayout, Shared, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit, sum_over_ranks
from lightning_ulysses.mixers.ranks import SequenceRanks

_STRUCTURE = ("in_proj", "conv1d", "out_proj", "norm", "A_log", "D", "dt_bias", "num_heads", "head_dim", "n_groups",
              "ssm_state_size", "intermediate_size", "conv_dim")


def matches(module: torch.nn.Module) -> bool:
    if not all(hasattr(module, name) for name in _STRUCTURE):
        return False
    heads, groups, state, inner = module.num_heads, module.n_groups, module.ssm_state_size, module.intermediate_size
    return (inner == heads * module.head_dim and heads % groups == 0 and module.conv_dim == inner + 2 * groups * state
            and getattr(module.in_proj, "out_features", None) == inner + module.conv_dim + heads
            and tuple(module.A_log.shape) == (heads,))


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    heads, width, groups, state = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    group_channels = Shared(state)
    projection = ChannelLayout(heads, (width, width, group_channels, group_channels, 1), groups)
    convolution = ChannelLayout(heads, (width, group_channels, group_channels), groups)
    per_head, inner = ChannelLayout(heads, (1,)), ChannelLayout(heads, (width,))
    mine = unit_range(heads, parts, rank)
    local_heads, local_groups = len(mine), len(projection.slots(rank, parts))
    local_inner, local_conv = local_heads * width, local_heads * width + 2 * local_groups * state
    parameters = {"conv1d.weight": (0, convolution), "A_log": (0, per_head), "D": (0, per_head),
                  "dt_bias": (0, per_head)}
    if module.conv1d.bias is not None:
        parameters["conv1d.bias"] = (0, convolution)
    if "mup_vector" in torch_private.buffer_table(module):  # Falcon-H1: one multiplier per projected channel
        parameters["mup_vector"] = (module.mup_vector.dim() - 1, projection)
    attributes = {
        # the path that calls the modules (module docstring): training mode selects nothing else in these mixers
        "training": False,
        "num_heads": local_heads, "intermediate_size": local_inner, "n_groups": local_groups, "conv_dim": local_conv,
        "conv1d.in_channels": local_conv, "conv1d.out_channels": local_conv, "conv1d.groups": local_conv,
    }
    replaced = {}
    if getattr(module.norm, "weight", None) is not None:  # (Falcon-H1 may have none: a gate alone)
        parameters["norm.weight"] = (0, inner)
        per_group = heads // groups
        if all(len(heads_of) % per_group == 0 and heads_of.start % per_group == 0
               for heads_of in (unit_range(heads, parts, other) for other in range(parts))):  # whole groups
            if hasattr(module.norm, "norm_before_gate"):  # Falcon-H1's norm counts its groups, the others' size them
                attributes["norm.n_groups"] = local_heads // per_group
        else:
            replaced["norm"] = norm_over_ranks(per_group * width, groups,
                                               range(mine.start * width, mine.stop * width))
    return MixerSplit(
        units=heads,
        inputs={"in_proj": projection},
        output=("out_proj", inner),
        parameters=parameters,
        attributes=attributes,
        input_multiplier="ssm_in_multiplier" if hasattr(module, "ssm_in_multiplier") else None,
        replaced=replaced,
    )


def norm_over_ranks(group_size: int, groups: int, channels: range):
    """The `MixerSplit.replaced` factory of an RMS norm over `groups` groups of `group_size` channels whose groups span
    ranks, for the rank holding the consecutive `channels` (its heads' channels); also MiniMax's norm over every head
    (one group)."""

    def make(norm: torch.nn.Module, ranks: SequenceRanks) -> torch.nn.Module:
        return _GatedRMSNormOverRanks(norm, ranks, torch.arange(channels.start, channels.stop) // group_size,
                                      group_size, groups)

    return make


class _GatedRMSNormOverRanks(torch.nn.Module):
    """The gated RMSNorm of a Mamba2 mixer in a local view whose norm groups span ranks: each group's sum of squares
    is this rank's part summed over the SP group; then as the family's norm (weight, gate and casts in its order).

    `group_of_channel`: the (global) norm group of each of this rank's channels."""

    def __init__(self, norm: torch.nn.Module, ranks: SequenceRanks, group_of_channel: torch.Tensor, group_size: int, groups: int):
        super().__init__()
        self.weight, self.eps, self.ranks = norm.weight, norm.variance_epsilon, ranks
        self.group_of_channel, self.group_size, self.groups = group_of_channel, group_size, groups
        # Falcon-H1's norm may gate after normalising, and multiplies by its weight in float32 before casting back
        self.falcon = hasattr(norm, "norm_before_gate")
        self.gate_after = self.falcon and norm.norm_before_gate

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        states = hidden_states.to(torch.float32)
        if gate is not None and not self.gate_after:
            states = states * F.silu(gate.to(torch.float32))
        index = self.group_of_channel.to(states.device)
        squares = states.pow(2)
        partial = squares.new_zeros(*squares.shape[:-1], self.groups).index_add(-1, index, squares)
        variance = sum_over_ranks(partial, self.ranks).index_select(-1, index) / self.group_size
        states = states * torch.rsqrt(variance + self.eps)
        if not self.falcon:
            return self.weight * states.to(dtype)
        states = self.weight * states
        if gate is not None and self.gate_after:
            states = states * F.silu(gate.to(torch.float32))
        return states.to(dtype)
