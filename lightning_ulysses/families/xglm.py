"""XGLM: eager self-attention computed inline (`XGLMAttention`).

XGLM scales its queries before the scores (`q_proj(x) * scaling`, then scale 1) and drops out its attention
probabilities; the exchange and the whole-row attention are attention/inline.py's, the projections its own.
Cross-attention (`add_cross_attention`) attends to an encoder's sequence, which is not cut: refused.
"""

from __future__ import annotations

from lightning_ulysses.adapters.registry import Family, InlineAttention, register


def _forward(module, attend, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    if key_value_states is not None:
        raise NotImplementedError("XGLM's cross-attention is not sequence-parallel: train it with"
                                  " sequence_parallel_size=1.")
    batch, length, _ = hidden_states.shape
    query = (module.q_proj(hidden_states) * module.scaling).view(batch, length, -1, module.head_dim).transpose(1, 2)
    key, value = (projection(hidden_states).view(batch, length, -1, module.head_dim).transpose(1, 2)
                  for projection in (module.k_proj, module.v_proj))
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    context = attend(query, key, value, scale=1.0, dropout=module.dropout if module.training else 0.0, masking="refuse")
    return module.out_proj(context.reshape(batch, length, module.embed_dim)), None


def _refusal(config, backend, ring_size):
    if getattr(config, "add_cross_attention", False):
        return ("its cross-attention (add_cross_attention) attends to an encoder sequence, which sequence"
                " parallelism does not cut: train it with sequence_parallel_size=1.")
    return None


register(Family(
    name="xglm",
    model_types=frozenset({"xglm"}),
    inline_attention=InlineAttention(
        name="xglm_attention",
        applies=lambda module: type(module).__name__ == "XGLMAttention",
        forward=_forward,
        refusal=_refusal,
    ),
))
