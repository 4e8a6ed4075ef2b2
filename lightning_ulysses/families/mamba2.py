"""Mamba2: Mamba2 mixers split by heads with the groups of B and C they read (mixers/mamba2.py, which serves every
Mamba2 family: Bamba, Nemotron-H, Falcon-H1, Granite 4 hybrid, Zamba2).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba2


register(Family(
    name="mamba2",
    model_types=frozenset({"mamba2"}),
    token_mixers=(mamba2,),
    token_mixer_names=("Mamba",),
))
