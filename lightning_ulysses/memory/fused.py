"""Fused elementwise kernels: each decoder layer's RMSNorms and gated-MLP activation through `torch.compile`.

Eager Hugging Face Llama runs its RMSNorm as ~7 kernels (cast, pow, mean, rsqrt, mul, cast, mul) and the SwiGLU
gate `act(gate) * up` as 2, keeping 3 `[tokens, intermediate]` tensors for backward (gate, act(gate), up).
`fused_elementwise` runs both through compiled *pure functions* with every tensor, weights included, passed at
call time: a compiled module would trace ZeRO-3's parameter-gathering hooks, and a partitioned parameter is an
empty `[0]` tensor between calls. The modules still run their own `__call__` (DeepSpeed gathers their weights as
usual); only what happens between the projections is compiled.

- RMSNorms: the Llama-style norms `low_memory_norms` recognises (`norms.llama_style_norms`, which refuses the
  others); with `low_memory_norms` too, the low-memory norm's own forward and backward bodies are compiled, so it
  still keeps only its 16-bit input and an fp32 rstd per token.
- Gated MLPs: a module with `gate_proj`, `up_proj`, `down_proj` and a parameter-free `act_fn` whose class forward is
  `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with `act_fn` one of SiLU, GELU (erf or tanh) or ReLU, both checked
  on a probe (random stand-in projections from a private generator: no weight of the model is read). The projections
  are left as they are (LoRA adapters included); inside `tiled_mlp` each tile runs the fused gate.
- RoPE is left out: transformers 5 Llama-style attention calls the module-level `apply_rotary_pos_emb` of its
  modeling file directly (`use_kernelized_func` is a no-op without the `kernels` package), so replacing it would
  mean rebinding transformers' module globals, for every model of the family in the process.

Shapes: every dimension but the last (hidden or intermediate size) is marked dynamic, so the short last tile of a
tiled MLP and sequences of other lengths reuse the compiled code (size 1 is specialised once). Exactness: the
compiled code computes the same ops; in fp32 reductions may be ordered differently (~1e-7 relative), in 16-bit the
fused kernels round once where eager rounds after each op (within 16-bit rounding).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.fences import _torch_private as torch_private

# The activations a gated MLP may use, as the functions the compiled gate calls. Recognised by output, not by class.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: `weight * normalized(x.float()).to(x.dtype)`, the op sequence of `LlamaRMSNorm.forward`."""
    upcast = hidden_states.to(torch.float32)
    return weight * (upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)).to(hidden_states.dtype)


def gated_activation(activation: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`act(gate) * up`, the gated MLP's elementwise part."""
    return _ACTIVATIONS[activation](gate) * up


def check_backend(backend: str) -> None:
    """Refuse a `torch.compile` backend name that does not exist (before anything changes)."""
    try:
        torch_private.lookup_compile_backend(backend)
    except Exception as error:
        raise ValueError(f"fused_backend={backend!r} is not a torch.compile backend ({error}); use 'inductor' (the"
                         " default), or switch fused_elementwise off (MemoryOptions(fused_elementwise=False); recipes:"
                         " strategy.memory.fused_elementwise=false).") from error


@functools.cache
def compiled(function: Callable, backend: str) -> Callable:
    """`function` compiled once per backend for the whole process (dynamo's cache is per function anyway)."""
    return torch.compile(function, backend=backend)  # automatic dynamic shapes, besides the marked dimensions


def call_compiled(function: Callable, backend: str, *args):
    """Call the compiled `function` with every tensor's leading dimensions (batch, tokens) marked dynamic."""
    if not torch.compiler.is_compiling():  # inside a user's compiled model dynamo inlines the plain function
        for tensor in args:
            if torch.is_tensor(tensor) and tensor.dim() > 1:
                for dim in range(tensor.dim() - 1):
                    torch_private.maybe_mark_dynamic(tensor, dim)
    return compiled(function, backend)(*args)


# --- RMSNorm --------------------------------------------------------------------------------------------------------


def _fused_norm_forward(norm: nn.Module, backend: str, hidden_states: torch.Tensor) -> torch.Tensor:
    return call_compiled(rms_norm, backend, hidden_states, norm.weight, norm.variance_epsilon)


def use_fused_norm(norm: nn.Module, backend: str) -> Callable[[], None]:
    """Make a Llama-style RMSNorm (checked by `norms.llama_style_norms`) run compiled; return the undo."""
    norm.forward = functools.partial(_fused_norm_forward, norm, backend)
    return functools.partial(norm.__dict__.pop, "forward", None)


# --- gated MLP ------------------------------------------------------------------------------------------------------

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _activation_name(act_fn: nn.Module) -> Optional[str]:
    """Which of `_ACTIVATIONS` the module computes, bit for bit on a probe in fp32 and bf16; None if none."""
    generator = torch.Generator().manual_seed(0)
    probe = 4 * torch.randn(64, generator=generator)
    for name, function in _ACTIVATIONS.items():
        with torch.no_grad():
            try:
                same = all(torch.equal(act_fn(probe.to(dtype)), function(probe.to(dtype)))
                           for dtype in (torch.float32, torch.bfloat16))
            except Exception:  # noqa: BLE001 - an activation that cannot take a plain tensor is not one of ours
                return None
        if same:
            return name
    return None


def _probe_mlp(mlp: nn.Module, activation: str) -> bool:
    """Whether the class forward of `mlp` is `down(act(gate(x)) * up(x))`, on stand-in projections."""
    generator = torch.Generator().manual_seed(0)
    stand_in = nn.Module.__new__(type(mlp))  # the class's methods, none of its parameters
    nn.Module.__init__(stand_in)
    stand_in.__dict__.update({k: v for k, v in mlp.__dict__.items() if not k.startswith("_")})
    stand_in.act_fn = mlp.act_fn
    hidden, intermediate = 8, 12
    for name, (fan_in, fan_out) in zip(_PROJECTIONS, ((hidden, intermediate),) * 2 + ((intermediate, hidden),)):
        linear = nn.Linear(fan_in, fan_out, bias=False)
        linear.weight.data = torch.randn(fan_out, fan_in, generator=generator)
        setattr(stand_in, name, linear)
    x = torch.randn(2, 3, hidden, generator=generator)
    with torch.no_grad():
        try:
            expected = type(mlp).forward(stand_in, x)
        except Exception:  # noqa: BLE001 - it reads something a gated MLP does not
            return False
        ours = _gated_mlp_forward(stand_in, activation, None, x)
    return isinstance(expected, torch.Tensor) and torch.equal(expected, ours)


def gated_mlp_activation(mlp: nn.Module) -> Optional[str]:
    """The activation of a gated MLP `fused_elementwise` can fuse (see the module docstring); None if it is not one.

    Reads no weight values and changes nothing.
    """
    if "forward" in mlp.__dict__ or not all(isinstance(getattr(mlp, name, None), nn.Module) for name in _PROJECTIONS):
        return None
    act_fn = getattr(mlp, "act_fn", None)
    if not isinstance(act_fn, nn.Module) or any(True for _ in act_fn.parameters()):
        return None
    activation = _activation_name(act_fn)
    return activation if activation is not None and _probe_mlp(mlp, activation) else None


def _gated_mlp_forward(mlp: nn.Module, activation: str, backend: Optional[str], x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if backend is None:  # the eager reference the probe compares the class forward with
        return mlp.down_proj(gated_activation(activation, gate, up))
    return mlp.down_proj(call_compiled(gated_activation, backend, activation, gate, up))


def use_fused_gated_mlp(mlp: nn.Module, activation: str, backend: str) -> Callable[[], None]:
    """Make a gated MLP (checked by `gated_mlp_activation`) run its `act(gate) * up` compiled; return the undo."""
    mlp.forward = functools.partial(_gated_mlp_forward, mlp, activation, backend)
    return functools.partial(mlp.__dict__.pop, "forward", None)
