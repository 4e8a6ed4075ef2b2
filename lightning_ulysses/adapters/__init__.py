"""Per-family knowledge, one small file per family: what a family computes from positions it numbers itself.

Two kinds: a `FamilyAdapter` corrects an attention module's query (below); a `PositionRule` says how a family
numbers the tokens of a row when it is given no `position_ids`, so that the sharder fills in the positions the
family itself would have used (most count `0..seq-1`, padding included; OPT counts real tokens only).

Most families need nothing here: the "ulysses" attention function and the whole-rows mixers (attention/hf.py,
attention/mixers.py) serve any family that dispatches through transformers' interfaces. A family that derives
something inside its attention module from the positions of the tokens it holds (counting them from 0, which
under sequence parallelism is each shard's own start) registers a `FamilyAdapter` that corrects the query
before the exchange, given the shard's global positions. Adding a family is adding a file here and importing it
below; nothing else changes.
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


from lightning_ulysses.adapters import llama4, padding_positions  # noqa: E402,F401  (they register themselves)
