"""Nemotron-H: blocks that each hold one part, a Mamba2 mixer, an attention, an MLP or a mixture of experts.

Its Mamba2 mixers split by heads (mixers/mamba2.py, which serves every Mamba2 family). Its layers are named by
`hybrid_override_pattern`, one character per block, or by `layers_block_type`; the planner prices each block as its
one part (planning/layer_kinds.py). A block's MLP is its `mixer`, not an `mlp`: the tiled MLP does not apply.
"""

from __future__ import annotations

import dataclasses

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import mamba2
from lightning_ulysses.planning.layer_kinds import (LayerKind, attention_only, attention_shape, dense_mlp, experts,
                                                    layer_types, mamba2 as mamba2_part, setting, softmax_attention)

# `hybrid_override_pattern`'s characters, and the names `layers_block_type` may use, → the part a block holds
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_ALIASES = {"linear_attention": "mamba", "full_attention": "attention", "mamba": "mamba", "attention": "attention",
            "mlp": "mlp", "moe": "moe"}
# its norms are Llama-style: an fp32 input, 16-bit normalised values, the rstd
_NORM_BYTES_PER_HIDDEN, _NORM_BYTES = 4 + 2 + 2, 4


def _planner_layers(config) -> tuple[LayerKind, ...] | None:
    types = layer_types(config)
    pattern = getattr(config, "hybrid_override_pattern", None)
    if types is None and pattern is not None:
        types = [_PATTERN[c] for c in pattern]
    if attention_only(types):
        return None
    h, heads, kv_heads, head_dim = attention_shape(config)
    parts = {"mamba": mamba2_part(h, setting(config, "mamba_num_heads", "mamba_n_heads"),
                                  setting(config, "mamba_head_dim", "mamba_d_head"), config.ssm_state_size,
                                  setting(config, "n_groups", "mamba_n_groups", default=1),
                                  setting(config, "conv_kernel", "mamba_d_conv", default=4),
                                  setting(config, "chunk_size", "mamba_chunk_size", default=256)),
             "attention": softmax_attention(h, heads, kv_heads, head_dim, gated=False),
             "mlp": dense_mlp(h, config.intermediate_size, gated=False)}
    if setting(config, "n_routed_experts", "num_local_experts"):
        parts["moe"] = experts(h, setting(config, "n_routed_experts", "num_local_experts"), config.num_experts_per_tok,
                               config.moe_intermediate_size,
                               setting(config, "moe_shared_expert_intermediate_size", default=0), gated=False,
                               tiles=False)
    layers = []
    for kind in types:
        name = _ALIASES.get(kind)
        if name not in parts:
            raise ValueError(f"memory=\"auto\" has no cost declared for {config.model_type} block type {kind!r}")
        part = parts[name]
        tokens_mixer = name in ("mamba", "attention")
        layers.append(LayerKind(part if tokens_mixer else None,
                                None if tokens_mixer else dataclasses.replace(part, tiles=False), 1,
                                _NORM_BYTES_PER_HIDDEN * h + _NORM_BYTES, h))
    return tuple(layers)


register(Family(
    name="nemotron_h",
    model_types=frozenset({"nemotron_h"}),
    token_mixers=(mamba2,),
    token_mixer_names=("Mamba",),
    planner_layers=_planner_layers,
))
