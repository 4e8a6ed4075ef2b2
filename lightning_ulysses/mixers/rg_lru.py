"""RecurrentGemma's recurrent block (Griffin's RG-LRU) split by heads.

The block projects `x` and `y` (one channel each per recurrence channel), convolves `x` depthwise along the
sequence, runs the RG-LRU over it and gates the result by `gelu(y)`. The RG-LRU's input and recurrence gates are
block-diagonal — one `block_width × block_width` block per head — and its recurrence is per channel, so the unit is
a head with its `block_width` channels: a rank takes a contiguous range of heads, their channels of both projections
and of the convolution, their gate blocks and their recurrence parameters. The block keeps its recurrent and
convolution states as attributes of itself and of its RG-LRU when the model runs with a cache; in a local view those
are the view's own (shallow copies, started empty), so the module itself is never written to.
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit
from lightning_ulysses.mixers.lora import base_linear

_GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def matches(module: torch.nn.Module) -> bool:
    lru = getattr(module, "rg_lru", None)
    return (all(base_linear(getattr(module, name, None)) is not None for name in ("linear_x", "linear_y", "linear_out"))
            and isinstance(getattr(module, "conv_1d", None), torch.nn.Conv1d) and lru is not None
            and all(hasattr(lru, name) for name in ("num_attention_heads", "block_width", "recurrent_param", *_GATES)))


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    heads, width = module.rg_lru.num_attention_heads, module.rg_lru.block_width
    per_channel, per_head = ChannelLayout(heads, (width,)), ChannelLayout(heads, (1,))
    local_heads = len(unit_range(heads, parts, rank))
    local = local_heads * width
    parameters = {"conv_1d.weight": (0, per_channel), "rg_lru.recurrent_param": (0, per_channel),
                  **{f"rg_lru.{name}": (0, per_head) for name in _GATES}}
    if module.conv_1d.bias is not None:
        parameters["conv_1d.bias"] = (0, per_channel)
    return MixerSplit(
        units=heads,
        inputs={"linear_x": per_channel, "linear_y": per_channel},
        output=("linear_out", per_channel),
        parameters=parameters,
        attributes={"lru_width": local, "rg_lru.num_attention_heads": local_heads, "conv_1d.in_channels": local,
                    "conv_1d.out_channels": local, "conv_1d.groups": local,
                    # a view runs whole rows from no state: the model's cache set-up gives the module itself states
                    # of every head, which the view starts afresh for its heads
                    "conv1d_state": None, "rg_lru.recurrent_states": None},
        masks_input=False,  # the block does not zero padded tokens' states itself
    )
