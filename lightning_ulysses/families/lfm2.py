"""LFM2: gated short convolutions (`*ShortConv`) beside attention layers, split by channels (mixers/short_conv.py,
which also serves LFM2-MoE's and LFM3's).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import short_conv


register(Family(
    name="lfm2",
    model_types=frozenset({"lfm2"}),
    token_mixers=(short_conv,),
    token_mixer_names=("ShortConv",),
))
