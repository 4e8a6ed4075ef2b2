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

Under layer checkpointing the MLP's forward is not run again in the layer's recompute (`deferred_recompute`): the
recompute's outputs only carry gradients back, the MLP's backward recomputes its tiles from its input anyway, and
so the MLP's output values are never read — provided nothing between the MLP and the layer's outputs keeps a tensor
for its backward (Llama-style layers: a residual add). That is checked on the recompute's autograd graph: the first
recompute of each MLP runs it and checks; only an MLP that passed (and whose forward draws no random numbers) is
deferred from then on, and every deferred recompute is checked again. A tiled MLP then costs no extra forward at
all: its forward runs twice, as an untiled checkpointed MLP's does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.fences import _torch_private as torch_private
from lightning_ulysses.memory.autocast_state import AutocastState
from lightning_ulysses.parallel.recompute_regions import TILED, recompute_region


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
    def forward(ctx, forward_fn: Callable, tile_tokens: int, deferred: Optional[tuple], x: torch.Tensor,
                *params: torch.Tensor):
        ctx.forward_fn, ctx.tile_tokens = forward_fn, tile_tokens
        ctx.params = params  # references only (the module's own parameters); nothing is copied
        ctx.save_for_backward(x)
        # The random state before each tile, for its recompute to draw the same dropout masks (GPT-2's
        # `resid_pdrop`, PEFT's `lora_dropout`), as torch.utils.checkpoint's `preserve_rng_state` does.
        ctx.devices = [x.device.index] if x.is_cuda else []
        ctx.autocast = AutocastState.of(x.device)  # bf16-mixed on FSDP2: the tiles' recompute runs under it too
        if deferred is not None:
            # Output values nobody reads (`TiledMLP`): no tile runs; a forward that draws nothing leaves every tile
            # the state it starts from now.
            shape, dtype = deferred
            ctx.rng_states = [_rng_state(ctx.devices)] * len(range(0, x.size(-2), tile_tokens))
            return x.new_zeros(shape, dtype=dtype)
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
        trainable = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[4 + i]]
        # fp32 accumulators: summing bf16 tile gradients in bf16 would round once per tile.
        param_grads = {i: torch.zeros_like(ctx.params[i], dtype=torch.float32) for i in trainable}
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        start = 0
        # fork_rng: the replayed states are undone afterwards, so the step's random stream goes on as without tiles.
        with torch.random.fork_rng(devices=ctx.devices):
            for tile, rng_state in zip(_tiles(x, ctx.tile_tokens), ctx.rng_states, strict=True):
                size = tile.size(-2)
                x_tile = tile.detach().requires_grad_(grad_x is not None)
                _set_rng_state(rng_state, ctx.devices)
                with torch.enable_grad(), ctx.autocast.restored():
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
        return (None, None, None, grad_x,
                *(param_grads[i].to(p.dtype) if i in param_grads else None for i, p in enumerate(ctx.params)))


def _tiles_without_grad(forward_fn: Callable, x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    return torch.cat([forward_fn(tile) for tile in _tiles(x, tile_tokens)], dim=-2)


def _signature(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.device


class TiledMLP:
    """The forward `tile_mlp` gives an MLP: `forward_fn` over `tile_tokens`-token tiles of the sequence."""

    # False: the MLP runs in every recompute (the behaviour before 2026-12-02, for a benchmark's same-run baseline)
    leave_out_of_recompute = True

    def __init__(self, module: nn.Module, forward_fn: Callable, tile_tokens: int) -> None:
        self.module, self.forward_fn, self.tile_tokens = module, forward_fn, tile_tokens
        self.recomputing = False  # set by `deferred_recompute` around a checkpointed layer's recompute
        self.defer = False  # ... and this, where the MLP may be left out of it (`leave_out_of_recompute`)
        self.deferrable: Optional[bool] = None  # None until a recompute's graph has been checked
        # The last call without gradients: (input signature, output signature, whether it drew random numbers).
        # A checkpointed layer's forward runs so just before its recompute, on the same input.
        self.last_forward: Optional[tuple] = None
        self.outputs: list = []  # autograd nodes of the outputs made inside the current `deferred_recompute`

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A region no kept-outputs mode keeps anything of: the MLP is tiled not to keep its intermediates, and a
        # checkpointed layer's recompute may leave its forward out (then nothing recorded in it would be replayed).
        with recompute_region(TILED):
            return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            # Tiled without gradients too: a checkpointed layer runs its forward so, and its recompute (with
            # gradients) must draw the same dropout masks, tile by tile. It also bounds the intermediate
            # activations of inference.
            devices = [x.device.index] if x.is_cuda else []
            before = _rng_state(devices)
            y = self.forward_fn(x) if x.size(-2) <= self.tile_tokens else _tiles_without_grad(
                self.forward_fn, x, self.tile_tokens)
            after = _rng_state(devices)
            drew = not all(torch.equal(a, b) for a, b in zip([before[0], *before[1]], [after[0], *after[1]]))
            self.last_forward = (_signature(x), (tuple(y.shape), y.dtype), drew)
            return y
        if not self.defer or self.deferrable is False:  # (an MLP whose output a backward reads runs as it did)
            if x.size(-2) <= self.tile_tokens and self.recomputing:
                # One tile inside a checkpointed layer's recompute: its intermediates live only until this layer's
                # backward, as one tile's do, so the plain path keeps no more and saves the tile's second forward.
                # Anywhere else one tile goes through the function too: the plain path would keep every layer's
                # intermediates until backward, the memory `tiled_mlp` promises (and the planner counts) not to use.
                return self.forward_fn(x)
            return _TiledPositionwise.apply(self.forward_fn, self.tile_tokens, None, x, *self.module.parameters())
        deferred = None
        if self.deferrable and self.last_forward is not None:
            signature, output, drew = self.last_forward
            deferred = output if signature == _signature(x) and not drew else None
        # Through the autograd function even for one tile: its node is what the graph check looks for.
        y = _TiledPositionwise.apply(self.forward_fn, self.tile_tokens, deferred, x, *self.module.parameters())
        self.outputs.append((y.grad_fn, deferred is not None))
        return y


def _saves_tensors(node: Any) -> bool:
    """Whether an autograd node keeps any tensor for its backward (conservatively: any tensor it holds)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        held = [*node.saved_tensors, *vars(node).values()]
    else:
        held = torch_private.saved_values_of(node)
    held += [item for value in held if isinstance(value, (tuple, list)) for item in value]
    return any(torch.is_tensor(value) for value in held)


def _values_unread(roots: list, targets: set) -> bool:
    """Whether no node on a path from `roots` to a node of `targets` (the targets excluded) keeps a tensor: then
    the backward of `roots` reads no value the targets produced, only their gradients flow."""
    reaches: dict = {}
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in reaches and not expanded:
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            if not expanded:
                reaches[node] = False  # on the stack; a graph has no cycles
                stack.append((node, True))
                stack += [(child, False) for child in children if child not in reaches]
            else:
                reaches[node] = node in targets or any(reaches.get(child, False) for child in children)
    return not any(reached and node not in targets and _saves_tensors(node) for node, reached in reaches.items())


class DeferredRecompute:
    """What `deferred_recompute` gives: `check(outputs)` after the recompute, before its backward."""

    def __init__(self, mlps: list[TiledMLP]) -> None:
        self.mlps = mlps

    def check(self, outputs: Any) -> None:
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        roots = [o.grad_fn for o in outputs if torch.is_tensor(o) and o.grad_fn is not None]
        for mlp in self.mlps:
            made, mlp.outputs = mlp.outputs, []
            if not made:
                continue
            unread = _values_unread(roots, {node for node, _ in made})
            if any(deferred for _, deferred in made) and not unread:
                raise RuntimeError(
                    f"tiled_mlp: the recompute of a checkpointed layer skipped {type(mlp.module).__name__}'s forward"
                    " because its output values were read by no backward on an earlier step; on this step something"
                    " keeps them (the layer's graph changed between steps). Its gradients would be wrong, so the step"
                    " stops here. Report this model; until then switch tiled_mlp off for it.")
            mlp.deferrable = unread


@contextlib.contextmanager
def deferred_recompute(mlps: list[TiledMLP]) -> Iterator[DeferredRecompute]:
    """Around the recompute of a checkpointed layer whose outputs only carry gradients back: the layer's tiled MLPs
    skip their forward where that is known to be exact. Call `check(outputs)` on what the recompute returned."""
    for mlp in mlps:
        mlp.recomputing, mlp.defer, mlp.outputs = True, mlp.leave_out_of_recompute, []
    try:
        yield DeferredRecompute(mlps)
    finally:
        for mlp in mlps:
            mlp.recomputing = mlp.defer = False


def tiled_mlps(module: nn.Module) -> list[TiledMLP]:
    """The tiled MLPs inside `module` (a decoder layer)."""
    return [m.__dict__["forward"] for m in module.modules() if isinstance(m.__dict__.get("forward"), TiledMLP)]


def tile_mlp(mlp: nn.Module, tile_tokens: int) -> Callable[[], None]:
    """Make `mlp(x)` (x: `[..., seq, hidden]`) run tiled; return the callable that undoes it.

    Under ZeRO-3 the MLP is marked a DeepSpeed "leaf" module, so that all of its parameters are gathered once
    around its forward and its backward (its children get no hooks of their own). This must happen before
    `deepspeed.initialize`, and it is *not* undone by the returned callable: the hooks were registered for a leaf,
    and a leaf is still gathered correctly when it runs untiled.
    """
    if tile_tokens < 1:
        raise ValueError(f"mlp_tile_tokens must be a positive number of tokens, got {tile_tokens}")
    deepspeed_private.mark_z3_leaf(mlp)
    mlp.forward = TiledMLP(mlp, mlp.forward, tile_tokens)

    def restore() -> None:
        mlp.__dict__.pop("forward", None)

    return restore
