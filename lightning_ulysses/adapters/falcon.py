"""Falcon: attention computed inline (`FalconAttention`'s own sdpa and eager branches), rotary variant.

Falcon's rotary layers split its fused projection into (multi-query, grouped or full) heads, rotate q/k with the
model's `position_embeddings` (from the global `position_ids`), and attend causally with the default scale; the
exchange and the whole-row attention are attention/inline.py's (one KV head is replicated over the SP ranks), the
output projection the module's own. Falcon drops out attention probabilities in its flash class only, as here.
The `alibi=True` variant is refused: transformers' eager path adds its bias twice (once to the scores, once in
the mask) and its sdpa path once, so there is no one computation to match.
"""

from __future__ import annotations

import inspect

from lightning_ulysses.adapters.registry import InlineAttention, register_inline


def _forward(module, attend, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
             use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
    if alibi is not None:
        raise NotImplementedError("Falcon with alibi=True is not sequence-parallel: train it with"
                                  " sequence_parallel_size=1.")
    if output_attentions:
        raise NotImplementedError("Falcon under sequence parallelism returns no attention weights: call the model"
                                  " with output_attentions=False.")
    query, key, value = module._split_heads(module.query_key_value(hidden_states))
    batch, length = query.shape[:2]
    kv_heads = module.num_heads if module.new_decoder_architecture else module.num_kv_heads
    query = query.transpose(1, 2).reshape(batch, module.num_heads, length, module.head_dim)
    key = key.transpose(1, 2).reshape(batch, kv_heads, length, module.head_dim)
    value = value.transpose(1, 2).reshape(batch, kv_heads, length, module.head_dim)
    cos, sin = position_embeddings
    query, key = inspect.getmodule(type(module)).apply_rotary_pos_emb(query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    flash = type(module).__name__ == "FalconFlashAttention2"
    context = attend(query, key, value, dropout=module.config.attention_dropout if flash and module.training else 0.0)
    return module.dense(context.reshape(batch, length, module.num_heads * module.head_dim)), None


def _refusal(config, backend, ring_size):
    if getattr(config, "alibi", False):
        return ("Falcon's alibi=True variant is not sequence-parallel (transformers' eager and sdpa paths add its"
                " bias differently, so there is no one result to match): train it with sequence_parallel_size=1.")
    return None


register_inline(InlineAttention(
    name="falcon_attention",
    model_types=frozenset({"falcon"}),
    applies=lambda module: type(module).__name__ in ("FalconAttention", "FalconFlashAttention2"),
    forward=_forward,
    refusal=_refusal,
))
