"""Low-memory RMSNorm: Hugging Face's Llama-style RMSNorm, keeping only its 16-bit input for backward.

Hugging Face's `LlamaRMSNorm` (and its many copies: `MistralRMSNorm`, `Qwen2RMSNorm`, ...) computes

    weight * (x.to(float32) * rsqrt(mean(x.to(float32)²) + eps)).to(x.dtype)

op by op, so autograd keeps the fp32 copy of `x` (4 bytes × hidden per token) besides the 16-bit normalised
values: with two norms per layer that is ~11 GiB of one layer's recompute + backward at 360K tokens of Llama 3 8B.
`_LowMemoryRMSNorm` runs the same ops in the same order and dtypes (16-bit outputs are bit-identical) but keeps
only `x` in its own dtype and the fp32 reciprocal RMS (one value per token); backward recomputes the normalised
values from them and follows the chain rule of Hugging Face's op sequence step by step.

Which norms are Llama-style is decided by behaviour, not by a list of class names: a module is patched only if it
has a 1-D `weight` parameter (and no other parameter, buffer or child), a number `variance_epsilon`, a forward of
one argument, and that forward gives bit-identical outputs to ours on a probe with random weights in fp32, bf16 and
bf16 input with fp32 weights. The probe runs the module's class forward on a stand-in that carries the module's
attributes and its own random weight, so the module's weight is never read: under ZeRO-3 it may be a partitioned,
empty parameter at this point (it is gathered as usual when the norm runs). Gemma's norm (`x * (1 + weight)`,
rounded after the multiply) fails the probe and is refused. Any module that looks like an RMSNorm (a class name
containing `RMSNorm`, or a `variance_epsilon` attribute) and fails is refused with an error: leaving it unpatched
would break the memory plan silently. `torch.nn.RMSNorm` and `nn.LayerNorm` are not touched: their kernels
already keep the input and per-token statistics only (the native GPT's `nn.LayerNorm` keeps its 16-bit input,
weight, bias and fp32 mean and rstd per token), so the option is a no-op for the native GPT.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
from torch import nn

from lightning_ulysses.memory.fused import call_compiled


def _forward_body(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's op sequence; also returns the fp32 rstd `[..., 1]` the backward recomputes from."""
    input_dtype = hidden_states.dtype
    upcast = hidden_states.to(torch.float32)
    rstd = torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (upcast * rstd).to(input_dtype), rstd


def _backward_body(grad_output: torch.Tensor, hidden_states: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor,
                   needs_input_grad: bool, needs_weight_grad: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    input_dtype = hidden_states.dtype
    upcast = hidden_states.to(torch.float32)  # a transient: it lives only in this backward
    grad_weight = None
    if needs_weight_grad:
        normalized = (upcast * rstd).to(input_dtype)  # bit-identical to the forward's
        # As autograd does for `weight * normalized`: the product in the promoted dtype, summed to weight's shape.
        grad_weight = (grad_output * normalized).sum_to_size(weight.shape).to(weight.dtype)
        del normalized
    if not needs_input_grad:
        return None, grad_weight
    # Hugging Face's op sequence differentiated step by step (rounding included): the cast back to the input
    # dtype, `upcast * rstd`, `rsqrt(variance + eps)`, `mean(-1)` and `pow(2)`.
    grad_normalized = (grad_output * weight).to(input_dtype).to(torch.float32)
    grad_rstd = (grad_normalized * upcast).sum(-1, keepdim=True)
    grad_upcast = grad_normalized.mul_(rstd)  # in place: grad_normalized is not needed any more
    grad_variance = -0.5 * grad_rstd * rstd.pow(3)
    grad_squares = grad_variance / upcast.size(-1)  # one value per token: mean's backward, before broadcasting
    grad_upcast.add_((2.0 * upcast).mul_(grad_squares))
    return grad_upcast.to(input_dtype), grad_weight


def _run(body: Callable, fused_backend: Optional[str], *args):
    return body(*args) if fused_backend is None else call_compiled(body, fused_backend, *args)


class _LowMemoryRMSNorm(torch.autograd.Function):
    """Llama's RMSNorm saving `(x, rstd, weight)`; `x` in its own dtype, `rstd` fp32 `[..., 1]`. With a
    `fused_backend` (`fused_elementwise`) both bodies run `torch.compile`d: what is saved stays the same."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, weight: torch.Tensor, eps: float,
                fused_backend: Optional[str] = None) -> torch.Tensor:
        output, rstd = _run(_forward_body, fused_backend, hidden_states, weight, eps)
        ctx.save_for_backward(hidden_states, rstd, weight)
        ctx.fused_backend = fused_backend
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden_states, rstd, weight = ctx.saved_tensors
        grad_input, grad_weight = _run(_backward_body, ctx.fused_backend, grad_output, hidden_states, rstd, weight,
                                       ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_input, grad_weight, None, None


def low_memory_rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float,
                        fused_backend: Optional[str] = None) -> torch.Tensor:
    """`LlamaRMSNorm`'s forward as a function, keeping only `hidden_states` and an fp32 rstd per token."""
    return _LowMemoryRMSNorm.apply(hidden_states, weight, eps, fused_backend)


def _low_memory_forward(norm: nn.Module, fused_backend: Optional[str], hidden_states: torch.Tensor) -> torch.Tensor:
    return low_memory_rms_norm(hidden_states, norm.weight, norm.variance_epsilon, fused_backend)


def _looks_like_rms_norm(module: nn.Module) -> bool:
    if isinstance(module, nn.RMSNorm):  # PyTorch's own: a kernel that keeps input and rstd already
        return False
    return "rmsnorm" in type(module).__name__.lower() or hasattr(module, "variance_epsilon")


# (input dtype, weight dtype): fp32 training, 16-bit training (DeepSpeed casts the weights), 16-bit input with
# fp32 weights (output promoted to fp32).
_PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))


def _probe(norm: nn.Module) -> Optional[str]:
    """Why the class forward of `norm` differs from ours on random inputs and weights; None if it is identical."""
    generator = torch.Generator().manual_seed(0)  # a private generator: the global RNG stream is left alone
    hidden_size = 16
    for input_dtype, weight_dtype in _PROBE_DTYPES:
        stand_in = nn.Module.__new__(type(norm))  # the class's methods, none of its parameters
        nn.Module.__init__(stand_in)
        stand_in.__dict__.update({k: v for k, v in norm.__dict__.items() if not k.startswith("_")})
        weight = torch.randn(hidden_size, generator=generator).to(weight_dtype)
        stand_in.weight = weight  # a plain tensor attribute: nothing to register, gather or partition
        hidden_states = (3 * torch.randn(2, 3, hidden_size, generator=generator)).to(input_dtype)
        with torch.no_grad():
            try:
                expected = type(norm).forward(stand_in, hidden_states)
            except Exception as error:  # it reads something besides weight and its attributes
                return f"its forward failed on a probe ({type(error).__name__}: {error})"
            ours = low_memory_rms_norm(hidden_states, weight, norm.variance_epsilon)
        if not (isinstance(expected, torch.Tensor) and expected.dtype == ours.dtype and torch.equal(expected, ours)):
            return (f"its forward computes something else than Llama's `weight * normalized(x).to(x.dtype)` (probe"
                    f" with {input_dtype} input and {weight_dtype} weight)")
    return None


def _why_not_llama_style(norm: nn.Module) -> Optional[str]:
    if "forward" in norm.__dict__:
        return "its forward is already replaced on the instance (another patch or hook wrapper)"
    weight = dict(norm.named_parameters(recurse=False)).get("weight")
    if not isinstance(weight, nn.Parameter) or len(getattr(weight, "ds_shape", weight.shape)) != 1:
        return "it has no 1-D `weight` parameter"
    extra = [name for name, _ in norm.named_parameters() if name != "weight"]
    extra += [name for name, _ in norm.named_buffers()] + [name for name, _ in norm.named_children()]
    if extra:
        return f"it holds more than a weight ({', '.join(extra)})"
    eps = getattr(norm, "variance_epsilon", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "it has no number `variance_epsilon`"
    if len(inspect.signature(type(norm).forward).parameters) != 2:
        return "its forward takes other arguments than the hidden states"
    return _probe(norm)


def llama_style_norms(model: nn.Module, options: tuple[str, ...] = ("low_memory_norms",)) -> list[nn.Module]:
    """The Llama-style RMSNorms of `model` (see the module docstring); raises if an RMSNorm-like module is not one,
    naming the memory `options` that replace them (to switch off).

    Reads no weight values and changes nothing.
    """
    norms = []
    for name, module in model.named_modules():
        if not _looks_like_rms_norm(module):
            continue
        reason = _why_not_llama_style(module)
        if reason is not None:
            named = " and ".join(options)
            raise ValueError(
                f"{named} replace{'s' if len(options) == 1 else ''} Llama-style RMSNorms (`weight *"
                f" normalized(x).to(x.dtype)`), but {name or 'the model'} ({type(module).__name__}) is not one:"
                f" {reason}. Switch {named} off for this model (MemoryOptions("
                + ", ".join(f"{option}=False" for option in options) + "); recipes: "
                + ", ".join(f"strategy.memory.{option}=false" for option in options) + ")."
            )
        norms.append(module)
    return norms


def use_low_memory_norm(norm: nn.Module, fused_backend: Optional[str] = None) -> Callable[[], None]:
    """Make a Llama-style RMSNorm (checked by `llama_style_norms`) keep only its input; return the undo.
    `fused_backend`: run it `torch.compile`d with that backend (`fused_elementwise`)."""
    norm.forward = functools.partial(_low_memory_forward, norm, fused_backend)
    return functools.partial(norm.__dict__.pop, "forward", None)
