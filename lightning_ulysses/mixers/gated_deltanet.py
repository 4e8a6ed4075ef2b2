"""Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-hybrid) split by value heads.

Each value head has its own state, decay (`A_log`), step (`dt_bias`) and gate; `num_v_heads / num_k_heads`
consecutive value heads read one key head's query and key (as Mamba2's heads read its groups of B and C). So the
unit is a value head and the key heads are its groups (`Shared`, channels.py): a rank takes a contiguous range of
value heads (⌈v/SP⌉ or ⌊v/SP⌋ of them) and the key heads they read — whole key heads with their value heads where
the split allows, else one copy of its key head per value head (`ChannelLayout.slots`) — with their channels of
the depthwise convolution over `[query | key | value]`. The gated output norm normalises each value head on its
own, so it runs unchanged.

Qwen3-Next projects `[query | key | value | z]` per key head in one linear (`in_proj_qkvz`) and `[b | a]` in
another; Qwen3.5 projects query, key and value of every head in one linear, then z, b and a in three more;
OLMo-hybrid projects each of query, key, value, a, b and the gate g on its own.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout, Shared, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit


_SEPARATE = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")


def matches(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d",
                                                  "A_log", "dt_bias")) and (
        hasattr(module, "out_proj") and (hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv"))
        or all(hasattr(module, name) for name in _SEPARATE))


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    key_heads, value_heads = module.num_k_heads, module.num_v_heads
    key_width, value_width = module.head_k_dim, module.head_v_dim
    key = Shared(key_width)  # a key head's channels (of the query or the key), read by its value heads

    def layout(*widths: int | Shared, by_group: bool = False) -> ChannelLayout:
        return ChannelLayout(value_heads, widths, key_heads, by_group)

    output = "out_proj"
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: key head after key head, its value heads' channels with it
        inputs = {"in_proj_qkvz": layout(key, key, value_width, value_width, by_group=True),
                  "in_proj_ba": layout(1, 1, by_group=True)}
    elif hasattr(module, "in_proj_qkv"):  # Qwen3.5: every head's query, then key, then value
        inputs = {"in_proj_qkv": layout(key, key, value_width), "in_proj_z": layout(value_width),
                  "in_proj_b": layout(1), "in_proj_a": layout(1)}
    else:  # OLMo-hybrid: one projection each
        inputs = {"q_proj": layout(key), "k_proj": layout(key), "v_proj": layout(value_width),
                  "a_proj": layout(1), "b_proj": layout(1), "g_proj": layout(value_width)}
        output = "o_proj"
    convolution = layout(key, key, value_width)
    local_values = len(unit_range(value_heads, parts, rank))
    local_keys = len(convolution.slots(rank, parts))
    key_dim, value_dim = local_keys * key_width, local_values * value_width
    conv_channels = 2 * key_dim + value_dim
    parameters = {"conv1d.weight": (0, convolution), "A_log": (0, layout(1)), "dt_bias": (0, layout(1))}
    if module.conv1d.bias is not None:
        parameters["conv1d.bias"] = (0, convolution)
    return MixerSplit(
        units=value_heads,
        inputs=inputs,
        output=(output, layout(value_width)),
        parameters=parameters,
        attributes={"num_k_heads": local_keys, "num_v_heads": local_values, "key_dim": key_dim,
                    "value_dim": value_dim, "conv_dim": conv_channels, "conv1d.in_channels": conv_channels,
                    "conv1d.out_channels": conv_channels, "conv1d.groups": conv_channels},
    )
