"""Memory engine on one GPU: peak memory, host memory, tokens/s and MFU against the planner's prediction.

HF Llama shapes (random init, bf16, sdpa), DeepSpeed ZeRO-3 on one rank (torch AdamW, optionally a fraction of
the optimizer on the host), the memory features applied by `lightning_ulysses.memory.apply_memory_options` (what
`UlyssesDeepSpeedStrategy(memory=...)` applies before DeepSpeed wraps the model). One engine per model; features
are switched per point (every MLP is marked a ZeRO-3 leaf before DeepSpeed starts, which is valid tiled or not).

    python benchmarks/memory_engine.py --model llama3.2-1b --points 8192:none,32768:ac+logits+mlp+offload \
        --steps 3 > results.jsonl

Features per point: none, or '+'-joined ac (layer checkpointing), offload (its inputs on the host), mlp (tiled
MLP), logits (tiled logits + loss). One JSON line per point; an OOM is a line too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_ulysses.memory import apply_memory_options  # noqa: E402
from lightning_ulysses.plan import memory_options  # noqa: E402  features "ac+offload+mlp+logits+norms" or "none"
from lightning_ulysses.planner import MODELS, TrainingSetup, plan_memory  # noqa: E402

PEAK_FLOPS = 772e12  # measured bf16 matmul peak of the lent H200 (DESIGN-NOTES)
GIB = 2**30


def model_flops(shape, seq_len: int) -> float:
    """The issue's MFU numerator: 6·params·tokens + 6·layers·seq²·hidden (causal attention), no recomputation."""
    return 6 * shape.num_parameters * seq_len + 6 * shape.num_layers * seq_len**2 * shape.hidden_size


def host_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def build_engine(name: str, offload_ratio: float, sub_group_size: int):
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = MODELS[name]
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_key_value_heads,
                         max_position_embeddings=1 << 20, rope_theta=500000.0,
                         tie_word_embeddings=shape.tie_word_embeddings, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    for layer in model.model.layers:
        layer.mlp._z3_leaf = True  # see module docstring
    zero = {"stage": 3, "sub_group_size": sub_group_size, "contiguous_gradients": True, "overlap_comm": True,
            "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6}
    if offload_ratio > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True, "ratio": offload_ratio}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "zero_optimization": zero, "gradient_clipping": 1.0,
                 # torch AdamW needs no compiled op; DeepSpeed's partial offload insists on its CPU Adam (JIT-built)
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0,
                                                           "torch_adam": offload_ratio == 0}},
                 "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return shape, model, engine


def run_point(shape, model, engine, seq: int, features: str, args, offload_ratio: float) -> dict:
    options = memory_options(features, args.mlp_tile, args.logits_tile)
    predicted = plan_memory(shape, TrainingSetup(seq_len=seq, memory=options, offload_optimizer=offload_ratio,
                                                 sub_group_size=args.sub_group_size))
    record = {"model": args.model, "seq": seq, "features": features, "offload_optimizer": offload_ratio,
              "predicted_gpu_gib": predicted.gpu_total / GIB, "predicted_host_gib": predicted.host_total / GIB,
              "predicted_terms_gib": {k: round(v / GIB, 3) for k, v in predicted.gpu.items()}}
    restores = apply_memory_options(model, options)
    generator = torch.Generator(device="cuda").manual_seed(seq)
    input_ids = torch.randint(0, shape.vocab_size, (1, seq), device="cuda", generator=generator)
    times, rss_after_forward = [], 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rss_before = host_rss()
    try:
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            rss_after_forward = max(rss_after_forward, host_rss())
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        step_time = statistics.median(times)
        record.update(status="ok", loss=float(loss), step_times=times, step_time=step_time, tokens_per_s=seq / step_time,
                      tflops=model_flops(shape, seq) / step_time / 1e12,
                      mfu=model_flops(shape, seq) / step_time / PEAK_FLOPS)
    except torch.OutOfMemoryError as error:
        record.update(status="oom", error=str(error).splitlines()[0][:200])
    finally:
        for restore in reversed(restores):
            restore()
        engine.zero_grad()
        loss = None
    record.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                  host_rss_before_gib=rss_before / GIB, host_rss_after_forward_gib=rss_after_forward / GIB)
    if record["status"] == "ok":
        record["prediction_error"] = record["predicted_gpu_gib"] / record["peak_allocated_gib"] - 1
    gc.collect()
    torch.cuda.empty_cache()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3.2-1b", choices=sorted(MODELS))
    parser.add_argument("--points", required=True, help="seq:features,... e.g. 8192:none,32768:ac+logits")
    parser.add_argument("--offload-optimizer", type=float, default=0.0)
    parser.add_argument("--sub-group-size", type=int, default=1 << 28)
    parser.add_argument("--mlp-tile", type=int, default=8192)
    parser.add_argument("--logits-tile", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    for variable in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(variable, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    started = time.perf_counter()
    shape, model, engine = build_engine(args.model, args.offload_optimizer, args.sub_group_size)
    print(json.dumps({"event": "engine", "model": args.model, "seconds": time.perf_counter() - started,
                      "allocated_gib": torch.cuda.memory_allocated() / GIB, "host_rss_gib": host_rss() / GIB,
                      "device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    for point in args.points.split(","):
        # seq:features, optionally @warmup/steps for this point (long sequences: one step is minutes)
        point, _, counts = point.partition("@")
        seq, features = point.split(":")
        point_args = argparse.Namespace(**vars(args))
        if counts:
            point_args.warmup, point_args.steps = map(int, counts.split("/"))
        print(json.dumps(run_point(shape, model, engine, int(seq), features, point_args, args.offload_optimizer)),
              flush=True)


if __name__ == "__main__":
    main()
