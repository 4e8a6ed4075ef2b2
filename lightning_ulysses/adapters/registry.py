"""The three kinds of per-family knowledge and their registries (see the package's docstring). Apart from the
family files, which register themselves on import: they import this module, the package imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class FamilyAdapter:
    """`applies(module)`: whether an attention module needs it; `adjust_query(module, query, local, global_)`:
    the query `[batch, heads, seq/P, dim]` the module computed as if its shard held positions `local` (`[seq/P]`),
    corrected to the shard's global positions `global_` (`[seq/P]`)."""

    name: str
    applies: Callable[[torch.nn.Module], bool]
    adjust_query: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_ADAPTERS: list[FamilyAdapter] = []


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    _ADAPTERS.append(adapter)
    return adapter


def adapters_for(module: torch.nn.Module) -> list[FamilyAdapter]:
    """The adapters an attention module needs (most need none)."""
    return [adapter for adapter in _ADAPTERS if adapter.applies(module)]


@dataclass(frozen=True)
class PositionRule:
    """`positions(attention_mask)`: the `[batch, seq]` positions the families `model_types` number a row with when
    they are given none (`attention_mask`: the whole rows' padding mask)."""

    name: str
    model_types: frozenset[str]
    positions: Callable[[torch.Tensor], torch.Tensor]


_POSITION_RULES: list[PositionRule] = []


def register_position_rule(rule: PositionRule) -> PositionRule:
    _POSITION_RULES.append(rule)
    return rule


def position_rule_of(models: Sequence[torch.nn.Module]) -> Optional[PositionRule]:
    """The one way the models number positions they are not given (None: `0..seq-1`, the sharder's default).

    Raises where two models of one module number them differently: one batch cannot give both their positions."""
    rules = {id(model): next((rule for rule in _POSITION_RULES
                              if getattr(getattr(model, "config", None), "model_type", None) in rule.model_types),
                             None) for model in models}
    distinct = {rule.name if rule else "0..seq-1": rule for rule in rules.values()}
    if len(distinct) > 1:
        raise ValueError(
            f"the module's models number the tokens of a row differently when given no position_ids"
            f" ({', '.join(sorted(distinct))}), so the strategy cannot fill in one set of positions for both. Put"
            " position_ids in your batches (each model then uses the same given positions).")
    return next(iter(distinct.values()), None)


@dataclass(frozen=True)
class InlineAttention:
    """A family whose attention modules compute attention inline, made sequence-parallel module by module.

    `model_types`: the families (`config.model_type`); `applies(module)`: the attention modules to take over;
    `forward(module, attend, *args, **kwargs)`: the module's own forward (same arguments, same return value) with
    its attention replaced by `attend(query, key, value, *, scale=None, dropout=0.0, alibi_slopes=None,
    alibi_counts_padding=True, sliding_window=None, masking="add")`: `[batch, heads, seq/P, dim]` q/k/v of this
    rank's shard → `[batch, seq/P, heads, dim]`, causal attention over the whole rows (attention/inline.py);
    `alibi_slopes`: all heads' ALiBi slopes (`[heads]`), the bias `slope * key position` added to the scaled scores, positions
    counted over every token (False: over the real tokens only, BLOOM's `cumsum(mask) - 1`); `masking`: how the
    family's eager code masks a query that sees no key (`inline.eager_attention`).
    `alibi`: whether `forward` passes `alibi_slopes` (then only eager/sdpa and ring_size=1 are accepted).
    `refusal(config, backend, ring_size)`: why this configuration cannot run sequence-parallel (naming the fix),
    or None; checked before anything changes and before any collective."""

    name: str
    model_types: frozenset[str]
    applies: Callable[[torch.nn.Module], bool]
    forward: Callable[..., object]
    alibi: bool = False
    refusal: Callable[[object, str, int], Optional[str]] = lambda config, backend, ring_size: None


_INLINE: list[InlineAttention] = []


def register_inline(adapter: InlineAttention) -> InlineAttention:
    _INLINE.append(adapter)
    return adapter


def inline_attention_of(model: torch.nn.Module) -> Optional[InlineAttention]:
    """The `InlineAttention` of a model's family (None: its attention dispatches through the interface)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return next((adapter for adapter in _INLINE if model_type in adapter.model_types), None)
