"""Doge: its attention builds a dynamic mask from its keys' values inside the layer (a learned per-key bias
added to the 4-D mask it indexes) before it calls the attention interface; on a shard those keys are the shard's own,
not the whole row's, which the exchange cannot reproduce: refused at SP > 1 (transformers 5.25).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register


register(Family(
    name="doge",
    model_types=frozenset({"doge"}),
    attention_the_exchange_cannot_carry={
        "DogeAttention": "builds a dynamic mask from its keys' values before the attention call"},
))
