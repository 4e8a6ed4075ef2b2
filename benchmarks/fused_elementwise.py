"""Eager against `fused_elementwise` for one decoder layer's elementwise parts (2 RMSNorms, the SwiGLU gate), forward
+ backward, in isolation: what the option can save per layer before a whole step is measured. One JSON line per part.

    python benchmarks/fused_elementwise.py --shape 8b --tokens 32768            # CUDA, bf16, inductor
    python benchmarks/fused_elementwise.py --shape 8b --tokens 256 --device cpu --dtype float32   # a smoke run

Timing: synchronised wall time of `--iterations` forward + backward calls after `--warmup` (which compiles), the
median of `--repeats`; also the largest difference against eager (forward output and input gradient).
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

from lightning_ulysses.memory.fused import call_compiled, gated_activation, rms_norm  # noqa: E402
from lightning_ulysses.memory.norms import low_memory_rms_norm  # noqa: E402

EPS = 1e-5


def parts(backend: str) -> dict:
    """name: (eager, fused, which input sizes: "hidden" or "intermediate", how many such inputs, with a weight)"""
    return {
        "rms_norm": (lambda x, w: rms_norm(x, w, EPS), lambda x, w: call_compiled(rms_norm, backend, x, w, EPS),
                     "hidden", 1, True),
        "low_memory_rms_norm": (lambda x, w: low_memory_rms_norm(x, w, EPS),
                                lambda x, w: low_memory_rms_norm(x, w, EPS, backend), "hidden", 1, True),
        "silu_gate": (lambda g, u: gated_activation("silu", g, u),
                      lambda g, u: call_compiled(gated_activation, backend, "silu", g, u), "intermediate", 2, False),
    }


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
    args = parser.parse_args()
    dtype, shape = getattr(torch, args.dtype), SHAPES[args.shape]
    sizes = {"hidden": shape["hidden_size"], "intermediate": shape["intermediate_size"]}
    for name, (eager, fused, size, count, weighted) in parts(args.backend).items():
        inputs = [torch.randn(1, args.tokens, sizes[size], device=args.device, dtype=dtype) for _ in range(count)]
        if weighted:
            inputs.append(1 + 0.1 * torch.randn(sizes[size], device=args.device, dtype=dtype))
        inputs = [t.requires_grad_() for t in inputs]
        grad = torch.randn(1, args.tokens, sizes[size], device=args.device, dtype=dtype)
        eager_s, fused_s = _seconds(eager, inputs, grad, args), _seconds(fused, inputs, grad, args)
        differences = []
        for function in (eager, fused):
            for t in inputs:
                t.grad = None
            output = function(*inputs)
            output.backward(grad)
            differences.append((output.detach().float(), inputs[0].grad.float()))
        (out_e, grad_e), (out_f, grad_f) = differences
        print(json.dumps({"part": name, "shape": args.shape, "tokens": args.tokens, "dtype": args.dtype,
                          "backend": args.backend, "eager_ms": 1e3 * eager_s, "fused_ms": 1e3 * fused_s,
                          "speedup": eager_s / fused_s, "max_abs_diff_output": (out_f - out_e).abs().max().item(),
                          "max_abs_diff_input_grad": (grad_f - grad_e).abs().max().item()}), flush=True)


if __name__ == "__main__":
    main()
