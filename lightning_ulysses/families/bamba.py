"""Bamba: Mamba2 mixers (`BambaMixer`, named `*Mixer`) beside attention layers, split by heads (mixers/mamba2.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba2


register(Family(
    name="bamba",
    model_types=frozenset({"bamba"}),
    token_mixers=(mamba2,),
    token_mixer_names=("Mixer",),
))
