"""Ulysses attention: the all-to-all ops, the shared core, and the per-model Hugging Face integration."""

from lightning_ulysses.attention.all_to_all import all_to_all, heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention.core import UlyssesAttention, validate_head_counts
from lightning_ulysses.attention.hf import prepare_hf_model

__all__ = [
    "UlyssesAttention",
    "all_to_all",
    "heads_to_sequence",
    "prepare_hf_model",
    "sequence_to_heads",
    "validate_head_counts",
]
