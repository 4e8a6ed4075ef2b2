"""Gated short convolutions (LFM2) split by channels.

The layer projects `[B | C | x]` (one channel each per hidden channel), convolves `B * x` depthwise along the
sequence and gates the result by `C`: every channel is independent of the others until the output projection,
so the unit is a channel.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit
from lightning_ulysses.mixers.lora import base_linear


def matches(module: torch.nn.Module) -> bool:
    conv = getattr(module, "conv", None)
    in_proj = base_linear(getattr(module, "in_proj", None))
    return (isinstance(conv, torch.nn.Conv1d) and in_proj is not None
            and conv.groups == conv.in_channels == conv.out_channels and in_proj.out_features == 3 * conv.in_channels
            and hasattr(module, "out_proj"))


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    channels = module.conv.in_channels
    per_channel = ChannelLayout(channels, (1,))
    parameters = {"conv.weight": (0, per_channel)}
    if module.conv.bias is not None:
        parameters["conv.bias"] = (0, per_channel)
    local = len(unit_range(channels, parts, rank))
    return MixerSplit(
        units=channels,
        inputs={"in_proj": ChannelLayout(channels, (1, 1, 1))},
        output=("out_proj", per_channel),
        parameters=parameters,
        attributes={"conv.in_channels": local, "conv.out_channels": local, "conv.groups": local},
    )
