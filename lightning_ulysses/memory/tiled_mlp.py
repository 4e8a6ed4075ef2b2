"""Tiled MLP: the MLP runs over tiles of the sequence, and each tile is recomputed in backward.

Only one tile's intermediate activations (for Llama 8B at 8K tokens per tile: gate, up and their product,
3 × 8192 × 14336 × 2 bytes ≈ 0.7 GB) exist at any time, instead of the whole sequence's (about 30 GB at 360K
tokens). The input is the only thing kept for backward.

Exactness: each tile computes exactly the untiled MLP's rows (an MLP is position-wise), and the parameter gradients
are the sum of the tiles' gradients, accumulated in fp32. Parameter gradients leave through this function's outputs,
so every parameter's gradient is accumulated *once* per step, as in the untiled MLP: DeepSpeed's ZeRO hooks (which
reduce on accumulation) and DDP see nothing unusual. The tiles run inside one call of the MLP module, so no
collective (ZeRO-3 parameter gathering) happens per tile and ranks may use different tile counts.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn


def _tiles(length: int, tile_tokens: int) -> list[tuple[int, int]]:
    return [(start, min(tile_tokens, length - start)) for start in range(0, length, tile_tokens)]


class _TiledPositionwise(torch.autograd.Function):
    """`forward_fn` applied to tiles of `x` along dim -2 (the sequence); `params` are what `forward_fn` reads."""

    @staticmethod
    def forward(ctx, forward_fn: Callable, tile_tokens: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.forward_fn, ctx.tile_tokens = forward_fn, tile_tokens
        ctx.params = params  # references only (the module's own parameters); nothing is copied
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([forward_fn(x.narrow(-2, start, size)) for start, size in
                              _tiles(x.size(-2), tile_tokens)], dim=-2)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (x,) = ctx.saved_tensors
        trainable = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[3 + i]]
        # fp32 accumulators: summing bf16 tile gradients in bf16 would round once per tile.
        param_grads = {i: torch.zeros_like(ctx.params[i], dtype=torch.float32) for i in trainable}
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        for start, size in _tiles(x.size(-2), ctx.tile_tokens):
            x_tile = x.narrow(-2, start, size).detach().requires_grad_(grad_x is not None)
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
        return (None, None, grad_x,
                *(param_grads[i].to(p.dtype) if i in param_grads else None for i, p in enumerate(ctx.params)))


def tiled_forward(module: nn.Module, forward_fn: Callable, x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """Run the position-wise `forward_fn` (reading `module`'s parameters) over sequence tiles of `x`."""
    if not torch.is_grad_enabled() or x.size(-2) <= tile_tokens:
        return forward_fn(x)  # one tile: the plain path is the same computation, without the recompute
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
