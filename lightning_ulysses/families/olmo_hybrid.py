"""OLMo-hybrid: Gated DeltaNet layers that project each of query, key, value, a, b and the gate g on its own, split by
value heads (mixers/gated_deltanet.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import gated_deltanet


register(Family(
    name="olmo_hybrid",
    model_types=frozenset({"olmo_hybrid"}),
    token_mixers=(gated_deltanet,),
    token_mixer_names=("DeltaNet",),
))
