"""Eager against `fused_elementwise` for one decoder layer's elementwise parts (2 RMSNorms, the SwiGLU gate) and
against the tiled logits + loss for the output head, forward + backward, in isolation: what the options can save
before a whole step is measured. With `--liger`, Liger Kernel's Triton kernels for the same parts in the same call
(`LigerRMSNormFunction`, `LigerSiLUMulFunction`, `LigerFusedLinearCrossEntropyFunction` with a summed loss, the form
the sequence-parallel loss needs). One JSON line per part.

    python benchmarks/fused_elementwise.py --shape 8b --tokens 32768            # CUDA, bf16, inductor
    python benchmarks/fused_elementwise.py --shape 8b --tokens 32768 --liger    # and Liger Kernel (liger-kernel)
    python benchmarks/fused_elementwise.py --shape 8b --tokens 256 --device cpu --dtype float32   # a smoke run

Timing: synchronised wall time of `--iterations` forward + backward calls after `--warmup` (which compiles), the
median of `--repeats`; also the largest difference against eager (forward output and input gradient), and against
eager in fp32 (`*_vs_fp32`), which says which of two bf16 kernels is closer to the exact result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from strategy_overhead import SHAPES  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from lightning_ulysses.memory.fused import call_compiled, gated_activation, rms_norm  # noqa: E402
from lightning_ulysses.memory.logits_loss import linear_cross_entropy_sum  # noqa: E402
from lightning_ulysses.memory.norms import low_memory_rms_norm  # noqa: E402

EPS = 1e-5


LOGITS_TILE = 4096  # MemoryOptions.logits_tile_tokens' default


def _eager_linear_cross_entropy(hidden, weight, targets):
    """The plain head + loss: whole logits, upcast, summed cross-entropy (what the tiled form must equal)."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def parts(backend: str) -> dict:
    """name: (eager, fused, which input sizes: "hidden", "intermediate" or "head" (hidden states, the output head's
    weight and targets), how many inputs of that size, with a norm weight)"""
    return {
        "rms_norm": (lambda x, w: rms_norm(x, w, EPS), lambda x, w: call_compiled(rms_norm, backend, x, w, EPS),
                     "hidden", 1, True),
        "low_memory_rms_norm": (lambda x, w: low_memory_rms_norm(x, w, EPS),
                                lambda x, w: low_memory_rms_norm(x, w, EPS, backend), "hidden", 1, True),
        "silu_gate": (lambda g, u: gated_activation("silu", g, u),
                      lambda g, u: call_compiled(gated_activation, backend, "silu", g, u), "intermediate", 2, False),
        "linear_cross_entropy": (_eager_linear_cross_entropy,
                                 lambda h, w, t: linear_cross_entropy_sum(h, w, None, t, LOGITS_TILE),
                                 "head", 1, False),
    }


def liger_parts() -> dict:
    """The same parts through Liger Kernel's autograd functions (imported only when asked: Triton, CUDA)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def linear_cross_entropy(hidden, weight, targets):
        return LigerFusedLinearCrossEntropyFunction.apply(hidden.flatten(0, 1), weight, targets.flatten(), None,
                                                          None, -100, 0.0, 0.0, "sum")[0]

    # in_place=False: the benchmark reuses its gradient tensor between calls
    return {"rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False),
            "silu_gate": lambda g, u: LigerSiLUMulFunction.apply(g, u),
            "linear_cross_entropy": linear_cross_entropy}


def _inputs(size: str, count: int, weighted: bool, shape: dict, args, dtype) -> tuple[list, torch.Tensor]:
    """The part's inputs (requiring gradients) and the gradient its output is given."""
    tokens, device = args.tokens, args.device
    if size == "head":
        hidden = torch.randn(1, tokens, shape["hidden_size"], device=device, dtype=dtype)
        weight = 0.02 * torch.randn(shape["vocab_size"], shape["hidden_size"], device=device, dtype=dtype)
        targets = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
        targets[:, ::7] = -100  # some ignored positions, as padding and masked prompts give
        return [hidden.requires_grad_(), weight.requires_grad_(), targets], torch.tensor(1.0, device=device)
    width = shape["intermediate_size"] if size == "intermediate" else shape["hidden_size"]
    inputs = [torch.randn(1, tokens, width, device=device, dtype=dtype) for _ in range(count)]
    if weighted:
        inputs.append(1 + 0.1 * torch.randn(width, device=device, dtype=dtype))
    return [t.requires_grad_() for t in inputs], torch.randn(1, tokens, width, device=device, dtype=dtype)


def _run_once(function, inputs, grad) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, first input's gradient) of one forward + backward, in fp32 for comparing."""
    for t in inputs:
        t.grad = None
    output = function(*inputs)
    output.backward(grad)
    return output.detach().float(), inputs[0].grad.float()


def _max_difference(a: tuple, b: tuple) -> tuple[float, float]:
    return tuple((x - y).abs().max().item() for x, y in zip(a, b))


def _seconds(function, inputs, grad, args) -> float:
    def run():
        for _ in range(args.iterations):
            function(*inputs).backward(grad)
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        run()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / args.iterations)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--liger", action="store_true", help="also Liger Kernel's kernels (liger-kernel, CUDA)")
    args = parser.parse_args()
    dtype, shape = getattr(torch, args.dtype), SHAPES[args.shape]
    liger = liger_parts() if args.liger else {}
    for name, (eager, fused, size, count, weighted) in parts(args.backend).items():
        inputs, grad = _inputs(size, count, weighted, shape, args, dtype)
        functions = {"eager": eager, "fused": fused, **({"liger": liger[name]} if name in liger else {})}
        times = {kind: _seconds(function, inputs, grad, args) for kind, function in functions.items()}
        results = {kind: _run_once(function, inputs, grad) for kind, function in functions.items()}
        exact_inputs = [t.detach().float().requires_grad_() if t.is_floating_point() else t for t in inputs]
        exact = _run_once(eager, exact_inputs, grad.float())
        line = {"part": name, "shape": args.shape, "tokens": args.tokens, "dtype": args.dtype, "backend": args.backend}
        for kind in functions:
            line[f"{kind}_ms"] = 1e3 * times[kind]
            if kind != "eager":
                line[f"{kind}_speedup"] = times["eager"] / times[kind]
                line[f"{kind}_max_abs_diff_output"], line[f"{kind}_max_abs_diff_input_grad"] = _max_difference(
                    results[kind], results["eager"])
            line[f"{kind}_vs_fp32_output"], line[f"{kind}_vs_fp32_input_grad"] = _max_difference(results[kind], exact)
        print(json.dumps(line), flush=True)

if __name__ == "__main__":
    main()
