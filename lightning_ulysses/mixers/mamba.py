"""Mamba (Mamba1: Mamba, Falcon-Mamba, Jamba's Mamba layers) split by channels.

The layer projects `[x | z]` (one channel each per channel of `intermediate_size`), convolves x depthwise along the
sequence and runs one selective recurrence per channel (its decay `A_log` and skip `D` rows, its step from
`dt_proj`'s rows), gated by z: channels meet only in `x_proj`, which maps every channel to the step, B and C that
all channels share. So the unit is a channel, and `x_proj` is reduced over the SP group (head_split.py: each rank
multiplies its channels' slice of the weight, the partial products are summed). Jamba and Falcon-Mamba normalise
the step, B and C after `x_proj` (RMSNorms over those shared channels): they read the summed result, so they run
unchanged.

Falcon-Mamba's and Mamba's forward in training calls `mamba_inner_fn`, a fused kernel (mamba-ssm, or the kernels
hub) that reads `x_proj`'s and `out_proj`'s weights instead of calling them, which would skip the split: the local
view says it is not training (the forward reads `self.training` for that choice alone), so it takes the unfused
path, which calls the projections, and the same convolution and scan kernels where they are installed.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout
from lightning_ulysses.mixers.head_split import MixerSplit


def matches(module: torch.nn.Module) -> bool:
    channels = getattr(module, "intermediate_size", None)
    linears = [getattr(module, name, None) for name in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    return (isinstance(channels, int) and all(isinstance(linear, torch.nn.Linear) for linear in linears)
            and isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d) and module.conv1d.groups == channels
            and hasattr(module, "A_log") and hasattr(module, "D") and module.in_proj.out_features == 2 * channels
            and module.x_proj.in_features == channels and module.dt_proj.out_features == channels)


def split(module: torch.nn.Module, parts: int) -> MixerSplit:
    channels = module.intermediate_size
    per_channel = ChannelLayout(channels, (1,))
    parameters = {name: (0, per_channel) for name in ("conv1d.weight", "A_log", "D", "dt_proj.weight")}
    for bias in ("conv1d.bias", "dt_proj.bias"):
        if module.get_submodule(bias.split(".")[0]).bias is not None:
            parameters[bias] = (0, per_channel)
    local = channels // parts
    return MixerSplit(
        units=channels,
        inputs={"in_proj": ChannelLayout(channels, (1, 1))},
        output=("out_proj", per_channel),
        parameters=parameters,
        reduced={"x_proj": per_channel},
        attributes={"intermediate_size": local, "conv1d.in_channels": local, "conv1d.out_channels": local,
                    "conv1d.groups": local, "dt_proj.out_features": local,
                    "training": False},  # the unfused path (module docstring)
    )
