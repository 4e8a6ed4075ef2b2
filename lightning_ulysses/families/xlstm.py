"""xLSTM: mLSTM cells (`*xLSTM*`, `*mLSTM*`) whose layer hands them query, key, value and gates per token: found as
token mixers and refused at SP > 1 (they cannot run on whole rows, hf/validation.py).
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register


register(Family(
    name="xlstm",
    model_types=frozenset({"xlstm"}),
    token_mixer_names=("[xm]LSTM",),
))
