"""Jamba: Mamba layers beside attention layers; its Mamba mixers normalise the step, B and C after `x_proj`, split by
channels (mixers/mamba.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba


register(Family(
    name="jamba",
    model_types=frozenset({"jamba"}),
    token_mixers=(mamba,),
    token_mixer_names=("Mamba",),
))
