"""Falcon: rotary attention taken over module by module, as its modeling code stands in the installed transformers.

Falcon's rotary layers split one fused projection into query, key and value heads, rotate q/k with the model's
`position_embeddings` (from the global `position_ids`) and attend causally with the default scale `1/sqrt(dim)`;
the exchange and the whole-row attention are attention/inline.py's (KV heads fewer than the SP ranks are
replicated), the output projection is the module's own.

The fused projection's layout is the checkpoints' (`_project`): per KV group its queries, then its key and value
(`new_decoder_architecture`); every query head, then one key and one value (`multi_query`); or query, key and value
interleaved per head. Two generations of the modeling code are served, told apart by what the installed module
does, not by a version number:
- up to transformers 5.24 the module computes its attention itself: its forward takes the ALiBi tensor (`alibi`),
  its sdpa and eager branches drop out no attention probabilities and its flash class (`FalconFlashAttention2`)
  drops `config.attention_dropout` in training;
- from 5.25 on it dispatches through transformers' attention interface: its forward takes no `alibi` (an ALiBi
  model adds its bias to the attention mask instead) and it hands every backend its `attention_dropout` in training.
Both take their attention modules over alike at SP > 1 (the 5.25 module could be switched to the "ulysses"
attention too, but its ALiBi variant puts its bias in the mask that interface replaces).
The `alibi=True` variant is refused: up to 5.24 transformers' eager path adds its bias twice (once to the scores,
once in the mask) and its sdpa path once, so there is no one computation to match; from 5.25 on the bias is part
of a 4-D mask, which cannot be cut along the sequence.
"""

from __future__ import annotations

import functools
import inspect

from lightning_ulysses.adapters.registry import Family, InlineAttention, register


@functools.lru_cache(maxsize=None)
def _signature(attention_class: type) -> inspect.Signature:
    return inspect.signature(attention_class.forward)


def _dispatches_through_interface(module) -> bool:
    """Whether the installed Falcon attention hands its attention to transformers' attention interface (5.25 on),
    known from its forward's arguments: the modules that attend themselves take the ALiBi tensor."""
    return "alibi" not in _signature(type(module)).parameters


def _project(module, hidden_states):
    """`[batch, seq, dim]` → query `[batch, heads, seq, head_dim]`, key and value `[batch, kv_heads, seq, head_dim]`
    from the fused projection (module docstring)."""
    fused = module.query_key_value(hidden_states)
    batch, length = fused.shape[:2]
    heads, width = module.num_heads, module.head_dim
    if module.new_decoder_architecture:
        grouped = fused.view(batch, length, module.num_kv_heads, heads // module.num_kv_heads + 2, width)
        query = grouped[:, :, :, :-2].reshape(batch, length, heads, width)
        key, value = grouped[:, :, :, -2], grouped[:, :, :, -1]
    elif module.multi_query:
        query, key, value = fused.view(batch, length, heads + 2, width).split((heads, 1, 1), dim=2)
    else:
        query, key, value = fused.view(batch, length, heads, 3, width).unbind(dim=3)
    return (tensor.transpose(1, 2) for tensor in (query, key, value))


def _dropout(module) -> float:
    """The attention dropout the installed module applies (module docstring)."""
    if not module.training:
        return 0.0
    if _dispatches_through_interface(module):
        return float(module.attention_dropout)
    return module.config.attention_dropout if type(module).__name__ == "FalconFlashAttention2" else 0.0


def _forward(module, attend, *args, **kwargs):
    # bound to the installed module's own forward, whichever arguments it takes (`alibi` up to 5.24, none from 5.25)
    arguments = _signature(type(module)).bind(module, *args, **kwargs).arguments
    if arguments.get("alibi") is not None:
        raise NotImplementedError("Falcon with alibi=True is not sequence-parallel: train it with"
                                  " sequence_parallel_size=1.")
    if arguments.get("output_attentions"):
        raise NotImplementedError("Falcon under sequence parallelism returns no attention weights: call the model"
                                  " with output_attentions=False.")
    hidden_states = arguments["hidden_states"]
    query, key, value = _project(module, hidden_states)
    cos, sin = arguments["position_embeddings"]
    query, key = inspect.getmodule(type(module)).apply_rotary_pos_emb(query, key, cos, sin)
    layer_past = arguments.get("layer_past")
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    context = attend(query, key, value, dropout=_dropout(module))
    return module.dense(context.reshape(*hidden_states.shape[:2], module.num_heads * module.head_dim)), None


def _refusal(config, backend, ring_size):
    if getattr(config, "alibi", False):
        return ("Falcon's alibi=True variant is not sequence-parallel (transformers adds its bias through the"
                " attention mask, differently in its eager and sdpa paths up to 5.24): train it with"
                " sequence_parallel_size=1.")
    return None


register(Family(
    name="falcon",
    model_types=frozenset({"falcon"}),
    inline_attention=InlineAttention(
        name="falcon_attention",
        applies=lambda module: type(module).__name__ in ("FalconAttention", "FalconFlashAttention2"),
        forward=_forward,
        refusal=_refusal,
    ),
))
