"""MPT: ALiBi, computed inline (`position_bias` added to the scores in `MptAttention`).

MPT adds `slope_h * (key - (max_seq_len - 1))` (`build_mpt_alibi_tensor`), positions counting every token,
padding included; the constant does not matter under softmax, so each rank adds its heads' slopes times the keys'
indices in the whole row (attention/inline.py). The slopes are MPT's own (the bias of the key one before the last).
`clip_qkv`, the attention dropout and the output projection are the module's own.
"""

from __future__ import annotations

import inspect

from lightning_ulysses.adapters.registry import Family, InlineAttention, register


def _forward(module, attend, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    batch, length = hidden_states.shape[:2]
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (t.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
                         for t in mixed.chunk(3, dim=2))
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    slopes = -inspect.getmodule(type(module)).build_mpt_alibi_tensor(
        module.n_heads, 2, device=hidden_states.device)[:, 0, 0].float()
    context = attend(query, key, value, scale=module.softmax_scale, alibi_slopes=slopes, masking="fill",
                     dropout=module.attn_dropout_p if module.training else 0.0)
    return module.out_proj(context.reshape(batch, length, -1)), None


register(Family(
    name="mpt",
    model_types=frozenset({"mpt"}),
    inline_attention=InlineAttention(
        name="mpt_alibi",
        applies=lambda module: type(module).__name__ == "MptAttention",
        forward=_forward,
        alibi=True,
    ),
))
