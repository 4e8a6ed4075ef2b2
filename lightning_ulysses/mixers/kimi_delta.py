"""Kimi Delta Attention (Kimi Linear) split by heads.

Each head has its query, key and value channels (three projections, one short depthwise convolution over
`[query | key | value]`), its forget gate (per-channel decay: `dt_bias`, and `A_log` per head), its step `beta`
(`b_proj`) and its output gate; the gated output norm normalises each head on its own, so it runs unchanged.

The forget and output gates are low-rank: `f_a_proj` / `g_a_proj` map the hidden states to a few channels every head
reads, `f_b_proj` / `g_b_proj` map those to each head's channels. The first half runs on the shard and its few
channels are exchanged whole to every rank (a replicated segment: each rank receives every token of them), the
second half is narrowed to this rank's heads (its output channels) and runs on those whole rows: `1/SP` of its
work, and fewer bytes exchanged than its per-head output would need.

Bailing-hybrid (Ling 2.5) runs the same rule with full-rank gates: `forget_gate.f_proj` and `g_proj` map the hidden
states to each head's channels directly (split like `q_proj`), and its `A_log` holds one value per head.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout, Replicated, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit
from lightning_ulysses.mixers.lora import base_linear

_LINEARS = ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj")
_LOW_RANK_GATES = ("g_a_proj", "g_b_proj", "forget_gate.f_a_proj", "forget_gate.f_b_proj")
_FULL_RANK_GATES = ("g_proj", "forget_gate.f_proj")  # Bailing-hybrid


def _linear(module: torch.nn.Module, path: str) -> bool:
    try:
        return base_linear(module.get_submodule(path)) is not None
    except AttributeError:
        return False


def matches(module: torch.nn.Module) -> bool:
    gates = _LOW_RANK_GATES if _linear(module, "g_a_proj") else _FULL_RANK_GATES
    return (all(_linear(module, path) for path in _LINEARS + gates)
            and isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d)
            and all(hasattr(module, name) for name in ("num_heads", "head_dim", "qkv_dim", "o_norm"))
            and all(hasattr(module.forget_gate, name) for name in ("A_log", "dt_bias")))


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    heads, width = module.num_heads, module.head_dim
    per_head = ChannelLayout(heads, (width,))
    convolution = ChannelLayout(heads, (width, width, width))
    # A_log: [1, 1, heads, 1] (Kimi) or [heads] (Bailing)
    parameters = {"conv1d.weight": (0, convolution), "forget_gate.dt_bias": (0, per_head),
                  "forget_gate.A_log": (module.forget_gate.A_log.dim() // 2, ChannelLayout(heads, (1,)))}
    if hasattr(module, "g_a_proj"):
        gates = {"g_a_proj": ChannelLayout(heads, (Replicated(base_linear(module.g_a_proj).out_features),)),
                 "forget_gate.f_a_proj": ChannelLayout(
                     heads, (Replicated(base_linear(module.forget_gate.f_a_proj).out_features),))}
        parameters.update({"g_b_proj.weight": (0, per_head), "forget_gate.f_b_proj.weight": (0, per_head)})
    else:
        gates = {"g_proj": per_head, "forget_gate.f_proj": per_head}
    if module.conv1d.bias is not None:
        parameters["conv1d.bias"] = (0, convolution)
    local = len(unit_range(heads, parts, rank))
    channels = local * width
    return MixerSplit(
        units=heads,
        inputs={"q_proj": per_head, "k_proj": per_head, "v_proj": per_head, "b_proj": ChannelLayout(heads, (1,)),
                **gates},
        output=("o_proj", per_head),
        parameters=parameters,
        attributes={"num_heads": local, "qkv_dim": channels, "conv_dim": 3 * channels,
                    "conv1d.in_channels": 3 * channels, "conv1d.out_channels": 3 * channels,
                    "conv1d.groups": 3 * channels, "forget_gate.num_heads": local, "forget_gate.qkv_dim": channels},
    )
