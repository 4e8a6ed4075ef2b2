"""Per-family knowledge, one small file per family: what a family computes from positions it numbers itself.

Three kinds: a `FamilyAdapter` corrects an attention module's query (below); a `PositionRule` says how a family
numbers the tokens of a row when it is given no `position_ids`, so that the sharder fills in the positions the
family itself would have used (most count `0..seq-1`, padding included; OPT counts real tokens only); an
`InlineAttention` gives a module that computes attention inline (not through transformers' AttentionInterface:
BLOOM, MPT, Falcon, GPT-Neo, XGLM) a forward of its own projections around the Ulysses exchange
(attention/inline.py).

Most families need nothing here: the "ulysses" attention function and the whole-rows mixers (hf/,
mixers/) serve any family that dispatches through transformers' interfaces. A family that derives
something inside its attention module from the positions of the tokens it holds (counting them from 0, which
under sequence parallelism is each shard's own start) registers a `FamilyAdapter` that corrects the query
before the exchange, given the shard's global positions. Adding a family is adding a file here (registering itself
through `adapters.registry`) and importing it below; nothing else changes.
"""

from lightning_ulysses.adapters.registry import (FamilyAdapter, InlineAttention, PositionRule, adapters_for,
                                                 inline_attention_of, position_rule_of, register, register_inline,
                                                 register_position_rule)
from lightning_ulysses.adapters import (  # noqa: F401  (they register themselves)
    bloom, falcon, gpt_neo, llama4, mpt, padding_positions, xglm)

__all__ = ["FamilyAdapter", "InlineAttention", "PositionRule", "adapters_for", "inline_attention_of",
           "position_rule_of", "register", "register_inline", "register_position_rule"]
