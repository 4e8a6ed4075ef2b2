"""Qwen3.5 (and Qwen3.5-MoE): Gated DeltaNet layers that project query, key and value of every head in one linear
(`in_proj_qkv`), then z, b and a in three more, split by value heads (mixers/gated_deltanet.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import gated_deltanet


register(Family(
    name="qwen3_5",
    model_types=frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}),
    token_mixers=(gated_deltanet,),
    token_mixer_names=("DeltaNet",),
))
