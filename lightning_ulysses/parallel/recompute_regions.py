"""Named regions of a forward, marked where torch's dispatcher sees them, for the memory engine's kept outputs.

A checkpointed layer can keep the outputs of chosen operations from its forward and replay them in its recompute
(`memory/checkpointing.py`: a dispatch mode decides per operation). A matrix product looks the same to the dispatcher
wherever it runs, but what keeping it is worth does not: a projection's product runs at the matmul rate, the chunked
delta rule's many small products of a token mixer far below it (the H200: ~1 against ~700 TFLOP/s), and a tiled MLP's
products are what it tiles precisely not to keep. So the code that knows marks its region: `recompute_region(kind)`
calls the operator `lightning_ulysses::recompute_region` (which does nothing) on entry and on exit, and a dispatch
mode watching the operators sees where the region begins and ends — in the forward and again, identically, in every
recompute. No state outside the call: where no such mode runs, the marks cost two empty operator calls.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

OPERATOR_NAME = "lightning_ulysses::recompute_region"
# The chunked recurrence of a token mixer (the gated delta rule, Mamba2's scan): its products are slow to recompute.
TOKEN_MIXER = "token_mixer"
# A tiled MLP: it recomputes itself tile by tile, so nothing in it is kept.
TILED = "tiled"
KINDS = (TOKEN_MIXER, TILED)


@torch.library.custom_op(OPERATOR_NAME, mutates_args=())
def _mark(kind: str, enter: bool) -> None:
    """Nothing: the call itself is the mark (`enter`: the region begins, else it ends)."""
    return None


@_mark.register_fake
def _(kind: str, enter: bool) -> None:
    return None


MARK = torch.ops.lightning_ulysses.recompute_region.default


@contextlib.contextmanager
def recompute_region(kind: str) -> Iterator[None]:
    """Mark the operations run inside as region `kind` (one of `KINDS`) for a watching dispatch mode."""
    if kind not in KINDS:
        raise ValueError(f"unknown recompute region {kind!r}; one of {KINDS}")
    MARK(kind, True)
    try:
        yield
    finally:
        MARK(kind, False)
