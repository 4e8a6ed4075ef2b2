"""Token mixers that are not attention (linear attention, state-space layers, short convolutions, recurrences)
under sequence parallelism.

Each mixer found in a model (`hf.token_mixer_modules`) runs one of two ways:
- split by heads (head_split.py), the Ulysses way, when its family declares how (one small file per family:
  gated_deltanet.py, short_conv.py, mamba2.py, mamba.py, kimi_delta.py, lightning_attention.py) and its heads (or
  channels) divide by the SP size: its work and activations are `1/SP` of the whole layer's on every rank;
- on whole rows (whole_rows.py), the last resort, otherwise: exact, but the layer's work does not shrink.
`install_mixers` says which mixers took the last resort and why, so that the caller warns with the cost.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.parallel.layout import ShardOrder
from lightning_ulysses.mixers import gated_deltanet, kimi_delta, lightning_attention, mamba, mamba2, short_conv
from lightning_ulysses.mixers.arguments import PackedDocuments
from lightning_ulysses.mixers.head_split import HeadSplitMixer, MixerSplit
from lightning_ulysses.mixers.whole_rows import WholeRowsMixer

# Per family: `matches(module)` recognises its mixer by structure, `split(module, parts)` declares the split (or
# None where it cannot split over `parts` ranks).
FAMILIES = (gated_deltanet, short_conv, mamba2, mamba, kimi_delta, lightning_attention)


def split_of(module: torch.nn.Module, parts: int) -> MixerSplit | None:
    """The declared split of `module` over `parts` ranks, or None when no family declares one for `parts` ranks."""
    family = next((family for family in FAMILIES if family.matches(module)), None)
    return None if family is None else family.split(module, parts)


def install_mixers(mixers: list[tuple[str, torch.nn.Module]], group, ring_group=None,
                   decoding: Callable[[], bool] = lambda: False, transport=None,
                   positions: Callable[[], torch.Tensor | None] = lambda: None) -> tuple[list, list[str]]:
    """Put every mixer of `mixers` (`(path, module)`) under sequence parallelism over `group` (and `ring_group`).

    `decoding()`: whether `inference.generate` is decoding; `positions()`: the model's latest `position_ids` shard
    (packed documents). At SP 1 only the declared splits are installed (one of one rank: packed documents then
    restart the mixers as at any SP size); the other mixers stay as they are. Returns the handles that undo it
    (`.remove()`) and, for each mixer left on whole rows, "path (Class): why"."""
    parts = 1 if group is None else dist.get_world_size(group)
    ring = 1 if ring_group is None else dist.get_world_size(ring_group)
    order, _ = ShardOrder.of_groups(group if parts > 1 else None, ring_group if ring > 1 else None)

    def gather(shard: torch.Tensor) -> torch.Tensor:
        rows = all_gather_sequence(shard, group if parts > 1 else None, seq_dim=1)
        return all_gather_sequence(rows, ring_group if ring > 1 else None, seq_dim=1, order=order)

    documents = PackedDocuments(positions, gather)
    handles, whole_rows = [], []
    for path, module in mixers:
        split = split_of(module, parts)
        if split is not None and ring == 1 and split.units % parts == 0:
            handles.append(HeadSplitMixer(module, path, split, group if parts > 1 else None, decoding, transport,
                                          documents).install(module))
            continue
        if parts * ring == 1:
            continue
        if split is None:
            why = f"no head split over {parts} ranks is declared for it"
        elif ring > 1:
            why = "the sequence also passes around a ring"
        else:
            why = f"its {split.units} heads/channels do not divide by the SP size {parts}"
        whole_rows.append(f"{path} ({type(module).__name__}): {why}")
        handles += WholeRowsMixer(module, path, group, ring_group, decoding, documents).attach(module)
    return handles, whole_rows
