"""The autocast state a recompute in backward runs under: the forward's, recorded when the forward ran.

Lightning's `bf16-mixed` with the FSDP2 strategy runs the forward under `torch.autocast` (its `MixedPrecision` plugin's
`forward_context`) and the backward outside it. A recompute in backward (a checkpointed layer, a tiled MLP's tiles)
must run what the forward ran: without the forward's autocast, a product of fp32 tensors (the Gated DeltaNet's
chunked delta rule upcasts its inputs to fp32) runs in fp32 where the forward ran it in bf16, and the gradients are
those of another function (a kept product replayed there has the forward's dtype: its backward fails). This is what
`torch.utils.checkpoint` restores too (`_get_autocast_kwargs`, torch 2.13).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch


class AutocastState(NamedTuple):
    """Per device type (the CPU's and the tensors' own): whether autocast is on and its dtype; the cast cache."""

    by_device_type: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def of(cls, device: torch.device) -> "AutocastState":
        types = sorted({"cpu", device.type})
        return cls(tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in types if torch.amp.is_autocast_available(kind)),
                   torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.by_device_type:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache_enabled))
            yield
