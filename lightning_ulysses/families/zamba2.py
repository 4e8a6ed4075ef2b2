"""Zamba2: Mamba2 layers and hybrid layers (a shared attention block beside a Mamba2 mixer), the mixers split by
heads (mixers/mamba2.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba2


register(Family(
    name="zamba2",
    model_types=frozenset({"zamba2"}),
    token_mixers=(mamba2,),
    token_mixer_names=("Mamba",),
))
