"""Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE and OLMo-hybrid) split by key heads.

Each key head comes with `num_v_heads / num_k_heads` value heads (they share its query and key), so the unit is a
key head with its value heads: a rank takes a contiguous range of key heads, the value heads that read them, their
channels of the depthwise convolution over `[query | key | value]`, and their decay (`A_log`) and step (`dt_bias`).
The gated output norm normalises each value head on its own, so it runs unchanged.

Qwen3-Next projects `[query | key | value | z]` per key head in one linear (`in_proj_qkvz`) and `[b | a]` in
another; Qwen3.5 projects query, key and value of every head in one linear, then z, b and a in three more;
OLMo-hybrid projects each of query, key, value, a, b and the gate g on its own.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout
from lightning_ulysses.mixers.head_split import MixerSplit


_SEPARATE = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")


def matches(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d",
                                                  "A_log", "dt_bias")) and (
        hasattr(module, "out_proj") and (hasattr(module, "in_proj_qkvz") or hasattr(module, "in_proj_qkv"))
        or all(hasattr(module, name) for name in _SEPARATE))


def split(module: torch.nn.Module, parts: int) -> MixerSplit:
    heads, value_heads = module.num_k_heads, module.num_v_heads
    key_width, value_width = module.head_k_dim, module.head_v_dim
    per_head = value_heads // heads  # value heads per key head
    values = per_head * value_width  # value channels per key head

    def layout(*widths: int) -> ChannelLayout:
        return ChannelLayout(heads, widths)

    output = "out_proj"
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: grouped by key head
        inputs = {"in_proj_qkvz": layout(2 * key_width + 2 * values), "in_proj_ba": layout(2 * per_head)}
    elif hasattr(module, "in_proj_qkv"):  # Qwen3.5: every head's query, then key, then value
        inputs = {"in_proj_qkv": layout(key_width, key_width, values), "in_proj_z": layout(values),
                  "in_proj_b": layout(per_head), "in_proj_a": layout(per_head)}
    else:  # OLMo-hybrid: one projection each
        inputs = {"q_proj": layout(key_width), "k_proj": layout(key_width), "v_proj": layout(values),
                  "a_proj": layout(per_head), "b_proj": layout(per_head), "g_proj": layout(values)}
        output = "o_proj"
    convolution = layout(key_width, key_width, values)
    local_heads = heads // parts
    conv_channels = local_heads * (2 * key_width + values)
    parameters = {"conv1d.weight": (0, convolution), "A_log": (0, layout(per_head)),
                  "dt_bias": (0, layout(per_head))}
    if module.conv1d.bias is not None:
        parameters["conv1d.bias"] = (0, convolution)
    return MixerSplit(
        units=heads,
        inputs=inputs,
        output=(output, layout(values)),
        parameters=parameters,
        attributes={"num_k_heads": local_heads, "num_v_heads": local_heads * per_head,
                    "key_dim": local_heads * key_width, "value_dim": local_heads * values, "conv_dim": conv_channels,
                    "conv1d.in_channels": conv_channels, "conv1d.out_channels": conv_channels,
                    "conv1d.groups": conv_channels},
    )
