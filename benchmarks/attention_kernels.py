"""Exact causal attention kernels on one GPU: forward and forward+backward time per kernel for the Llama 3 8B
attention shape (32 query heads, 8 KV heads, head dim 128, bf16), plain rows and packed documents, in one call.

    python benchmarks/attention_kernels.py --seq 8192 32768 131072 --kernels cudnn flash flex fa4 > kernels.jsonl

Kernels: SDPA's `flash`, `cudnn`, `efficient` (each alone, not a priority); `flex` (flex attention compiled, a
causal or document block mask); `fa4` (FlashAttention's CuTe kernels, `flash_attn.cute` from the `flash-attn-4`
wheel: Hopper's wgmma + TMA path). `ours`: the project's attention backend with `sdpa_kernel_priority=("fa4",)` (FA4 through its
operator, attention/fa4.py), to check it against cuDNN on the GPU. `--packed N` also times rows packed with documents of N tokens: SDPA kernels take
no document layout without a dense mask, so only `flex` (block mask) and `fa4` (`cu_seqlens`) run those.
Each point also reports the largest difference of the output and of the query gradient from cuDNN's on the same
inputs (plain rows), so a fast kernel that is wrong shows.

TFLOP/s use the causal convention: forward 2·S²·H·D, forward+backward 6·S²·H·D (per layer, H query heads); for
packed rows the same formula on the documents' lengths.
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

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}


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


def kernel(name: str, seq: int, document: int | None):
    """`attend(q, k, v) -> out` for [1, heads, seq, dim] q and [1, kv_heads, seq, dim] k/v (GQA)."""
    if name in SDPA:
        if document:
            return None

        def attend(q, k, v):
            with sdpa_kernel(SDPA[name]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return attend
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        span = document or seq

        def causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx // span == kv_idx // span)

        block_mask = create_block_mask(causal, 1, None, seq, seq, device="cuda")
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True)
    if name == "fa4":
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        if not document:
            def attend(q, k, v):
                out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
                return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
            return attend
        cu = torch.arange(0, seq + 1, document, device="cuda", dtype=torch.int32)

        def attend(q, k, v):
            out = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                         cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=document,
                                         max_seqlen_k=document, causal=True)
            out = out[0] if isinstance(out, tuple) else out
            return out.transpose(0, 1).unsqueeze(0)
        return attend
    if name == "ours":  # the project's path: SDPA's calls under sdpa_kernel_priority=("fa4",) (attention/fa4.py)
        from lightning_ulysses.attention import backends
        from lightning_ulysses.attention.documents import DocumentMask

        documents = None
        if document:
            positions = torch.arange(seq, device="cuda").remainder(document)[None]
            documents = DocumentMask.from_rows(1, positions, None)

        def attend(q, k, v):
            with backends.sdpa_priority(("fa4",)):
                return backends.local_attention(q, k, v, "sdpa", documents).transpose(1, 2)
        return attend
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--kernels", nargs="+", default=["cudnn", "flash", "flex", "fa4"])
    parser.add_argument("--packed", type=int, default=0, help="also rows packed with documents of this many tokens")
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
        reference = None
        if "cudnn" in args.kernels:  # the baseline every kernel's numbers are compared with
            out = kernel("cudnn", seq, None)(q, k, v)
            reference = (out.detach(), torch.autograd.grad(out, q, grad)[0])
        for document in [None] + ([args.packed] if args.packed and args.packed < seq else []):
            span = document or seq
            forward_flops = 2 * span * span * args.heads * args.head_dim * (seq // span)
            for name in args.kernels:
                record = {"seq": seq, "kernel": name, "document": document, "device": torch.cuda.get_device_name(),
                          "torch": torch.__version__}
                try:
                    attend = kernel(name, seq, document)
                    if attend is None:
                        continue

                    def forward_backward():
                        torch.autograd.grad(attend(q, k, v), (q, k, v), grad)

                    with torch.no_grad():
                        t_forward = timed(lambda: attend(q, k, v), 2, args.iters)
                    t_both = timed(forward_backward, 2, args.iters)
                    if reference is not None and document is None:
                        out = attend(q, k, v)
                        dq = torch.autograd.grad(out, q, grad)[0]
                        record.update(max_out_diff_vs_cudnn=(out.float() - reference[0].float()).abs().max().item(),
                                      max_dq_diff_vs_cudnn=(dq.float() - reference[1].float()).abs().max().item())
                except Exception as error:  # one kernel failing must not lose the others' points
                    record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    print(json.dumps(record), flush=True)
                    continue
                record.update(forward_s=t_forward, forward_backward_s=t_both,
                              forward_tflops=forward_flops / t_forward / 1e12,
                              forward_backward_tflops=3 * forward_flops / t_both / 1e12)
                print(json.dumps(record), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
