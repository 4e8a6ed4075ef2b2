"""Falcon-Mamba: Mamba mixers that normalise the step, B and C after `x_proj` (RMSNorms over those shared
channels, read from the summed partial products), split by channels (mixers/mamba.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba


register(Family(
    name="falcon_mamba",
    model_types=frozenset({"falcon_mamba"}),
    token_mixers=(mamba,),
    token_mixer_names=("Mamba",),
))
