"""Kimi Linear: Kimi delta attention (KDA, `*DeltaAttention`) layers beside multi-head latent attention, split by heads
(mixers/kimi_delta.py, which also serves Bailing-hybrid's full-rank gates).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import kimi_delta


register(Family(
    name="kimi_linear",
    model_types=frozenset({"kimi_linear"}),
    token_mixers=(kimi_delta,),
    token_mixer_names=("DeltaAttention",),
))
