"""The registry of model families: one `Family` record per family, declared in that family's own module
(`lightning_ulysses/families/`, one file each, registering itself on import) and read here by every layer.

The layers (attention/, hf/, mixers/, batch/, planning/) ask this module about a model, a module or a config; they
never name a family themselves. The family modules sit above every layer (they may import the mechanisms they
declare: a mixer kind of mixers/, the planner's cost parts); this module imports none of them, and the package's
`__init__` imports `families`, so every family is registered before anything is prepared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class FamilyAdapter:
    """A correction of an attention module's query for positions it numbers itself.

    `applies(module)`: whether an attention module needs it; `adjust_query(module, query, local, global_)`:
    the query `[batch, heads, seq/P, dim]` the module computed as if its shard held positions `local` (`[seq/P]`),
    corrected to the shard's global positions `global_` (`[seq/P]`)."""

    name: str
    applies: Callable[[torch.nn.Module], bool]
    adjust_query: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PositionRule:
    """`positions(attention_mask)`: the `[batch, seq]` positions a family numbers a row with when it is given none
    (`attention_mask`: the whole rows' padding mask)."""

    name: str
    positions: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class InlineAttention:
    """How a family whose attention modules compute attention inline is made sequence-parallel module by module.

    `applies(module)`: the attention modules to take over; `forward(module, attend, *args, **kwargs)`: the module's
    own forward (same arguments, same return value) with its attention replaced by `attend(query, key, value, *,
    scale=None, dropout=0.0, alibi_slopes=None, alibi_counts_padding=True, sliding_window=None, masking="add")`:
    `[batch, heads, seq/P, dim]` q/k/v of this rank's shard → `[batch, seq/P, heads, dim]`, causal attention over the
    whole rows (attention/inline.py); `alibi_slopes`: all heads' ALiBi slopes (`[heads]`), the bias `slope * key
    position` added to the scaled scores, positions counted over every token (False: over the real tokens only,
    BLOOM's `cumsum(mask) - 1`); `masking`: how the family's eager code masks a query that sees no key
    (`inline.eager_attention`).
    `alibi`: whether `forward` passes `alibi_slopes` (then only eager/sdpa and ring_size=1 are accepted).
    `refusal(config, backend, ring_size)`: why this configuration cannot run sequence-parallel (naming the fix),
    or None; checked before anything changes and before any collective."""

    name: str
    applies: Callable[[torch.nn.Module], bool]
    forward: Callable[..., object]
    alibi: bool = False
    refusal: Callable[[object, str, int], Optional[str]] = lambda config, backend, ring_size: None


@dataclass(frozen=True, eq=False)  # (compared and hashed by identity: one record per family)
class Family:
    """Everything the layers need to know about one model family; every field but `name` is optional (most
    families dispatch through transformers' interfaces and need nothing here).

    - `model_types`: the `config.model_type`s of the family (what the by-config fields below are looked up by).
    - `inline_attention`: its attention modules compute attention inline (attention/inline.py takes them over).
    - `query_adjustment`: its attention modules derive something from positions they count themselves
      (hf/forward.py corrects the query; found by `applies(module)`, whatever the model type).
    - `position_rule`: how it numbers a row given no `position_ids`, when not `0..seq-1` (the sharder fills it in).
    - `token_mixers`: the mixer kinds (modules of mixers/ with `matches(module)` and `split(module, parts, rank)`)
      its token mixers that are not attention split by. A kind recognises its modules by structure, so it serves
      every family whose mixers have that structure, declared or not (mixers/__init__.py tries the kinds the
      registered families declare).
    - `token_mixer_names`: regular-expression fragments of the class names of its token mixers (hf/validation.py
      finds the layers that mix tokens outside attention by them, in any model: run on whole rows or refused).
    - `attention_the_exchange_cannot_carry`: its attention classes (by class name) that dispatch through the
      interface but compute on the shard what the exchange does not carry, with what goes wrong (refused at SP > 1).
    - `encoder`: an encoder (or encoder-decoder) family transformers' causal-LM mapping lists, which transformers'
      masked-LM and sequence-to-sequence mappings do not name (refused at SP > 1, hf/validation.py).
    - `planner_layers(config)`: its decoder layers' kinds for the planner (`planning.layer_kinds.LayerKind`s, each
      part's parameters and bytes; None: attention layers only), for a hybrid the planner prices
      (`layer_kinds.hybrid_layers`). Raises `ValueError` for a layer kind it has no costs for.
    """

    name: str
    model_types: frozenset[str] = frozenset()
    inline_attention: Optional[InlineAttention] = None
    query_adjustment: Optional[FamilyAdapter] = None
    position_rule: Optional[PositionRule] = None
    token_mixers: tuple[Any, ...] = ()
    token_mixer_names: tuple[str, ...] = ()
    attention_the_exchange_cannot_carry: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    encoder: bool = False
    planner_layers: Optional[Callable[[Any], Any]] = None


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` (its module calls this on import); a second family of the same name or model type is an error."""
    taken = {model_type: other.name for other in _FAMILIES.values() for model_type in other.model_types}
    clash = sorted(model_type for model_type in family.model_types if model_type in taken)
    if family.name in _FAMILIES or clash:
        raise ValueError(f"family {family.name!r} is registered twice (or shares the model types {clash} with"
                         f" {sorted({taken[m] for m in clash})})")
    _FAMILIES[family.name] = family
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def family_of(config: Any) -> Optional[Family]:
    """The family of a config by its `model_type`; None when none is registered (the family needs nothing beyond
    the generic paths)."""
    model_type = getattr(config, "model_type", None)
    return next((family for family in _FAMILIES.values() if model_type in family.model_types), None)


def adapters_for(module: torch.nn.Module) -> list[FamilyAdapter]:
    """The query adjustments an attention module needs (most need none)."""
    return [family.query_adjustment for family in _FAMILIES.values()
            if family.query_adjustment is not None and family.query_adjustment.applies(module)]


def position_rule_of(models: Sequence[torch.nn.Module]) -> Optional[PositionRule]:
    """The one way the models number positions they are not given (None: `0..seq-1`, the sharder's default).

    Raises where two models of one module number them differently: one batch cannot give both their positions."""
    rules = {}
    for model in models:
        family = family_of(getattr(model, "config", None))
        rules[id(model)] = None if family is None else family.position_rule
    distinct = {rule.name if rule else "0..seq-1": rule for rule in rules.values()}
    if len(distinct) > 1:
        raise ValueError(
            f"the module's models number the tokens of a row differently when given no position_ids"
            f" ({', '.join(sorted(distinct))}), so the strategy cannot fill in one set of positions for both. Put"
            " position_ids in your batches (each model then uses the same given positions).")
    return next(iter(distinct.values()), None)


def inline_attention_of(model: torch.nn.Module) -> Optional[InlineAttention]:
    """The `InlineAttention` of a model's family (None: its attention dispatches through the interface)."""
    family = family_of(getattr(model, "config", None))
    return None if family is None else family.inline_attention


def token_mixer_kinds() -> tuple[Any, ...]:
    """The mixer kinds the registered families declare, each once, in the order they were first declared."""
    return tuple(dict.fromkeys(kind for family in _FAMILIES.values() for kind in family.token_mixers))


def token_mixer_names() -> re.Pattern:
    """One pattern of every family's token-mixer class-name fragments (`search`ed in a class name)."""
    fragments = dict.fromkeys(name for family in _FAMILIES.values() for name in family.token_mixer_names)
    return re.compile("|".join(fragments) or r"(?!)")


def attention_the_exchange_cannot_carry(class_name: str) -> Optional[str]:
    """What goes wrong with the attention class `class_name` on a shard (declared by its family), or None."""
    return next((family.attention_the_exchange_cannot_carry[class_name] for family in _FAMILIES.values()
                 if class_name in family.attention_the_exchange_cannot_carry), None)


def encoder_model_types() -> frozenset[str]:
    """The model types the families declare encoders (beside those transformers' mappings name)."""
    return frozenset(model_type for family in _FAMILIES.values() if family.encoder for model_type in family.model_types)


def planner_layers_of(config: Any) -> Optional[Callable[[Any], Any]]:
    """The family's `planner_layers` for a config (None: its family declares none)."""
    family = family_of(config)
    return None if family is None else family.planner_layers
