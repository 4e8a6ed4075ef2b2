"""The "ulysses" attention function transformers calls in every attention layer of a prepared model, and its
registration (the only process-wide step: new names in transformers' registries, the plain "ulysses" and one per
prepared model while it is prepared; no existing name changed)."""

from __future__ import annotations

import functools
import itertools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.adapters import adapters_for
from lightning_ulysses.attention.backends import BACKENDS
from lightning_ulysses.attention.core import ulysses_attention
from lightning_ulysses.attention.documents import AttentionPattern
from lightning_ulysses.attention.masks import reject_window
from lightning_ulysses.fences._transformers_private import unregister_attention
from lightning_ulysses.hf.binding import _BINDING_ATTRIBUTE, ULYSSES_ATTENTION, _Binding
from lightning_ulysses.hf.decoding import _decode_attention
from lightning_ulysses.hf.mask_interface import _shard_padding_mask, _unmark
from lightning_ulysses.hf.own_attention import (_FLASH_BACKENDS, _OWN_ATTENTION_KWARGS, _OwnAttention,
                                                _own_attention_function)
from lightning_ulysses.parallel.layout import ShardOrder


def _unsupported(module, attention_mask, kwargs, row_length: int) -> bool:
    """SP 1: whether these inputs ask for what the core does not apply to unsharded rows (a window shorter than the
    row, soft-capping, sinks, another mask format), which the model's own attention then computes as unprepared."""
    try:
        _reject_unsharded_inputs(module, attention_mask, kwargs)
    except ValueError:
        return True
    sliding_window = kwargs.get("sliding_window")
    return (sliding_window is not None and sliding_window < row_length) or any(
        kwargs.get(name) is not None for name in _OWN_ATTENTION_KWARGS)


def _ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    binding: _Binding | None = getattr(module, _BINDING_ATTRIBUTE, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation='{ULYSSES_ATTENTION}' but was not prepared by"
            " lightning_ulysses (prepare_hf_model). Switch it back with model.set_attn_implementation('sdpa')."
        )
    group = binding.group.group
    row_length = query.size(2) * binding.group.world_size * binding.ring.world_size
    if not binding.sharded and (binding.decode is not None or key.size(2) != query.size(2)
                                or _unsupported(module, attention_mask, kwargs, row_length)):
        # SP 1: what the core does not apply (decoding from a KV cache, sliding windows, soft-capping, sinks,
        # masks built from other mask functions) runs through the model's own attention, exactly as unprepared.
        return _own_attention_function(module, binding.backend)(module, query, key, value, attention_mask, **kwargs)
    adapters = adapters_for(module)
    if binding.decode is not None and binding.decode.prefilled:
        if adapters:
            raise NotImplementedError(
                f"{type(module).__name__} needs {adapters[0].name} from global positions, which decoding from a"
                " sequence-parallel KV cache does not give it yet: generate with sequence_parallel_size=1.")
        return _decode_attention(query, key, value, binding.decode, group, kwargs.get("scaling")), None
    if adapters:  # positions the module counted from this shard's start (its family's): corrected to the global ones
        order, rank = ShardOrder.of_groups(binding.group.group, binding.ring.group)
        local = torch.arange(query.size(2), device=query.device)
        global_ = order.positions(row_length, rank, device=query.device)
        for adapter in adapters:
            query = adapter.adjust_query(module, query, local, global_)
    padding_mask, pattern = _unmark(attention_mask)
    _reject_unsharded_inputs(module, padding_mask, kwargs)
    if binding.backend in _FLASH_BACKENDS:  # flash reads its window from the kwarg (its mask is 2-D padding only)
        pattern = AttentionPattern(kwargs.get("sliding_window"), pattern.chunk_size if pattern else None)
    if binding.decode is not None:  # the prefill of `inference.generate`: windows are not applied while decoding
        for size in (pattern.sliding_window, pattern.chunk_size) if pattern else ():
            if size is not None:
                reject_window(type(module).__name__, "a sliding window or chunked attention", size, row_length)
        pattern = None
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    own = None
    if binding.backend not in BACKENDS or any(kwargs.get(name) is not None for name in _OWN_ATTENTION_KWARGS):
        own = _OwnAttention(module, binding, kwargs, is_causal, query.size(1))
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = binding.forward_positions
    output = ulysses_attention(
        query, key, value, group, binding.backend,
        position_ids=position_ids,  # global positions: packed documents are read from them
        padding_mask=padding_mask,  # this shard's 2-D padding mask (see _shard_padding_mask)
        is_causal=is_causal,
        scale=kwargs.get("scaling"),
        dropout_p=kwargs.get("dropout", 0.0),
        ring_group=binding.ring.group,  # with a ring, ring attention replaces the backend
        batch_rows=binding.batch_rows,
        head_groups=binding.head_groups,
        pattern=pattern or None,
        local=own,
        transport=binding.transport,  # the strategy's agreed all-to-all (copy engine or collective)
    )
    return output, None  # [batch, seq/P, heads, dim], the layout the model expects back


def _reject_unsharded_inputs(module, attention_mask, kwargs) -> None:
    """Refuse (alike on every rank, before any collective) inputs that describe the whole row unsharded."""
    if any(name in kwargs for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise ValueError(
            "cu_seq_lens_q/cu_seq_lens_k describe documents of the whole (unsharded) row. Under sequence parallelism"
            " lightning_ulysses reads packed documents from position_ids restarting at 0 instead: drop the flash"
            " kwargs from the batch (e.g. DataCollatorWithFlattening(return_flash_attn_kwargs=False))."
        )
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        # A flex BlockMask: at SP 1 the model's own mask of a windowed layer (see _shard_padding_mask).
        form = f"{attention_mask.dim()}-D" if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(
            f"{type(module).__name__} got a {form} attention mask; under sequence parallelism only"
            " 2-D padding masks ([batch, seq]) and packed position_ids can be cut along the sequence."
        )


def _register_attention() -> None:
    """The plain "ulysses" name: what a private config names once its model is restored (its own name is gone), an
    attention that refuses to run on modules without a binding and a mask function that builds no shard masks."""
    if ULYSSES_ATTENTION not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_attention_forward)
        AttentionMaskInterface.register(ULYSSES_ATTENTION, functools.partial(_shard_padding_mask, None, None))


_MODEL_NAMES = itertools.count(1)


def register_model_attention(model_name: str, binding: _Binding) -> str:
    """A name of its own for one prepared model, in transformers' attention and mask registries: the "ulysses"
    attention function (which reads the binding from the module it runs for) and a mask function bound to
    `binding` (transformers hands mask functions only the config, whose attention implementation is this name).
    `unregister_model_attention` removes it again."""
    _register_attention()
    name = f"{ULYSSES_ATTENTION}-{next(_MODEL_NAMES)}"
    AttentionInterface.register(name, _ulysses_attention_forward)
    AttentionMaskInterface.register(name, functools.partial(_shard_padding_mask, model_name, binding))
    return name


def unregister_model_attention(name: str) -> None:
    """Remove one prepared model's name (`register_model_attention`) from both registries."""
    unregister_attention(AttentionInterface, name)
    unregister_attention(AttentionMaskInterface, name)
