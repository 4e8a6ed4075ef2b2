"""Token mixers that are not attention (linear attention, state-space layers, short convolutions, recurrences)
under sequence parallelism.

Each mixer found in a model (`hf.token_mixer_modules`) runs one of two ways:
- split by heads (head_split.py), the Ulysses way, when a kind of mixer recognises it (one small file per kind:
  gated_deltanet.py, short_conv.py, mamba2.py, mamba.py, kimi_delta.py, lightning_attention.py, rg_lru.py; each
  used by the families that declare it, `Family.token_mixers` in lightning_ulysses/families/) and it
  has at least as many heads (or channels) as SP ranks: each rank takes ⌈U/SP⌉ or ⌊U/SP⌋ of its U units
  (channels.py `unit_range`), so its work and activations shrink with SP (`1/SP` of the whole layer's where SP
  divides U) — with a ring too, over all `ulysses × ring` SP ranks (ranks.py);
- on whole rows (whole_rows.py), the last resort, otherwise (no declaration, fewer units than ranks, or a peft
  adapter the split cannot slice): exact, but the layer's work does not shrink.
peft's LoRA layers on a mixer's linears go through its split (lora.py: called as they are where the split exchanges
a projection, sliced in their parts where it slices a weight); what cannot is named, and the mixer runs on whole rows.
`install_mixers` says which mixers took the last resort and why, so that the caller warns with the cost.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_ulysses.adapters.registry import token_mixer_kinds
from lightning_ulysses.mixers import lora
from lightning_ulysses.mixers.arguments import PackedDocuments
from lightning_ulysses.mixers.head_split import HeadSplitMixer, MixerSplit
from lightning_ulysses.mixers.ranks import SequenceRanks
from lightning_ulysses.mixers.whole_rows import WholeRowsMixer

def split_of(module: torch.nn.Module, parts: int, rank: int = 0) -> MixerSplit | None:
    """The declared split of `module` over `parts` ranks as rank `rank` sees it (its units, layouts and paths are
    every rank's), or None when no kind the families declare (`Family.token_mixers`) recognises it. A kind
    (gated_deltanet.py, mamba2.py, ...) recognises its mixer by structure (`matches(module)`) and declares the split
    as rank `rank` of `parts` sees it (`split(module, parts, rank)`)."""
    kind = next((kind for kind in token_mixer_kinds() if kind.matches(module)), None)
    return None if kind is None else kind.split(module, parts, rank)


def runs_split(module: torch.nn.Module, parts: int) -> bool:
    """Whether `install_mixers` splits `module` over `parts` SP ranks (else: whole rows, or as it is at SP 1)."""
    split = split_of(module, parts)
    return split is not None and split.units >= parts and lora.why_not_split(module, split) is None


def _outside_splits(mixers: list[tuple[str, torch.nn.Module]], parts: int) -> list[tuple[str, torch.nn.Module]]:
    """`mixers` less those inside a mixer that runs split (RecurrentGemma's RG-LRU inside its recurrent block): the
    split's local view runs them, as part of it, on this rank's heads."""
    splits = [path for path, module in mixers if runs_split(module, parts)]
    return [(path, module) for path, module in mixers if not any(path.startswith(f"{split}.") for split in splits)]


def left_on_whole_rows(mixers: list[tuple[str, torch.nn.Module]], parts: int) -> list[tuple[str, torch.nn.Module]]:
    """The mixers of `mixers` that `install_mixers` would run on whole rows over `parts` SP ranks."""
    return [(path, module) for path, module in _outside_splits(mixers, parts) if not runs_split(module, parts)]


def why_on_whole_rows(module: torch.nn.Module, parts: int) -> str | None:
    """Why `module` runs on whole rows over `parts` SP ranks (what the warning says); None when it runs split."""
    if runs_split(module, parts):
        return None
    split = split_of(module, parts)
    if split is None:
        return f"no head split over {parts} ranks is declared for it"
    if (adapters := lora.why_not_split(module, split)) is not None:  # peft's layers on a linear it slices
        return adapters
    return (f"its {split.units} heads/channels are fewer than the {parts} SP ranks (a rank would hold none of them;"
            " each unit's recurrence runs whole on one rank)")


def install_mixers(mixers: list[tuple[str, torch.nn.Module]], group, ring_group=None,
                   decoding: Callable[[], bool] = lambda: False, transport=None,
                   positions: Callable[[], torch.Tensor | None] = lambda: None) -> tuple[list, list[str]]:
    """Put every mixer of `mixers` (`(path, module)`) under sequence parallelism over `group` (and `ring_group`).

    `decoding()`: whether `inference.generate` is decoding; `positions()`: the model's latest `position_ids` shard
    (packed documents). At SP 1 only the declared splits are installed (one of one rank: packed documents then
    restart the mixers as at any SP size); the other mixers stay as they are. Returns the handles that undo it
    (`.remove()`) and, for each mixer left on whole rows, "path (Class): why"."""
    # (a mixer's units are its own, not the attention's: with a ring they still split over every SP rank)
    ranks = SequenceRanks(group, ring_group, transport)
    parts = ranks.size
    documents = PackedDocuments(positions, ranks.gather)
    handles, whole_rows = [], []
    for path, module in _outside_splits(mixers, parts):
        if runs_split(module, parts):
            split = split_of(module, parts, ranks.rank)
            handles.append(HeadSplitMixer(module, path, lora.through_adapters(module, split), ranks, decoding,
                                          documents).install(module))
            continue
        if parts == 1:
            continue
        whole_rows.append(f"{path} ({type(module).__name__}): {why_on_whole_rows(module, parts)}")
        handles += WholeRowsMixer(module, path, group, ring_group, decoding, documents).attach(module)
    return handles, whole_rows
