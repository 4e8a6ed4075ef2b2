"""Time to first token and peak memory of a long-prompt prefill: plain Hugging Face against
`lightning_ulysses.integration.inference.generate` (sequence-parallel prefill; SP = the number of processes).

    python benchmarks/prefill.py --shape 1b --seq 32768 65536 131072               # one GPU: SP 1
    torchrun --nproc_per_node 2 benchmarks/prefill.py --shape 1b --seq 131072      # SP 2 (not run yet)

Both sides build the same random-init bf16 Llama with sdpa and keep only the last position's logits. One JSON
line per point; median of --repeats timed prefills after one warm-up.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses.integration import inference

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}


def measure(function, repeats, device):
    function()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="1b")
    parser.add_argument("--seq", type=int, nargs="+", default=[32768])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    world = dist.get_world_size()
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(args.seq), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16 if cuda else torch.float32).eval()
    served = inference.prepare(model, sequence_parallel_size=world)
    for seq in args.seq:
        prompt = torch.randint(0, config.vocab_size, (1, seq), device=device)
        result = {"shape": args.shape, "seq": seq, "sequence_parallel_size": world,
                  "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
        try:
            ours = measure(lambda: served.generate(prompt, max_new_tokens=1), args.repeats, device)
            result.update(ulysses_ttft_s=ours[0], ulysses_peak_gib=ours[1])
        except torch.OutOfMemoryError:
            result["ulysses_ttft_s"] = "OOM"
        torch.cuda.empty_cache() if cuda else None
        if world == 1:
            served.restore()
            try:
                def plain():
                    with torch.no_grad():
                        return model(input_ids=prompt, logits_to_keep=1, use_cache=True).logits[:, -1].argmax(-1)

                plain_result = measure(plain, args.repeats, device)
                result.update(hf_ttft_s=plain_result[0], hf_peak_gib=plain_result[1],
                              ttft_ratio=result.get("ulysses_ttft_s", float("nan")) / plain_result[0]
                              if isinstance(result.get("ulysses_ttft_s"), float) else None)
            except torch.OutOfMemoryError:
                result["hf_ttft_s"] = "OOM"
            torch.cuda.empty_cache() if cuda else None
            served = inference.prepare(model, sequence_parallel_size=1)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
