"""GPT-Neo: eager attention computed inline (`GPTNeoSelfAttention._attn`), global and local layers.

GPT-Neo does not scale its scores (scale 1) and its "local" layers see the `window_size` tokens up to the query
(`kv > q - window_size`, the project's sliding window), both measured on the whole row after the exchange
(attention/inline.py). The attention dropout, output projection and residual dropout are the module's own.
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, InlineAttention, register
from lightning_ulysses.fences import _transformers_private as transformers_private


def _forward(module, attend, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
             output_attentions=False, **kwargs):
    if output_attentions:
        raise NotImplementedError("GPT-Neo under sequence parallelism returns no attention weights: call the model"
                                  " with output_attentions=False.")
    query, key, value = (transformers_private.gpt_neo_split_heads(module, projection(hidden_states), module.num_heads,
                                                                  module.head_dim)
                         for projection in (module.q_proj, module.k_proj, module.v_proj))
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_id)
    window = module.config.window_size if module.attention_type == "local" else None
    context = attend(query, key, value, scale=1.0, sliding_window=window, masking="refuse",
                     dropout=module.attn_dropout.p if module.training else 0.0)
    output = module.out_proj(context.reshape(*context.shape[:2], module.embed_dim))
    return module.resid_dropout(output), None


def _refusal(config, backend, ring_size):
    if ring_size > 1 and "local" in config.attention_layers:
        return ("its local attention layers (window_size) cannot run in ring attention (ring_size > 1): use"
                " ring_size=1 (a sequence_parallel_size the heads divide).")
    return None


register(Family(
    name="gpt_neo",
    model_types=frozenset({"gpt_neo"}),
    inline_attention=InlineAttention(
        name="gpt_neo_attention",
        applies=lambda module: type(module).__name__ in ("GPTNeoSelfAttention", "GPTNeoFlashAttention2"),
        forward=_forward,
        refusal=_refusal,
    ),
))
