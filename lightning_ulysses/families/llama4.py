"""Llama 4: the NoPE layers' attention temperature.

Layers without RoPE scale their queries by `log1p(floor((position + 1) / floor_scale)) * attn_scale + 1`, with the
positions counted as `arange` over the tokens the layer holds (transformers' `Llama4TextAttention`). On a shard
that is the shard's own start, so the query is rescaled by the ratio of the temperature at the shard's global
positions to the one the module applied.
"""

from __future__ import annotations

import torch

from lightning_ulysses.adapters.registry import Family, FamilyAdapter, register


def _temperature(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _adjust_query(module, query, local, global_):
    ratio = (_temperature(module, global_) / _temperature(module, local)).to(query.device)
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


register(Family(
    name="llama4",
    model_types=frozenset({"llama4", "llama4_text"}),
    # found by the module's own settings (whatever its model's type): the NoPE layers with temperature tuning
    query_adjustment=FamilyAdapter(
        name="llama4_temperature",
        applies=lambda module: (bool(getattr(module, "attn_temperature_tuning", False))
                                and not getattr(module, "use_rope", True)),
        adjust_query=_adjust_query,
    ),
))
