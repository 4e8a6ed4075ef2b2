"""Per-family knowledge, one small file per family: what a family computes from positions it numbers itself.

Most families need nothing here: the "ulysses" attention function and the whole-rows mixers (attention/hf.py,
attention/mixers.py) serve any family that dispatches through transformers' interfaces. A family that derives
something inside its attention module from the positions of the tokens it holds (counting them from 0, which
under sequence parallelism is each shard's own start) registers a `FamilyAdapter` that corrects the query
before the exchange, given the shard's global positions. Adding a family is adding a file here and importing it
below; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


from lightning_ulysses.adapters import llama4  # noqa: E402,F401  (registers itself)
