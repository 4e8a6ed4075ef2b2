"""BLOOM: ALiBi, computed inline (`alibi.baddbmm` + softmax in `BloomAttention`).

BLOOM adds `slope_h * position(key)` to the scaled scores, the positions counting the real tokens of a row
(`build_alibi_tensor`: `(cumsum(mask) - 1) * mask`). Under sequence parallelism each rank attends over whole rows of
its heads: it adds its heads' slopes times the keys' positions in the whole row (attention/inline.py), the real
tokens counted as BLOOM does. The attention dropout, the output projection (with `pretraining_tp` slices) and the
residual dropout are the module's own.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from lightning_ulysses.adapters.registry import Family, InlineAttention, register
from lightning_ulysses.fences import _transformers_private as transformers_private


def _forward(module, attend, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
             output_attentions=False, **kwargs):
    if output_attentions:
        raise NotImplementedError("BLOOM under sequence parallelism returns no attention weights: call the model"
                                  " with output_attentions=False.")
    query, key, value = transformers_private.bloom_split_qkv(module, module.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    slopes = transformers_private.bloom_alibi_slopes(module, module.num_heads, hidden_states.device)
    context = attend(query, key, value, scale=module.inv_norm_factor, alibi_slopes=slopes, alibi_counts_padding=False,
                     dropout=module.attention_dropout.p if module.training else 0.0)
    context = context.reshape(*context.shape[:2], module.hidden_size)
    if module.pretraining_tp > 1 and module.slow_but_exact:
        slices = module.hidden_size / module.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(module.pretraining_tp):
            output = output + F.linear(context[:, :, int(i * slices): int((i + 1) * slices)],
                                       module.dense.weight[:, int(i * slices): int((i + 1) * slices)])
    else:
        output = module.dense(context)
    output = inspect.getmodule(type(module)).dropout_add(output, residual, module.hidden_dropout, module.training)
    return output, None


register(Family(
    name="bloom",
    model_types=frozenset({"bloom"}),
    inline_attention=InlineAttention(
        name="bloom_alibi",
        applies=lambda module: type(module).__name__ == "BloomAttention",
        forward=_forward,
        alibi=True,
    ),
))
