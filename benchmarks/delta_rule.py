"""The gated delta rule alone, forward + backward, on one GPU: transformers' PyTorch fallback against ours
(`lightning_ulysses.mixers.delta_rule`), at Qwen3-Next-80B-A3B's widths (16 key heads / 32 value heads of dim 128),
bf16 inputs, batch 1, in A B B A order per length. Why: the fallback's backward copies the whole output's gradient
once per 64-token chunk (quadratic in length); ours joins the chunks' outputs once.

Prints one JSON line per (length, variant): mean seconds of forward + backward, peak GiB; a variant slower than
`--give-up` seconds at one length is not run at longer ones.

    python benchmarks/delta_rule.py --lengths 8192 32768 65536 131072 262144
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers.models.qwen3_next import modeling_qwen3_next

from lightning_ulysses.mixers.delta_rule import chunk_gated_delta_rule

VARIANTS = {"transformers_fallback": modeling_qwen3_next.torch_chunk_gated_delta_rule, "ours": chunk_gated_delta_rule}


def inputs(length: int, key_heads: int = 16, value_heads: int = 32, width: int = 128):
    def make(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale).requires_grad_()

    # (transformers' fallback before 5.2x takes every value head's query and key: the model repeats them first)
    query, key = make(1, length, value_heads, width), make(1, length, value_heads, width)
    value = make(1, length, value_heads, width)
    g = (-torch.rand(1, length, value_heads, device="cuda")).requires_grad_()  # log decay ≤ 0, fp32 as the model's
    beta = torch.rand(1, length, value_heads, device="cuda", dtype=torch.bfloat16).requires_grad_()
    return query, key, value, g, beta


def step(function, arguments) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    output, _ = function(*arguments, use_qk_l2norm_in_kernel=True)
    output.float().square().mean().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--give-up", type=float, default=60.0)
    parser.add_argument("--profile", type=int, default=0, help="print where ours spends its time at this length")
    args = parser.parse_args()
    if args.profile:
        arguments = inputs(args.profile)
        step(chunk_gated_delta_rule, arguments)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as profile:
            step(chunk_gated_delta_rule, arguments)
        print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    given_up = set()
    for length in args.lengths:
        torch.manual_seed(0)
        arguments = inputs(length)
        times = {name: [] for name in VARIANTS}
        peaks = {}
        order = [name for name in VARIANTS if name not in given_up]
        for name in order + order[::-1]:  # A B B A
            function = VARIANTS[name]
            torch.cuda.reset_peak_memory_stats()
            try:
                step(function, arguments)  # warm-up (and the first allocation)
                times[name] += [step(function, arguments) for _ in range(args.steps)]
            except torch.OutOfMemoryError:
                given_up.add(name)
                print(json.dumps({"length": length, "variant": name, "error": "out of memory"}), flush=True)
                continue
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            for tensor in arguments:
                tensor.grad = None
        for name in order:
            if times[name]:
                seconds = statistics.mean(times[name])
                print(json.dumps({"length": length, "variant": name, "seconds": round(seconds, 4),
                                  "tokens_per_s": round(length / seconds), "peak_gib": round(peaks[name], 2)}),
                      flush=True)
                if seconds > args.give_up:
                    given_up.add(name)


if __name__ == "__main__":
    main()
