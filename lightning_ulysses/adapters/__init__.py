"""The registry of per-family knowledge (registry.py), which every layer reads, and `NativeCausalLM`
(native_model.py), how a model that is not Hugging Face's tells the core what it needs.

A family's knowledge is one `Family` record declared in that family's own module (`lightning_ulysses/families/`):
its inline attention (`InlineAttention`: a module that computes attention itself, BLOOM, MPT, Falcon, GPT-Neo,
XGLM, given a forward of its own projections around the Ulysses exchange, attention/inline.py), its query correction
(`FamilyAdapter`: a module that derives something from positions it counts from its shard's start, Llama 4), its
position rule (`PositionRule`: how it numbers a row given no `position_ids`, OPT), its token mixers' kinds and class
names, what validation refuses of it, and its decoder layers' kinds for the planner. The layers ask this registry;
they never name a family. Adding a family: docs/adding-a-family.md.
"""

from lightning_ulysses.adapters.registry import (Family, FamilyAdapter, InlineAttention, PositionRule, adapters_for,
                                                 families, family_of, inline_attention_of, position_rule_of, register)

__all__ = ["Family", "FamilyAdapter", "InlineAttention", "PositionRule", "adapters_for", "families", "family_of",
           "inline_attention_of", "position_rule_of", "register"]
