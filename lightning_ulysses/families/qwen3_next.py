"""Qwen3-Next: Gated DeltaNet in three layers of four, a gated attention in the fourth, a mixture of experts
(or a dense MLP) in every layer.

Its Gated DeltaNet projects `[query | key | value | z]` per key head in one linear (`in_proj_qkvz`) and `[b | a]` in
another; it splits by value heads (mixers/gated_deltanet.py, which also serves Qwen3.5's and OLMo-hybrid's
layouts). The planner prices its layers from the parts measured on it (planning/layer_kinds.py); Qwen3.5's and
OLMo-hybrid's layers differ in their projections and attention, not measured, so the planner refuses them.
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, register
from lightning_ulysses.mixers import gated_deltanet
from lightning_ulysses.planning.layer_kinds import (LayerKind, attention_only, attention_shape, dense_mlp, experts,
                                                    gated_deltanet as gated_deltanet_part, layer_types, setting,
                                                    softmax_attention)

# its RMSNorms keep an fp32 input and fp32 normalised values (Gemma-style `1 + weight`), and the rstd
_NORM_BYTES_PER_HIDDEN, _NORM_BYTES = 8, 4


def _planner_layers(config) -> tuple[LayerKind, ...] | None:
    types = layer_types(config)
    if attention_only(types):
        return None
    h, heads, kv_heads, head_dim = attention_shape(config)
    mixer = gated_deltanet_part(h, config.linear_num_key_heads, config.linear_key_head_dim,
                                config.linear_num_value_heads, config.linear_value_head_dim,
                                config.linear_conv_kernel_dim)
    attention = softmax_attention(h, heads, kv_heads, head_dim, gated=True)
    sparse_step = setting(config, "decoder_sparse_step", default=1)
    only_dense = set(setting(config, "mlp_only_layers", default=()))
    layers = []
    for index, kind in enumerate(types):
        if kind not in ("linear_attention", "full_attention"):
            raise ValueError(f"memory=\"auto\" has no cost declared for {config.model_type} layer type {kind!r}")
        moe = (index not in only_dense and setting(config, "num_experts", default=0) > 0
               and (index + 1) % sparse_step == 0)
        mlp = (experts(h, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       setting(config, "shared_expert_intermediate_size", default=0), gated=True, tiles=True)
               if moe else dense_mlp(h, config.intermediate_size, gated=True))
        layers.append(LayerKind(mixer if kind == "linear_attention" else attention, mlp, 2,
                                _NORM_BYTES_PER_HIDDEN * h + _NORM_BYTES, h))
    return tuple(layers)


register(Family(
    name="qwen3_next",
    model_types=frozenset({"qwen3_next"}),
    token_mixers=(gated_deltanet,),
    token_mixer_names=("DeltaNet",),
    planner_layers=_planner_layers,
))
