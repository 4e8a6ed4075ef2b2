"""Mamba (Mamba1: Mamba, Falcon-Mamba, Jamba's Mamba layers) split by channels.

The layer projects `[x | z]` (one channel each per channel of `intermediate_size`), convolves x depthwise along the
sequence and runs one selective recurrence per channel (its decay `A_log` and skip `D` rows, its step from
`dt_proj`'s rows), gated by z: channels meet only in `x_proj`, which maps every channel to the step, B and C that
all channels share. So the unit is a channel, and `x_proj` is a `SumOfPartialProducts` (head_split.py): each rank
multiplies its channels' columns of the weight, the partial products are summed over the SP group. Jamba and
Falcon-Mamba normalise the step, B and C after `x_proj` (RMSNorms over those shared channels): they read the sum,
so they run unchanged.

On GPU: in training without a cache, Mamba (and Falcon-Mamba up to transformers 5.24) call `mamba_inner_fn`,
mamba_ssm's fused kernel where it is installed (or the kernels hub's), which reads `x_proj`'s, `dt_proj`'s and
`out_proj`'s weights instead of calling them, around the split. The view is therefore not in training mode, which is all that selects that path
(these mixers read `self.training` nowhere else): it takes the path that calls the modules, with the same
causal-conv1d and selective-scan kernels where they are installed. Jamba, and Falcon-Mamba from 5.25 on, have no
fused path.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit, SumOfPartialProducts
from lightning_ulysses.mixers.lora import base_linear


def matches(module: torch.nn.Module) -> bool:
    channels = getattr(module, "intermediate_size", None)
    in_proj, x_proj, dt_proj, out_proj = (base_linear(getattr(module, name, None))
                                          for name in ("in_proj", "x_proj", "dt_proj", "out_proj"))
    return (isinstance(channels, int) and all(linear is not None for linear in (in_proj, x_proj, dt_proj, out_proj))
            and isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d) and module.conv1d.groups == channels
            and hasattr(module, "A_log") and hasattr(module, "D") and in_proj.out_features == 2 * channels
            and x_proj.in_features == channels and dt_proj.out_features == channels)


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    channels = module.intermediate_size
    per_channel = ChannelLayout(channels, (1,))
    parameters = {name: (0, per_channel) for name in ("conv1d.weight", "A_log", "D", "dt_proj.weight")}
    parameters["x_proj.weight"] = (1, per_channel)  # its input channels: a partial product (module docstring)
    for bias in ("conv1d.bias", "dt_proj.bias"):
        if module.get_submodule(bias.split(".")[0]).bias is not None:
            parameters[bias] = (0, per_channel)
    local = len(unit_range(channels, parts, rank))
    return MixerSplit(
        units=channels,
        inputs={"in_proj": ChannelLayout(channels, (1, 1))},
        output=("out_proj", per_channel),
        parameters=parameters,
        replaced={"x_proj": SumOfPartialProducts},
        attributes={"intermediate_size": local, "conv1d.in_channels": local, "conv1d.out_channels": local,
                    "conv1d.groups": local, "dt_proj.out_features": local,
                    "training": False},  # the path that calls the modules (module docstring)
    )
