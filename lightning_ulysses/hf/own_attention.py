"""The model's own attention function on whole rows of this rank's heads: eager attention, and arguments only that
function applies (Gemma 2's soft-capping, GPT-OSS's sinks), run after the Ulysses exchange
(`ulysses_attention(..., local=...)`)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.core import local_heads
from lightning_ulysses.attention.documents import allowed_mask, mask_mod

if TYPE_CHECKING:
    from lightning_ulysses.hf.binding import _Binding


_FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
# Attention arguments only the model's own attention function applies (the backends of backends.py do not):
# Gemma 2's logit soft-capping, GPT-OSS's sinks.
_OWN_ATTENTION_KWARGS = ("softcap", "s_aux")


class _LocalHeads:
    """The attention module as its own attention function sees it after the exchange: whole rows of heads/P heads.

    Attributes that count heads are this rank's (`num_key_value_groups` after KV replication, `sinks` sliced to
    its heads, so that their gradients land on the heads this rank attended over); everything else is the
    module's own."""

    def __init__(self, module, heads: slice, query_heads: int, key_heads: int, total_heads: int):
        self._module = module
        self.num_key_value_groups = query_heads // key_heads
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor) and sinks.dim() >= 1 and sinks.size(0) == total_heads:
            self.sinks = sinks[heads]

    def __getattr__(self, name):
        return getattr(self._module, name)


class _OwnAttention:
    """The model's own attention function (eager, or a backend given arguments ours do not apply) on whole rows of
    this rank's heads: `ulysses_attention(..., local=...)`.

    Its mask is built from the whole rows in the format that function reads: eager adds a float mask, sdpa takes
    a boolean one, flex a block mask, flash a 2-D padding mask (with its window from the `sliding_window` kwarg).
    """

    def __init__(self, module, binding: "_Binding", kwargs: dict, is_causal: bool, total_heads: int):
        self.module, self.backend, self.is_causal, self.total_heads = module, binding.backend, is_causal, total_heads
        self.function = _own_attention_function(module, binding.backend)
        self.rank = dist.get_rank(binding.group.group) if binding.group.world_size > 1 else 0
        self.sp = binding.group.world_size
        heads = local_heads(total_heads, self.sp, self.rank)
        # Positions and flash's document kwargs describe this shard, not the whole rows the function now sees.
        self.kwargs = {name: value for name, value in kwargs.items() if name not in ("position_ids", "is_causal")}
        s_aux = self.kwargs.get("s_aux")
        if isinstance(s_aux, torch.Tensor) and s_aux.dim() >= 1 and s_aux.size(0) == total_heads:
            self.kwargs["s_aux"] = s_aux[heads]
        self.heads = heads

    def __call__(self, query, key, value, documents, pattern):
        view = _LocalHeads(self.module, self.heads, query.size(1), key.size(1), self.total_heads)
        mask = self._mask(query, documents, pattern)
        output, _ = self.function(view, query, key, value, mask, **self.kwargs)
        return output

    def _mask(self, query, documents, pattern):
        batch, seq = query.size(0), query.size(2)
        if self.backend in _FLASH_BACKENDS:
            if (pattern and pattern.chunk_size is not None) or (documents is not None and documents.document_ids is not None):
                raise NotImplementedError(
                    f"{type(self.module).__name__} under sequence parallelism with {self.backend} and its own attention"
                    " arguments (sinks or soft-capping) cannot keep packed documents or chunks apart here: use unpacked"
                    " rows, or attn_implementation='eager'."
                )
            return None if documents is None else documents.real_tokens.long()
        if self.backend == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask

            rule = mask_mod(documents, self.is_causal, pattern or None, seq, query.device)
            return create_block_mask(rule, batch if documents is not None else None, None, seq, seq, device=query.device)
        if self.backend == "sdpa" and documents is None and not pattern:
            return None  # sdpa's causal fast path (the module's is_causal)
        allowed = allowed_mask(batch, seq, documents, self.is_causal, pattern or None, query.device)
        if self.backend == "sdpa":
            return allowed
        return torch.where(allowed, 0.0, torch.finfo(query.dtype).min).to(query.dtype)  # eager adds it


def _own_attention_function(module, backend: str) -> Callable:
    """The function `module` would attend with unprepared: transformers' registered one, or (eager) the
    `eager_attention_forward` of the module's own modeling file."""
    if backend != "eager":
        return ALL_ATTENTION_FUNCTIONS[backend]
    function = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if function is None:
        raise NotImplementedError(
            f"{type(module).__name__} uses eager attention, but its modeling module has no eager_attention_forward"
            " for lightning_ulysses to run on whole rows: build the model with attn_implementation='sdpa'."
        )
    return function
