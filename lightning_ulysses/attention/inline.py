"""Attention computed inline (BLOOM, MPT, Falcon, GPT-Neo, XGLM) under sequence parallelism.

These families' attention modules do not dispatch through transformers' AttentionInterface: they multiply their
own scores (BLOOM's `alibi.baddbmm`, MPT's `position_bias`, Falcon's own sdpa branches, GPT-Neo's and XGLM's eager
code), so the "ulysses" attention function never runs and each rank would attend within its shard. While a model
is prepared, every such module gets the forward its family's `InlineAttention` (lightning_ulysses/families/)
writes: the module's own projections, `attend` (below) in place of its attention, its own output projection and
dropout; `PreparedHFModel.restore` removes it again.

`attend` is `core.ulysses_attention` on the shard: the all-to-all, the whole rows' padding (the model's 2-D
`attention_mask`, recorded by the model's forward pre-hook) and packed documents (its `position_ids`, for the
families that take them), and a local attention on whole rows of this rank's heads. ALiBi: after the exchange a
rank holds the heads `local_heads(...)`, so it adds the slopes of those heads times the keys' positions in the
whole row (under softmax a per-query constant does not matter: `slope * key` is the `-slope * (query - key)` of
the paper on every key a causal query sees), as a float mask for sdpa (`heads/P × seq²` per layer).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ulysses.adapters import InlineAttention, inline_attention_of
from lightning_ulysses.attention.core import local_heads, ulysses_attention
from lightning_ulysses.attention.documents import AttentionPattern, allowed_mask

# The backends `attend` runs: the model's eager code becomes sdpa on whole rows (the same softmax attention).
_PLAIN_BACKENDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_ALIBI_BACKENDS = ("sdpa", "eager")


def inline_refusal(model: torch.nn.Module, backend: str, ring_size: int) -> Optional[str]:
    """Why `model` (whose family computes attention inline) cannot run sequence-parallel, or None. Reads the
    model's config only, so every rank refuses alike before any collective."""
    adapter = inline_attention_of(model)
    if adapter is None:
        return None
    name = type(model).__name__
    if backend not in _PLAIN_BACKENDS:
        return (f"{name} attends inline with attn_implementation={backend!r}, which lightning_ulysses does not run"
                " under sequence parallelism: build it with attn_implementation='eager' or 'sdpa'.")
    if adapter.alibi and ring_size > 1:
        return (f"{name} adds ALiBi biases, which ring attention (ring_size > 1, plain softmax attention) cannot add:"
                " use ring_size=1 (a sequence_parallel_size the heads divide).")
    if adapter.alibi and backend not in _ALIBI_BACKENDS:
        return (f"{name} adds ALiBi biases, which lightning_ulysses applies in sdpa on whole rows (not with"
                f" {backend}) under sequence parallelism: build it with attn_implementation='eager'.")
    if backend == "eager" and ring_size > 1:
        return (f"{name} attends with eager attention, which ring attention (ring_size > 1, plain softmax attention)"
                " does not reproduce: use ring_size=1 (a sequence_parallel_size the heads divide), or"
                " attn_implementation='sdpa' where the family has it.")
    refusal = adapter.refusal(model.config, backend, ring_size)
    return None if refusal is None else f"{name}: {refusal}"


def covers(model: torch.nn.Module) -> bool:
    """Whether `model` has attention modules an `InlineAttention` takes over."""
    adapter = inline_attention_of(model)
    return adapter is not None and any(adapter.applies(module) for module in model.modules())


def install(model: torch.nn.Module, binding) -> list[torch.nn.Module]:
    """Give every attention module of `model` its family's sequence-parallel forward; returns the modules (delete
    their instance `forward` to undo)."""
    adapter = inline_attention_of(model)
    modules = [module for module in model.modules() if adapter.applies(module)]
    for module in modules:
        module.__dict__["forward"] = _InlineForward(module, adapter, binding)
    return modules


class _InlineForward:
    """The forward a prepared inline-attention module runs: its family's forward around `attend`."""

    def __init__(self, module: torch.nn.Module, adapter: InlineAttention, binding) -> None:
        self.module, self.adapter, self.binding = module, adapter, binding

    def __deepcopy__(self, memo):  # a deep copy of the module (an EMA copy) runs on its own parameters
        return _InlineForward(copy.deepcopy(self.module, memo), self.adapter, self.binding)

    def __call__(self, *args, **kwargs):
        return self.adapter.forward(self.module, self.attend, *args, **kwargs)

    def attend(self, query, key, value, *, scale: Optional[float] = None, dropout: float = 0.0,
               alibi_slopes: Optional[torch.Tensor] = None, alibi_counts_padding: bool = True,
               sliding_window: Optional[int] = None, masking: str = "add") -> torch.Tensor:
        binding, name = self.binding, type(self.module).__name__
        if binding.decode is not None:
            raise NotImplementedError(
                f"{name} attends inline; decoding from a sequence-parallel prefill is not supported for it: generate"
                " with sequence_parallel_size=1.")
        if key.size(2) != query.size(2):
            raise NotImplementedError(
                f"{name} got keys from a KV cache under sequence parallelism: call the model with use_cache=False"
                " (training and evaluation), or generate with sequence_parallel_size=1.")
        padding_mask = binding.forward_padding_mask
        if padding_mask is not None and padding_mask.dim() != 2:
            raise ValueError(
                f"{name} got a {padding_mask.dim()}-D attention mask; under sequence parallelism only 2-D padding"
                " masks ([batch, seq]) and packed position_ids can be cut along the sequence.")
        row_length = query.size(2) * binding.group.world_size * binding.ring.world_size
        pattern = AttentionPattern(sliding_window) if sliding_window is not None and sliding_window < row_length \
            else None
        local = None
        if alibi_slopes is not None or binding.backend == "eager":  # the family's eager attention, on whole rows
            heads = local_heads(query.size(1), binding.group.world_size, binding.group.rank)
            slopes = None if alibi_slopes is None else alibi_slopes[heads]
            local = _EagerAttention(slopes, alibi_counts_padding, scale, dropout, masking, name)
        backend = "sdpa" if binding.backend == "eager" else binding.backend
        return ulysses_attention(
            query, key, value, binding.group.group, backend,
            position_ids=binding.forward_positions,  # None for families without position_ids (BLOOM, MPT)
            padding_mask=padding_mask,
            is_causal=True, scale=scale, dropout_p=dropout, ring_group=binding.ring.group,
            batch_rows=binding.batch_rows, head_groups=binding.head_groups, pattern=pattern, local=local,
            transport=binding.transport)


class _EagerAttention:
    """The families' own eager softmax attention (with ALiBi, if given slopes) on whole rows of this rank's heads
    (`ulysses_attention(local=...)`)."""

    def __init__(self, slopes: Optional[torch.Tensor], counts_padding: bool, scale: Optional[float], dropout: float,
                 masking: str, name: str):
        self.slopes, self.counts_padding, self.scale, self.dropout = slopes, counts_padding, scale, dropout
        self.masking, self.name = masking, name

    def __call__(self, query, key, value, documents, pattern):
        return eager_attention(query, key, value, self.slopes, documents, pattern, self.counts_padding, self.scale,
                               self.dropout, self.masking, self.name)


def alibi_key_positions(seq: int, documents, counts_padding: bool, device) -> torch.Tensor:
    """`[batch or 1, seq]`: the positions ALiBi multiplies its slopes by, over the whole rows: every token's index,
    or (`counts_padding=False`, BLOOM) the real tokens counted from 0 and padding 0 (`(cumsum(mask) - 1) * mask`)."""
    real = None if documents is None else documents.real_tokens
    if counts_padding or real is None:
        return torch.arange(seq, device=device)[None]
    real = real.long()
    return (real.cumsum(dim=1) - 1) * real


def eager_attention(query, key, value, slopes, documents, pattern, counts_padding: bool = True,
                    scale: Optional[float] = None, dropout: float = 0.0, masking: str = "add",
                    name: str = "the model") -> torch.Tensor:
    """`[batch, heads, seq, dim]` whole rows → `[batch, seq, heads, dim]`: softmax(scale·q·k [+ slope·key position])
    with the keys the documents, padding, causality and `pattern` do not allow at the dtype's minimum, as the
    families' eager code masks them. A query with no key at all (a left-padding token) then averages every value,
    as there; its scores' gradient is the family's: `masking="add"` (the mask added to the scores: BLOOM, Falcon)
    lets it through, `"fill"` (`masked_fill`: MPT) does not; `"refuse"`: the family's eager code does something
    else there (GPT-Neo: -inf where two masks add up; XGLM: half gradients from a clamp), so rows where such a
    token predicts the next, real one (left padding) are refused by name.

    sdpa's fused CPU kernel returns that average forward but wrong gradients backward (measured, torch 2.13: as if
    the row were empty), so batches holding such a query run sdpa's math kernel, forward and backward alike."""
    batch, seq = query.size(0), query.size(2)
    allowed = allowed_mask(batch, seq, documents, True, pattern, query.device)
    if slopes is None:
        bias = torch.zeros((), device=query.device)
    else:
        positions = alibi_key_positions(seq, documents, counts_padding, query.device).float()
        bias = slopes.float().to(query.device)[None, :, None, None] * positions[:, None, None, :]
    mask = torch.where(allowed, bias, torch.finfo(query.dtype).min).to(query.dtype)
    empty_rows = ~allowed.any(dim=-1, keepdim=True)  # [batch, 1, seq, 1]: queries without any key
    empty = documents is not None and documents.derived(("empty_queries", pattern), lambda: bool(empty_rows.any()))
    if empty and masking == "refuse" and bool((empty_rows[:, 0, :-1, 0] & documents.real_tokens[:, 1:]).any()):
        # (a padding token's output reaches the loss only when it predicts the real token after it: left padding)
        raise NotImplementedError(
            f"{name} under sequence parallelism with eager attention cannot reproduce what its eager code computes for"
            " tokens that see no key (left padding): pad on the right (tokenizer.padding_side='right'), or use"
            " sequence_parallel_size=1.")
    if empty and masking == "fill":  # masked_fill passes no gradient to the scores: zero queries (uniform rows)
        query = query.masked_fill(empty_rows, 0.0)
    with sdpa_kernel(SDPBackend.MATH) if empty else contextlib.nullcontext():
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale,
                                                enable_gqa=key.size(1) != query.size(1))
    return output.transpose(1, 2)
