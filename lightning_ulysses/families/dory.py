"""Dory: its recurrent loops extend the cache with extra layers the attention reads back, keys the Ulysses mask
(built for the rows' own tokens) does not cover; once prepared it fails in training at SP 1 already: refused at
SP > 1 (transformers 5.25).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register


register(Family(
    name="dory",
    model_types=frozenset({"dory"}),
    attention_the_exchange_cannot_carry={
        "DoryAttention": "re-reads keys its recurrent loops wrote to extra cache layers"},
))
