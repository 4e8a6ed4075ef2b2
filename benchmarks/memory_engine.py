"""Memory engine on one GPU: peak memory, host memory, tokens/s and MFU against the planner's prediction.

HF Llama shapes (random init, bf16, sdpa), DeepSpeed ZeRO-3 on one rank (torch AdamW, optionally a fraction of
the optimizer on the host), the memory features applied by `lightning_ulysses.memory.apply_memory_options` (what
`UlyssesDeepSpeedStrategy(memory=...)` applies before DeepSpeed wraps the model). One engine per model; features
are switched per point (every MLP is marked a ZeRO-3 leaf before DeepSpeed starts, which is valid tiled or not).

    python benchmarks/memory_engine.py --model llama3.2-1b --points 8192:none,32768:ac+logits+mlp+offload \
        --steps 3 > results.jsonl

Features per point: none, or '+'-joined ac (layer checkpointing), offload (its inputs on the host), mlp (tiled
MLP), logits (tiled logits + loss), attn (keep attention outputs), everyK (checkpoint every K-th layer's input)
— `lightning_ulysses.planning.plan.memory_options`. One JSON line per point; an OOM is a line too.
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
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lightning_ulysses.attention.backends import sdpa_priority  # noqa: E402
from lightning_ulysses.memory import apply_memory_options  # noqa: E402
from lightning_ulysses.planning.plan import memory_options  # noqa: E402
from lightning_ulysses.planning.planner import MODELS, TrainingSetup, plan_memory  # noqa: E402

PEAK_FLOPS = 772e12  # measured bf16 matmul peak of the lent H200 (DESIGN-NOTES)
GIB = 2**30


def model_flops(shape, seq_len: int) -> float:
    """The issue's MFU numerator: 6·params·tokens + 6·layers·seq²·hidden (causal attention), no recomputation."""
    return 6 * shape.num_parameters * seq_len + 6 * shape.num_layers * seq_len**2 * shape.hidden_size


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS: now, VmHWM: the process's peak) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def host_rss() -> int:
    return _status_bytes("VmRSS")


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


class _KernelNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def attention_kernel(shape) -> str:
    """The kernel F.scaled_dot_product_attention picks for this model's heads (causal, GQA as HF calls it)."""
    q = torch.randn(1, shape.num_heads, 1024, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, shape.num_key_value_heads, 1024, shape.head_dim, device="cuda", dtype=torch.bfloat16)
    with _KernelNames() as names:
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    return ",".join(n for n in names.names if "attention" in n)


def host_peak_rss() -> int:
    return _status_bytes("VmHWM")


def run_steps(engine, input_ids, args, times: list, rss: list) -> None:
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        rss[0] = max(rss[0], host_rss())
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    args.last_loss = float(loss)


def run_point(shape, model, engine, seq: int, features: str, args, offload_ratio: float) -> dict:
    options = memory_options(features, args.mlp_tile, args.logits_tile)
    predicted = plan_memory(shape, TrainingSetup(seq_len=seq, memory=options, offload_optimizer=offload_ratio,
                                                 sub_group_size=args.sub_group_size))
    record = {"model": args.model, "seq": seq, "features": features, "offload_optimizer": offload_ratio,
              "predicted_gpu_gib": predicted.gpu_total / GIB, "predicted_host_gib": predicted.host_total / GIB,
              "predicted_terms_gib": {k: round(v / GIB, 3) for k, v in predicted.gpu.items()}}
    restores = apply_memory_options(model, options)
    record["sdpa_backend"] = args.sdpa_backend
    generator = torch.Generator(device="cuda").manual_seed(seq)
    input_ids = torch.randint(0, shape.vocab_size, (1, seq), device="cuda", generator=generator)
    times, rss = [], [0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rss_before = host_rss()
    try:
        # the point's SDPA kernel first (torch's own order for "default"), as the strategy's sdpa_kernel_priority does
        with sdpa_priority(None if args.sdpa_backend == "default" else (args.sdpa_backend,)):
            record["attention_kernel"] = attention_kernel(shape)
            run_steps(engine, input_ids, args, times, rss)
        step_time = statistics.median(times)
        record.update(status="ok", loss=args.last_loss, step_times=times, step_time=step_time, tokens_per_s=seq / step_time,
                      tflops=model_flops(shape, seq) / step_time / 1e12,
                      mfu=model_flops(shape, seq) / step_time / PEAK_FLOPS)
    except torch.OutOfMemoryError as error:
        record.update(status="oom", error=str(error).splitlines()[0][:200])
    finally:
        for restore in reversed(restores):
            restore()
        engine.zero_grad()
    record.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                  peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                  host_rss_before_gib=rss_before / GIB, host_rss_after_forward_gib=rss[0] / GIB,
                  host_peak_rss_gib=host_peak_rss() / GIB)
    if record["status"] == "ok":
        record["prediction_error"] = record["predicted_gpu_gib"] / record["peak_allocated_gib"] - 1
    gc.collect()
    torch.cuda.empty_cache()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3.2-1b", choices=sorted(MODELS))
    parser.add_argument("--points", required=True,
                        help="seq:features[:sdpa backend][@warmup/steps],... e.g. 8192:none,32768:ac+logits:cudnn@1/2")
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
        seq, features, *backend = point.split(":")  # seq:features[:sdpa backend]
        point_args = argparse.Namespace(**vars(args))
        point_args.sdpa_backend = backend[0] if backend else "default"
        if counts:
            point_args.warmup, point_args.steps = map(int, counts.split("/"))
        print(json.dumps(run_point(shape, model, engine, int(seq), features, point_args, args.offload_optimizer)),
              flush=True)


if __name__ == "__main__":
    main()
