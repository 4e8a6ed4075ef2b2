"""Granite 4 hybrid (Granite-MoE-hybrid): Mamba2 layers beside attention layers, split by heads (mixers/mamba2.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba2


register(Family(
    name="granitemoehybrid",
    model_types=frozenset({"granitemoehybrid"}),
    token_mixers=(mamba2,),
    token_mixer_names=("Mamba",),
))
