"""MiniMax's lightning attention (linear attention with per-head decay) split by heads.

Each head projects its `[query | key | value]` (one linear, grouped by head), runs its blocks with its own decay
(the buffers `slope_rate`, `query_decay`, `key_decay`, `diagonal_decay`, one slice per head) and is gated by its
channels of `output_gate`. The output norm is one RMS norm over every head's channels: over several ranks it is
Mamba2's norm over ranks with one group (mamba2.py `norm_over_ranks`: the sum of squares summed over the SP group).
The layer masks padded tokens after its projection, on whole rows, itself. It runs in PyTorch alone (no kernel).
"""

from __future__ import annotations

import torch

from lightning_ulysses.mixers.channels import ChannelLayout, unit_range
from lightning_ulysses.mixers.head_split import MixerSplit
from lightning_ulysses.mixers.lora import base_linear
from lightning_ulysses.mixers.mamba2 import norm_over_ranks


def matches(module: torch.nn.Module) -> bool:
    linears = ("qkv_proj", "output_gate", "out_proj")
    norm = getattr(module, "norm", None)
    return (all(base_linear(getattr(module, name, None)) is not None for name in linears)
            and all(hasattr(module, name) for name in ("num_attention_heads", "head_dim", "block_size", "slope_rate",
                                                       "query_decay", "key_decay", "diagonal_decay"))
            and type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"))


def split(module: torch.nn.Module, parts: int, rank: int) -> MixerSplit:
    heads, width = module.num_attention_heads, module.head_dim
    per_head = ChannelLayout(heads, (width,))
    one_per_head = ChannelLayout(heads, (1,))
    mine = unit_range(heads, parts, rank)
    local = len(mine)
    return MixerSplit(
        units=heads,
        inputs={"qkv_proj": ChannelLayout(heads, (3 * width,)), "output_gate": per_head},
        output=("out_proj", per_head),
        parameters={"slope_rate": (0, one_per_head), "query_decay": (0, one_per_head),  # [heads, block, 1]
                    "key_decay": (0, one_per_head), "diagonal_decay": (1, one_per_head),  # [1, heads, block, block]
                    "norm.weight": (0, per_head)},
        replaced={"norm": norm_over_ranks(heads * width, 1, range(mine.start * width, mine.stop * width))} if parts > 1 else {},
        attributes={"num_attention_heads": local},
        masks_input=False,
    )
