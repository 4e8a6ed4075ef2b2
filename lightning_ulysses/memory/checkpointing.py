"""Whole-layer activation checkpointing, optionally keeping the checkpointed hidden states in host memory.

Each decoder layer keeps only its input hidden states for backward (`seq × hidden` values) and recomputes itself
there. At long sequences even these inputs add up (Llama 8B, 360K tokens: 32 layers × 2.9 GB = 94 GB), so with
`offload=True` they are copied to pinned host memory as the forward pass leaves the layer and copied back when its
backward starts.

Written as a re-entrant autograd function (like DeepSpeed's own checkpointing) rather than with
`torch.utils.checkpoint`: the non-re-entrant checkpoint keeps its inputs alive on the device in a closure, where
no offload can reach them. Parameter gradients accumulate through a normal `backward` of the recomputed layer,
once per parameter, so ZeRO's hooks see what they see without checkpointing.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
from torch import nn


class HostActivationStore:
    """Pinned host buffers for offloaded activations, reused from step to step.

    Buffers are pinned with `cudaHostRegister` on plain host tensors: the caching host allocator behind
    `pin_memory=True` rounds every block up to a power of two (a 2.9 GB hidden state would take 4 GB).
    Without CUDA the buffers are plain host tensors (the copies are then what the tests check).
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._pinned: list[torch.Tensor] = []

    def _allocate(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        if torch.cuda.is_available() and torch.cuda.is_initialized() and buffer.numel():
            from torch.cuda._pin_memory_utils import pin_memory

            pin_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size())
            self._pinned.append(buffer)
        return buffer

    def stash(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.device, bool]:
        key = (tuple(tensor.shape), tensor.dtype)
        buffer = self._free[key].pop() if self._free[key] else self._allocate(tensor.shape, tensor.dtype)
        # Ordered on the current stream: the device memory is only reused by work queued after this copy.
        buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return buffer, tensor.device, tensor.requires_grad

    def restore(self, stashed: tuple[torch.Tensor, torch.device, bool]) -> torch.Tensor:
        buffer, device, requires_grad = stashed
        tensor = buffer.to(device, non_blocking=True) if device.type != "cpu" else buffer.clone()
        # The buffer's next use is a device-to-host copy queued on the same stream after this one.
        self._free[(tuple(buffer.shape), buffer.dtype)].append(buffer)
        return tensor.requires_grad_(requires_grad)

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for buffers in self._free.values() for b in buffers)

    def release(self) -> None:
        """Unpin and drop every buffer. Call it between steps (no stashed activation in flight); memory freed while
        still registered would make a later registration of the same addresses fail."""
        if self._pinned:
            torch.cuda.synchronize()  # no copy may still be reading or writing a buffer
            from torch.cuda._pin_memory_utils import unpin_memory

            for buffer in self._pinned:
                unpin_memory(buffer.data_ptr())
        self._pinned, self._free = [], defaultdict(list)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass

    def __deepcopy__(self, memo):  # host buffers are a cache, not state
        return self


class _CheckpointedLayer(torch.autograd.Function):
    """Runs `run(*args)` without keeping activations; recomputes it in backward from its (stashed) inputs."""

    @staticmethod
    def forward(ctx, run: Callable, store: Optional[HostActivationStore], *args: Any):
        ctx.run, ctx.store = run, store
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [a if not torch.is_tensor(a) else None for a in args]
        ctx.inputs_require_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.devices = sorted({a.device.index for a in args if torch.is_tensor(a) and a.is_cuda})
        ctx.rng = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in ctx.devices]
        tensors = [args[i] for i in ctx.tensor_positions]
        # Offload the layer's hidden-state input (the first argument); the others (rotary tables, masks) are shared
        # by all layers and stay where they are.
        if store is not None and ctx.tensor_positions and ctx.tensor_positions[0] == 0:
            ctx.stashed = store.stash(tensors[0])
            ctx.save_for_backward(*tensors[1:])
        else:
            ctx.stashed = None
            ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = list(ctx.saved_tensors)
        if ctx.stashed is not None:
            saved.insert(0, ctx.store.restore(ctx.stashed))
            ctx.stashed = None
        args = list(ctx.others)
        for position, tensor in zip(ctx.tensor_positions, saved):
            args[position] = tensor.detach().requires_grad_(ctx.inputs_require_grad[position])
        cpu_rng, cuda_rngs = ctx.rng
        with torch.random.fork_rng(devices=ctx.devices), torch.enable_grad():
            torch.random.set_rng_state(cpu_rng)  # dropout in the recompute draws what the forward drew
            for device, state in zip(ctx.devices, cuda_rngs):
                torch.cuda.set_rng_state(state, device)
            outputs = ctx.run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if torch.is_tensor(a) and ctx.inputs_require_grad[i] else None
                              for i, a in enumerate(args)))


# Keyword arguments of Hugging Face decoder layers that carry a KV cache: a recompute must not update it twice.
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


def _checkpointed_forward(layer: nn.Module, original: Callable, store: Optional[HostActivationStore],
                          *args: Any, **kwargs: Any):
    if not (layer.training and torch.is_grad_enabled()):
        return original(*args, **kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name in _CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    if not args:  # hidden states passed by keyword: move them first, the position that is offloaded
        raise ValueError(f"activation_checkpointing needs {type(layer).__name__}'s hidden states as the first"
                         " positional argument.")
    return _CheckpointedLayer.apply(functools.partial(original, **kwargs), store, *args)


def checkpoint_layer(layer: nn.Module, store: Optional[HostActivationStore]) -> Callable[[], None]:
    """Checkpoint `layer` (offloading its hidden-state input to `store` if given); return the undo."""
    if getattr(layer, "gradient_checkpointing", False):
        raise ValueError(
            f"{type(layer).__name__} already has the model's own gradient checkpointing enabled; with the memory"
            " option activation_checkpointing=True the layer would be recomputed twice. Disable one of them (for the"
            " recipes: model.activation_checkpointing=false)."
        )
    original = layer.forward
    layer.forward = functools.partial(_checkpointed_forward, layer, original, store)

    def restore() -> None:
        layer.__dict__.pop("forward", None)

    return restore
