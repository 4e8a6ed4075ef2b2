"""The "ulysses" mask interface: what transformers' `create_*_mask` functions hand the attention of a prepared model.

transformers hands a mask function only the model's config, and finds it by the name in the config's attention
implementation. So each prepared model gets a name of its own (`ulysses-<n>`, `hf/forward.py`
`register_model_attention`), registered with a mask function bound to that model's binding and removed again by
`restore()`: the config holds a plain string (it saves, prints, pickles and loads with `torch.load`'s weights-only
defaults as before), a deep copy of it (an EMA copy of the model) names the same binding, as the copied modules do,
and no table outside transformers' registries maps configs to bindings.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.documents import AttentionPattern
from lightning_ulysses.attention.masks import attention_pattern, reject_unsupported_pattern
from lightning_ulysses.mixers.arguments import MASK_MARKER

if TYPE_CHECKING:
    from lightning_ulysses.hf.binding import _Binding


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


def _shard_padding_mask(model_name: Optional[str], binding: Optional["_Binding"], *args, attention_mask=None,
                        mask_function=None, config=None, q_length=None, kv_length=None, kv_offset=0, **kwargs):
    """Mask function of one prepared model's key (`functools.partial` of its name and binding; both None for the
    plain "ulysses" key, which names no model): hand the attention this shard's 2-D padding mask as it is.

    A 4-D mask built at shard length would be wrong after the all-to-all, so the attention gathers the 2-D mask
    and builds its own. The mask is kept even when this shard holds no padding (flash's mask function would
    drop it): gathering is a collective, so the decision must be the same on every rank of the SP group, and
    only "the batch has an attention_mask" is.

    Every pattern in `mask_function` other than causal attention (with padding and packed documents, which the
    attention applies itself) would be dropped, so it is refused here (attention/masks.py), before the model's
    first attention layer and so alike on every SP rank before any all-to-all of this forward.
    """
    if mask_function is not None and binding is not None:
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
