"""RWKV: time mixing in every block (`Rwkv*`), no attention: no split is declared, so its mixers run on whole rows
(mixers/whole_rows.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register


register(Family(
    name="rwkv",
    model_types=frozenset({"rwkv"}),
    token_mixer_names=("Rwkv",),
))
