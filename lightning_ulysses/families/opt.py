"""OPT: positions count the real tokens of a row only.

Given no `position_ids`, OPT numbers a row by the cumulative sum of its padding mask (`cumsum(mask) *
mask - 1`: left padding gets -1 and the first real token 0), where the sharder's default `0..seq-1` would shift a
left-padded row's learned position embeddings by its padding. The sharder fills in this rule for it instead, from
the whole rows' mask, so every shard holds the positions the model would have computed on the whole sequence.
(BioGPT's embedding has the same rule, but its model forward passes `arange`: it needs none;
tests/unit/test_filled_positions.py checks every family.)
"""

from __future__ import annotations

import torch

from lightning_ulysses.adapters.registry import Family, PositionRule, register


def _real_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.long()
    return torch.cumsum(mask, dim=1) * mask - 1


register(Family(
    name="opt",
    model_types=frozenset({"opt"}),
    position_rule=PositionRule(name="real tokens only (OPT)", positions=_real_token_positions),
))
