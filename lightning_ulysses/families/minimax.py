"""MiniMax: lightning attention (linear attention with per-head decay, `*LightningAttention`) beside softmax attention,
split by heads (mixers/lightning_attention.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import lightning_attention


register(Family(
    name="minimax",
    model_types=frozenset({"minimax"}),
    token_mixers=(lightning_attention,),
    token_mixer_names=("LightningAttention",),
))
