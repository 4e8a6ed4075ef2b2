"""SP 1: Hugging Face's own sdpa attention against the strategy's attention function (no exchange), same model.

Since the strategy switches models to its attention at SP 1 too (packed documents kept apart at every SP size),
this measures what that costs: forward + backward of a Llama with the 8B shape's layer widths (fewer layers), bf16,
batch 1, for each sequence length, plain model vs prepared model (batch rows published by the sharder, loss
swapped), both under the same SDPA kernel priority. Prints one JSON line per (length, variant).

    python benchmarks/sp1_attention.py --lengths 8192 32768 --layers 2 --kernel cudnn
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses.attention.backends import sdpa_priority
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import prepare_hf_model
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss


def time_steps(model, make_batch, steps: int, warmup: int) -> list[float]:
    times = []
    for index in range(warmup + steps):
        batch = make_batch()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**batch).loss.backward()
        end.record()
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(start.elapsed_time(end) / 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kernel", default="cudnn", help="SDPA kernel tried first in both variants ('' for torch's order)")
    args = parser.parse_args()
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         num_hidden_layers=args.layers, vocab_size=128256, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    plain.config._attn_implementation = "sdpa"
    prepared = copy.deepcopy(plain)
    slot = BatchRowsSlot()
    prepare_hf_model(prepared, None, SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot), batch_rows=slot)
    sharder = SequenceSharder(1, 0, batch_rows=slot)
    priority = (args.kernel,) if args.kernel else None
    for length in args.lengths:
        tokens = torch.randint(0, config.vocab_size, (1, length), device="cuda")
        variants = {
            "hf_sdpa": (plain, lambda: {"input_ids": tokens, "labels": tokens}),
            "strategy_sp1": (prepared, lambda: sharder({"input_ids": tokens, "labels": tokens})),
        }
        # A, B, B, A: neither variant always runs first (clocks, allocator warm-up).
        for name in [*variants, *reversed(variants)]:
            model, make_batch = variants[name]
            with sdpa_priority(priority):
                times = time_steps(model, make_batch, args.steps, args.warmup)
            model.zero_grad(set_to_none=True)
            print(json.dumps({"length": length, "variant": name, "layers": args.layers, "kernel": args.kernel,
                              "median_s": statistics.median(times), "min_s": min(times), "times": times,
                              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
