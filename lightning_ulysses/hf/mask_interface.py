"""The "ulysses" mask interface: what transformers' `create_*_mask` functions hand the attention of a prepared model.

transformers hands a mask function only the model's config, so a prepared model's private config names its binding
through its attention-implementation key (`BoundImplementation`): the one attribute transformers never serialises,
so the config still saves and prints as before, and no table outside the model maps configs to bindings.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.documents import AttentionPattern
from lightning_ulysses.attention.masks import attention_pattern, reject_unsupported_pattern
from lightning_ulysses.hf.binding import ULYSSES_ATTENTION
from lightning_ulysses.mixers.arguments import MASK_MARKER

if TYPE_CHECKING:
    from lightning_ulysses.hf.binding import _Binding


class BoundImplementation(str):
    """`"ulysses"` as a prepared model's private configs hold it in `_attn_implementation`: equal to (and hashed
    as) `"ulysses"` wherever transformers looks the name up, and carrying the model's name and binding, which the
    mask interface needs (the SP size gives the whole row's length) and is handed only the config to find.

    A deep copy of the config (an EMA copy of the model) shares the binding, as the copied modules do; a pickled
    one holds the plain name (a binding holds process groups, which cannot be pickled)."""

    def __new__(cls, model_name: str, binding: "_Binding") -> "BoundImplementation":
        name = super().__new__(cls, ULYSSES_ATTENTION)
        name.model_name, name.binding = model_name, binding
        return name

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return str, (ULYSSES_ATTENTION,)


def bind_configs(configs: Iterable, model_name: str, binding: "_Binding") -> list:
    """Point every config of `configs` switched to "ulysses" at `binding`; returns them (`unbind_configs` undoes)."""
    bound = [config for config in configs if getattr(config, "_attn_implementation", None) == ULYSSES_ATTENTION]
    for config in bound:
        # (the internal attribute: the public setter would also reset every sub-config, each bound on its own)
        config._attn_implementation_internal = BoundImplementation(model_name, binding)
    return bound


def unbind_configs(configs: Iterable) -> None:
    """The configs no longer name a binding (a private config kept past `restore()` builds no shard masks)."""
    for config in configs:
        config._attn_implementation_internal = ULYSSES_ATTENTION


_PATTERN_ATTRIBUTE = MASK_MARKER


def _mark(attention_mask: Optional[torch.Tensor], pattern: AttentionPattern) -> torch.Tensor:
    """What our mask interface hands a windowed/chunked layer: an empty tensor carrying the shard's 2-D padding
    mask and the pattern. The model passes it to exactly the layers it built that mask for (`layer_types`); a
    layer that got it through a copy (the attribute lost) sees an empty 1-D mask and is refused, never misread."""
    marker = torch.empty(0)
    setattr(marker, _PATTERN_ATTRIBUTE, (attention_mask, pattern))
    return marker


def _unmark(attention_mask) -> tuple[Optional[torch.Tensor], Optional[AttentionPattern]]:
    marked = getattr(attention_mask, _PATTERN_ATTRIBUTE, None) if attention_mask is not None else None
    return (attention_mask, None) if marked is None else marked


def _shard_padding_mask(*args, attention_mask=None, mask_function=None, config=None, q_length=None,
                        kv_length=None, kv_offset=0, **kwargs):
    """Mask function for the "ulysses" key: hand the attention this shard's 2-D padding mask as it is.

    A 4-D mask built at shard length would be wrong after the all-to-all, so the attention gathers the 2-D mask
    and builds its own. The mask is kept even when this shard holds no padding (flash's mask function would
    drop it): gathering is a collective, so the decision must be the same on every rank of the SP group, and
    only "the batch has an attention_mask" is.

    Every pattern in `mask_function` other than causal attention (with padding and packed documents, which the
    attention applies itself) would be dropped, so it is refused here (attention/masks.py), before the model's
    first attention layer and so alike on every SP rank before any all-to-all of this forward.
    """
    implementation = getattr(config, "_attn_implementation", None)
    if mask_function is not None and isinstance(implementation, BoundImplementation):
        model_name, binding = implementation.model_name, implementation.binding
        decode = binding.decode
        if not binding.sharded:
            # SP 1: the model's own mask for what the core does not apply (see _ulysses_attention_forward).
            own_mask = functools.partial(ALL_MASK_ATTENTION_FUNCTIONS[binding.backend], *args,
                                         attention_mask=attention_mask, mask_function=mask_function, config=config,
                                         q_length=q_length, kv_length=kv_length, kv_offset=kv_offset, **kwargs)
            if decode is not None or q_length != kv_length:  # decoding from a KV cache
                return own_mask()
            try:
                reject_unsupported_pattern(mask_function, q_length, model_name, getattr(config, "layer_types", None))
            except NotImplementedError:
                return own_mask()
            return attention_mask
        if decode is None:
            # Windows and chunks cross shard boundaries: the attention applies them on whole rows after the exchange.
            pattern = attention_pattern(mask_function, model_name)
            if not pattern:
                return attention_mask
            return _mark(attention_mask, pattern)
        if not decode.prefilled:
            row_length = decode.prompt_length
        else:  # each rank's cache: its prompt shard, then every generated token, this one included
            row_length = decode.prompt_length + kv_length + kv_offset - decode.shard_length
        reject_unsupported_pattern(mask_function, row_length, model_name, getattr(config, "layer_types", None))
    return attention_mask
