"""The binding: what one prepared model's attention modules share (groups, backend, transport, the batch's rows).

`prepare_hf_model` creates one `_Binding` per model and puts it on every module of the model (`_lightning_ulysses`);
the "ulysses" attention function, the mask interface (through the model's own attention name, `mask_interface.py`),
the inline attention and the position hooks read every per-model fact from it, never from a module global, so two
models (or two Trainers) in one process never see each other's groups, transport or mask configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_ulysses.attention.core import ProcessGroupHandle
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.hf.decoding import DecodeState

ULYSSES_ATTENTION = "ulysses"
_BINDING_ATTRIBUTE = "_lightning_ulysses"


@dataclass
class _Binding:
    group: ProcessGroupHandle
    backend: str
    decode: Optional[DecodeState] = None
    # K/V blocks pass around this group (hybrid Ulysses × ring); of one rank (no group) for pure Ulysses.
    ring: ProcessGroupHandle = field(default_factory=lambda: ProcessGroupHandle(None))
    # Where the sharder publishes each batch's whole rows (attention/rows.py); None: gathered in every layer.
    batch_rows: Optional[BatchRowsSlot] = None
    # Head groups whose all-to-alls are pipelined with their attention (core.exchange_and_attend).
    head_groups: int = 1
    # How the Ulysses all-to-alls move their bytes (`copy_engine.py`: the strategy's agreed `exchange`); None: the
    # collective all-to-all.
    transport: Any = None
    # The position_ids of the model's latest forward (`_ForwardPositions`), for attention modules whose layer does
    # not hand them on (Llama 4): without them packed documents would not be kept apart.
    forward_positions: Optional[torch.Tensor] = None
    # The 2-D attention_mask of the model's latest forward, for attention computed inline (attention/inline.py),
    # which no mask interface hands the shard's padding.
    forward_padding_mask: Optional[torch.Tensor] = None

    @property
    def sharded(self) -> bool:
        """Whether the sequence is cut at all (SP > 1); at SP 1 the binding only keeps packed documents apart."""
        return self.group.world_size * self.ring.world_size > 1

    def __deepcopy__(self, memo):
        return self


def is_ulysses_attention(name) -> bool:
    """Whether an attention implementation `name` is ours: the plain "ulysses", or a prepared model's own
    (`ulysses-<n>`, `forward.register_model_attention`)."""
    return isinstance(name, str) and (name == ULYSSES_ATTENTION or name.startswith(f"{ULYSSES_ATTENTION}-"))


def binding_of(model) -> Optional[_Binding]:
    """The Ulysses binding of a prepared model (None when it was not switched to Ulysses attention)."""
    return model.__dict__.get(_BINDING_ATTRIBUTE)
