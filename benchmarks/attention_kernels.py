"""SDPA kernels on one GPU: causal attention forward and forward+backward time per backend (flash, cuDNN,
memory-efficient) for the Llama 3 8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16).

    python benchmarks/attention_kernels.py --seq 32768 131072 > kernels.jsonl

TFLOP/s use the issue's causal convention: forward 2·S²·H·D, forward+backward 6·S²·H·D (per layer, H query heads).
GQA is passed as `enable_gqa=True`; a backend that refuses it is measured on K/V repeated to 32 heads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from lightning_ulysses.attention.backends import SDPA_KERNELS  # noqa: E402

# each kernel alone (an exclusive choice, not a priority), by the names sdpa_kernel_priority takes
BACKENDS = {name: getattr(SDPBackend, SDPA_KERNELS[name]) for name in ("flash", "cudnn", "efficient")}


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    for seq in args.seq:
        generator = torch.Generator(device="cuda").manual_seed(seq)

        def tensor(heads):
            return torch.randn(1, heads, seq, args.head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=generator).requires_grad_()

        q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
        grad = torch.randn(1, args.heads, seq, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        forward_flops = 2 * seq * seq * args.heads * args.head_dim
        for name in args.backends:
            record = {"seq": seq, "backend": name, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
            for gqa in (True, False):
                kk, vv = (k, v) if gqa else (k.repeat_interleave(args.heads // args.kv_heads, 1).detach().requires_grad_(),
                                             v.repeat_interleave(args.heads // args.kv_heads, 1).detach().requires_grad_())

                def forward():
                    with sdpa_kernel(BACKENDS[name]):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

                def forward_backward():
                    out = forward()
                    torch.autograd.grad(out, (q, kk, vv), grad)

                try:
                    with torch.no_grad():
                        t_forward = timed(forward, 2, args.iters)
                    t_both = timed(forward_backward, 2, args.iters)
                except RuntimeError as error:
                    record[f"error_gqa_{gqa}"] = str(error).splitlines()[0][:160]
                    continue
                record.update(gqa=gqa, forward_s=t_forward, forward_backward_s=t_both,
                              forward_tflops=forward_flops / t_forward / 1e12,
                              forward_backward_tflops=3 * forward_flops / t_both / 1e12)
                break
            print(json.dumps(record), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
