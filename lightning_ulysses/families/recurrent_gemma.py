"""RecurrentGemma: recurrent blocks (`*RecurrentBlock`, holding an RG-LRU, `*Rglru`, and a convolution) beside
attention blocks, split by heads (mixers/rg_lru.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import rg_lru


register(Family(
    name="recurrent_gemma",
    model_types=frozenset({"recurrent_gemma"}),
    token_mixers=(rg_lru,),
    token_mixer_names=("Rglru", "RecurrentBlock",),
))
