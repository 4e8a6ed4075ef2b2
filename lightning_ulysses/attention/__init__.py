"""Ulysses attention: the all-to-all ops and the shared core (the Hugging Face switch that uses them: `hf/`)."""

from lightning_ulysses.attention.all_to_all import all_to_all, heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention.core import UlyssesAttention, validate_head_counts

__all__ = [
    "UlyssesAttention",
    "all_to_all",
    "heads_to_sequence",
    "sequence_to_heads",
    "validate_head_counts",
]
