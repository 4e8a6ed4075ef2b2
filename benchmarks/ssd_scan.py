"""Mamba2's chunked scan (SSD) alone, forward + backward: transformers' PyTorch fallback against ours
(`lightning_ulysses.mixers.ssd`, blockwise: keeps its inputs and a state per block, recomputes a block at a time in
backward), at Nemotron-H-8B's widths (128 heads of 64 channels, state 128, 8 groups of B and C, chunks of 128 tokens),
bf16 inputs, batch 1, in A B B A order per length. Why: the fallback leaves autograd about 1 MB per token per layer
(docs/internals.md), which caps a Nemotron-H-like model at ~100K tokens on one H200.

Prints one JSON line per (length, variant): mean seconds of forward + backward, the bytes autograd keeps for backward
per token, and on a GPU the peak GiB (forward + backward); a variant slower than `--give-up` seconds, or out of
memory, at one length is not run at longer ones.

    python benchmarks/ssd_scan.py --lengths 8192 32768 65536 131072 262144     # one GPU
    python benchmarks/ssd_scan.py --tiny                                        # CPU, tiny widths: the plumbing
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers.models.mamba2 import modeling_mamba2

from lightning_ulysses.mixers.ssd import mamba2_chunk_scan

VARIANTS = {"transformers_fallback": modeling_mamba2.mamba2_chunk_scan, "ours": mamba2_chunk_scan}
WIDTHS = {"heads": 128, "head_dim": 64, "state": 128, "groups": 8, "chunk": 128}  # Nemotron-H-8B
TINY = {"heads": 8, "head_dim": 16, "state": 16, "groups": 2, "chunk": 32}


def inputs(length: int, device: str, heads: int, head_dim: int, state: int, groups: int, chunk: int) -> dict:
    def make(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    return dict(hidden_states=make(1, length, heads, head_dim), dt=make(1, length, heads),
                A=(-torch.rand(heads, device=device) - 0.5).requires_grad_(),  # -exp(A_log), fp32 as the model's
                B=make(1, length, groups, state), C=make(1, length, groups, state),
                D=make(heads, dtype=torch.float32), dt_bias=make(heads, dtype=torch.float32), chunk_size=chunk)


def step(function, arguments: dict) -> tuple[float, float]:
    """(seconds of forward + backward, bytes autograd kept for backward: each storage once, the inputs left out)."""
    given = {t.untyped_storage().data_ptr() for t in arguments.values() if torch.is_tensor(t)}
    kept = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in given:
            kept[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    cuda = arguments["A"].is_cuda
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = function(**arguments, dt_softplus=True)
    output.float().square().mean().backward()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(kept.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--give-up", type=float, default=60.0)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny widths, short rows")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    widths = TINY if args.tiny else WIDTHS
    lengths = args.lengths or ([1024, 4096] if args.tiny else [8192, 32768, 65536, 131072])
    given_up = set()
    for length in lengths:
        torch.manual_seed(0)
        arguments = inputs(length, device, **widths)
        times = {name: [] for name in VARIANTS}
        peaks, kept = {}, {}
        order = [name for name in VARIANTS if name not in given_up]
        for name in order + order[::-1]:  # A B B A
            if name in given_up:
                continue
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                step(VARIANTS[name], arguments)  # warm-up (and the first allocation)
                for _ in range(args.steps):
                    seconds, kept[name] = step(VARIANTS[name], arguments)
                    times[name].append(seconds)
            except torch.OutOfMemoryError:
                given_up.add(name)
                print(json.dumps({"length": length, "variant": name, "error": "out of memory"}), flush=True)
                continue
            finally:
                for tensor in arguments.values():
                    if torch.is_tensor(tensor):
                        tensor.grad = None
            if device == "cuda":
                peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        for name in order:
            if times[name]:
                seconds = statistics.mean(times[name])
                print(json.dumps({"length": length, "variant": name, "seconds": round(seconds, 4),
                                  "tokens_per_s": round(length / seconds),
                                  "kept_bytes_per_token": round(kept[name] / length, 1),
                                  "peak_gib": round(peaks[name], 2) if name in peaks else None}), flush=True)
                if seconds > args.give_up:
                    given_up.add(name)


if __name__ == "__main__":
    main()
