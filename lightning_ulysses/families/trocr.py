"""TrOCR: an encoder (or an encoder-decoder's decoder) with a causal-LM head, which transformers' masked-LM and
sequence-to-sequence mappings do not name (the other encoders are known by those): refused at SP > 1, outside the
decoder-only families the matrix holds exact (hf/validation.py `_reject_encoder_families`).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register


register(Family(
    name="trocr",
    model_types=frozenset({"trocr"}),
    encoder=True,
))
