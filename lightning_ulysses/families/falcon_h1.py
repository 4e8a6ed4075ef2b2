"""Falcon-H1: Mamba2 mixers (`FalconH1Mixer`) in the same layers as attention, split by heads (mixers/mamba2.py).

Its mixer multiplies its input by `ssm_in_multiplier` and its projection by a muP vector (a buffer sliced like the
projection), and its gated norm may be absent, gate after normalising, and counts its groups: mixers/mamba2.py
recognises each by the module's own attributes (`ssm_in_multiplier`, `mup_vector`, `norm_before_gate`).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba2


register(Family(
    name="falcon_h1",
    model_types=frozenset({"falcon_h1"}),
    token_mixers=(mamba2,),
    token_mixer_names=("Mixer",),
))
