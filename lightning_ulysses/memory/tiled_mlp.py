"""Tiled MLP: the MLP runs over tiles of the sequence, and each tile is recomputed in backward.

Only one tile's intermediate activations (for Llama 8B at 8K tokens per tile: gate, up and their product,
3 × 8192 × 14336 × 2 bytes ≈ 0.7 GB) exist at any time, instead of the whole sequence's (about 30 GB at 360K
tokens). The input is the only thing kept for backward.

Exactness: each tile computes exactly the untiled MLP's rows (an MLP is position-wise), and the parameter gradients
are the sum of the tiles' gradients, accumulated in fp32. Parameter gradients leave through this function's outputs,
so every parameter's gradient is accumulated *once* per step, as in the untiled MLP: DeepSpeed's ZeRO hooks (which
reduce on accumulation) and DDP see nothing unusual. The tiles run inside one call of the MLP module, so no
collective (ZeRO-3 parameter gathering) happens per tile and ranks may use different tile counts.

Dropout in the MLP (GPT-2's `resid_pdrop`, PEFT's `lora_dropout`): each tile's recompute replays the random state
(CPU and CUDA generators) its forward started from, so it draws the same masks. A tile's mask is a fresh draw for
the tile, not the slice of the mask an untiled MLP would draw: the same distribution, another sample. The MLP is
tiled without gradients too, so that a checkpointed layer's forward (run without gradients) and its recompute (with
them) draw their masks tile by tile alike.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn


def _tiles(x: torch.Tensor, tile_tokens: int) -> list[torch.Tensor]:
    # Contiguous: `narrow` along the sequence of a batch of several rows is a strided view, which layers that
    # flatten with `view` (Hugging Face's `Conv1D`: GPT-2's MLP) cannot take. A copy of one tile at most.
    length = x.size(-2)
    return [x.narrow(-2, start, min(tile_tokens, length - start)).contiguous()
            for start in range(0, length, tile_tokens)]


def _rng_state(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return torch.random.get_rng_state(), [torch.cuda.get_rng_state(device) for device in devices]


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor]], devices: list[int]) -> None:
    cpu_state, cuda_states = state
    torch.random.set_rng_state(cpu_state)
    for device, cuda_state in zip(devices, cuda_states):
        torch.cuda.set_rng_state(cuda_state, device)


class _TiledPositionwise(torch.autograd.Function):
    """`forward_fn` applied to tiles of `x` along dim -2 (the sequence); `params` are what `forward_fn` reads."""

    @staticmethod
    def forward(ctx, forward_fn: Callable, tile_tokens: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.forward_fn, ctx.tile_tokens = forward_fn, tile_tokens
        ctx.params = params  # references only (the module's own parameters); nothing is copied
        ctx.save_for_backward(x)
        # The random state before each tile, for its recompute to draw the same dropout masks (GPT-2's
        # `resid_pdrop`, PEFT's `lora_dropout`), as torch.utils.checkpoint's `preserve_rng_state` does.
        ctx.devices = [x.device.index] if x.is_cuda else []
        ctx.rng_states = []
        outputs = []
        with torch.no_grad():
            for tile in _tiles(x, tile_tokens):
                ctx.rng_states.append(_rng_state(ctx.devices))
                outputs.append(forward_fn(tile))
        return torch.cat(outputs, dim=-2)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        trainable = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[3 + i]]
        # fp32 accumulators: summing bf16 tile gradients in bf16 would round once per tile.
        param_grads = {i: torch.zeros_like(ctx.params[i], dtype=torch.float32) for i in trainable}
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        start = 0
        # fork_rng: the replayed states are undone afterwards, so the step's random stream goes on as without tiles.
        with torch.random.fork_rng(devices=ctx.devices):
            for tile, rng_state in zip(_tiles(x, ctx.tile_tokens), ctx.rng_states, strict=True):
                size = tile.size(-2)
                x_tile = tile.detach().requires_grad_(grad_x is not None)
                _set_rng_state(rng_state, ctx.devices)
                with torch.enable_grad():
                    y_tile = ctx.forward_fn(x_tile)
                inputs = ([x_tile] if grad_x is not None else []) + [ctx.params[i] for i in trainable]
                # autograd.grad, not backward: the parameters' .grad (and the hooks on it) are untouched here.
                grads = torch.autograd.grad(y_tile, inputs, grad_output.narrow(-2, start, size), allow_unused=True)
                if grad_x is not None:
                    grad_x.narrow(-2, start, size).copy_(grads[0])
                    grads = grads[1:]
                for i, grad in zip(trainable, grads):
                    if grad is not None:
                        param_grads[i] += grad
                start += size
        return (None, None, grad_x,
                *(param_grads[i].to(p.dtype) if i in param_grads else None for i, p in enumerate(ctx.params)))


def tiled_forward(module: nn.Module, forward_fn: Callable, x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """Run the position-wise `forward_fn` (reading `module`'s parameters) over sequence tiles of `x`."""
    if x.size(-2) <= tile_tokens:
        return forward_fn(x)  # one tile: the plain path is the same computation, without the recompute
    if not torch.is_grad_enabled():
        # Tiled without gradients too: a checkpointed layer runs its forward so, and its recompute (with gradients)
        # must draw the same dropout masks, tile by tile. It also bounds the intermediate activations of inference.
        return torch.cat([forward_fn(tile) for tile in _tiles(x, tile_tokens)], dim=-2)
    return _TiledPositionwise.apply(forward_fn, tile_tokens, x, *module.parameters())


def tile_mlp(mlp: nn.Module, tile_tokens: int) -> Callable[[], None]:
    """Make `mlp(x)` (x: `[..., seq, hidden]`) run tiled; return the callable that undoes it.

    Under ZeRO-3 the MLP is marked a DeepSpeed "leaf" module, so that all of its parameters are gathered once
    around its forward and its backward (its children get no hooks of their own). This must happen before
    `deepspeed.initialize`, and it is *not* undone by the returned callable: the hooks were registered for a leaf,
    and a leaf is still gathered correctly when it runs untiled.
    """
    if tile_tokens < 1:
        raise ValueError(f"mlp_tile_tokens must be a positive number of tokens, got {tile_tokens}")
    original = mlp.forward
    mlp._z3_leaf = True  # deepspeed.utils.set_z3_leaf_module, without importing DeepSpeed here
    mlp.forward = functools.partial(tiled_forward, mlp, original, tile_tokens=tile_tokens)

    def restore() -> None:
        mlp.__dict__.pop("forward", None)

    return restore
