"""Whether two tensors are the same values without comparing them: same storage, place, layout, in-place version.

The batch's published rows (attention/rows.py) and the stretches of `checkpoint_interval` (memory/checkpointing.py)
both need to recognise a tensor handed back to them — the very tensor, or an alias such as its `detach()` or the one
DeepSpeed ZeRO-3's module hooks return — as long as nobody modified it in place, in metadata only: no device sync.
"""

from __future__ import annotations

import weakref

import torch

from lightning_ulysses.fences import _torch_private as torch_private


class _StorageOf:
    """Compares equal to the same live storage only; holds it weakly (no device memory kept alive)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        # Storages keep their Python object while they live: the same object for every alias of a tensor.
        self.storage = weakref.ref(tensor.untyped_storage())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StorageOf) and self.storage() is not None and self.storage() is other.storage()


def view_key(tensor: torch.Tensor) -> tuple:
    """Equal for `tensor` and its unmodified aliases; different once it is modified in place (or its storage freed).

    Inference tensors (Lightning evaluates under `torch.inference_mode`) have no version counter: an in-place change
    to them goes unnoticed.
    """
    version = None if tensor.is_inference() else torch_private.version_counter(tensor)
    return _StorageOf(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype, version
