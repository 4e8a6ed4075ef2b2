"""SP 1 on one GPU: a hybrid (Qwen3-Next-like) and a sliding-window (Mistral-like) model, prepared by the strategy's
`prepare_hf_model` against the same model unprepared (plain Hugging Face), forward + backward, bf16, batch 1.

The target: the models whose token mixers the strategy now runs under SP (Gated DeltaNet layers on whole rows,
windows applied after the exchange) to cost nothing where no sequence is cut: tokens/s at least 0.97x plain HF's.
Prints one JSON line per (family, length, variant), blocks in A B B A order.

`strategy_sp1_memory` is the prepared model with the memory engine's features on (`--memory`, the feature names of
`lightning_ulysses.planning.plan.memory_options`; applied as `UlyssesDeepSpeedStrategy(memory=...)` applies them, undone after
its blocks): what the strategy runs where plain HF runs out of memory. Only the model of the block in flight is on
the GPU. A variant that ran out of memory is not run again (at this or a longer length), and where one did, the
repeated blocks of that length are left out (no ratio to protect).

    python benchmarks/token_mixers_sp1.py --family mistral --lengths 32768 131072
    python benchmarks/token_mixers_sp1.py --family qwen3_next --lengths 32768 131072 --steps 3
    python benchmarks/token_mixers_sp1.py --family mistral --attn flex_attention --lengths 131072 262144 \
        --variants hf strategy_sp1_memory --memory ac+mlp+logits
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
import transformers

from benchmarks.sp1_attention import time_steps
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import prepare_hf_model
from lightning_ulysses.memory import apply_memory_options
from lightning_ulysses.planning.plan import memory_options
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss

VARIANTS = ("hf", "strategy_sp1", "strategy_sp1_memory")


def config_for(family: str, layers: int):
    if family == "mistral":  # Mistral-7B's layer widths, its 4096-token sliding window
        return transformers.MistralConfig(
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            num_hidden_layers=layers, vocab_size=32768, sliding_window=4096, max_position_embeddings=1 << 20)
    # Qwen3-Next-80B-A3B's layer widths (3 Gated-DeltaNet layers per full-attention layer); fewer experts (64 of 512,
    # 8 routed of 10) so that the layers fit one GPU beside 128K-token activations
    return transformers.Qwen3NextConfig(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        intermediate_size=5120, num_hidden_layers=layers, vocab_size=151936, max_position_embeddings=1 << 20,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))


def run_block(model, make_batch, length: int, args, restores=()) -> dict:
    """One variant's block: its model alone on the GPU, `restores` (memory features) undone afterwards."""
    model.to(args.device)
    torch.cuda.reset_peak_memory_stats()
    try:
        times = time_steps(model, make_batch, args.steps, args.warmup)
        median = statistics.median(times)
        record = {"median_s": median, "tokens_per_s": length / median, "times": times}
    except torch.OutOfMemoryError as error:
        record = {"oom": True, "error": str(error).splitlines()[0][:160]}
    finally:
        for restore in reversed(restores):
            restore()
    model.zero_grad(set_to_none=True)
    record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    model.to("cpu")
    torch.cuda.empty_cache()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["mistral", "qwen3_next"], required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["hf", "strategy_sp1"])
    parser.add_argument("--memory", default="ac+mlp+logits", help="strategy_sp1_memory's features (plan.memory_options)")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention"], help="both variants' attention")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # smoke runs of the logic on CPU
    args = parser.parse_args()
    config = config_for(args.family, args.layers)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
    plain = plain.to(torch.bfloat16).train()
    plain.config.use_cache = False
    prepared = copy.deepcopy(plain)
    slot = BatchRowsSlot()
    prepare_hf_model(prepared, None, SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot), batch_rows=slot)
    sharder = SequenceSharder(1, 0, batch_rows=slot)
    options = memory_options(args.memory)
    out_of_memory: set[str] = set()
    for length in args.lengths:
        tokens = torch.randint(0, config.vocab_size, (1, length), device=args.device)
        variants = {
            "hf": (plain, lambda: {"input_ids": tokens, "labels": tokens}),
            "strategy_sp1": (prepared, lambda: sharder({"input_ids": tokens, "labels": tokens})),
            "strategy_sp1_memory": (prepared, lambda: sharder({"input_ids": tokens, "labels": tokens})),
        }
        order = [*args.variants, *reversed(args.variants)]
        for block, name in enumerate(order):
            if name in out_of_memory or (block >= len(args.variants) and out_of_memory):
                continue
            model, make_batch = variants[name]
            restores = apply_memory_options(model, options) if name == "strategy_sp1_memory" else []
            record = run_block(model, make_batch, length, args, restores)
            if record.get("oom"):
                out_of_memory.add(name)
            print(json.dumps({"family": args.family, "length": length, "variant": name, "layers": args.layers,
                              "attn": args.attn, "memory": args.memory if name == "strategy_sp1_memory" else None,
                              **record}), flush=True)


if __name__ == "__main__":
    main()
