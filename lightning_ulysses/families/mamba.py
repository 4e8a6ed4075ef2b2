"""Mamba: Mamba (Mamba1) mixers, split by channels (mixers/mamba.py, which also serves Falcon-Mamba's and Jamba's).
Every class named `*Mamba*` is taken for a token mixer (hf/validation.py), in any family.
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba


register(Family(
    name="mamba",
    model_types=frozenset({"mamba"}),
    token_mixers=(mamba,),
    token_mixer_names=("Mamba",),
))
