"""`memory="auto"` through the Trainer against a configuration picked by hand, on one GPU; one JSON line per run.

    python benchmarks/memory_auto.py --shape 8b --seq 131072 --variant auto
    python benchmarks/memory_auto.py --shape 8b --seq 131072 --variant hand --features ac,offload,mlp,logits,norms,attn \
        --offload-optimizer 0.15 --sub-group-size 268435456

Both variants train the same HF Llama shape (random init, bf16, sdpa) with `UlyssesDeepSpeedStrategy` at SP 1 on
ZeRO-3; `auto` lets the strategy choose the memory features, the optimizer's host share and its sub-groups and the
SDPA kernel (the decision is part of the line), `hand` sets them (cuDNN first). The optimizer is torch AdamW, or
DeepSpeed's CPU Adam where part of it is on the host. Plain HF + DeepSpeed ZeRO-3 is `strategy_overhead.py --variant
raw` (the driver `run_memory_auto.sh` runs all three per point). Timing as `strategy_overhead.py`: CUDA-synchronised
whole steps, median after warm-up; MFU against the measured 772 TFLOP/s and the 989 TFLOP/s datasheet peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from strategy_overhead import (PEAK_BF16_FLOPS, SHAPES, RandomTokens, StepProfiler, _count_params,  # noqa: E402
                               llama_config, model_flops_per_step, step_timer)

DATASHEET_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16


def run(args) -> tuple[list[float], dict]:
    import lightning as L

    from lightning_ulysses import UlyssesDeepSpeedStrategy
    from lightning_ulysses.models import CausalLMModule, HuggingFaceCausalLM
    from lightning_ulysses.training.optim import adamw, optimizer_on_host
    from lightning_ulysses.planning.plan import memory_options

    class Module(CausalLMModule):
        def configure_model(self):
            super().configure_model()
            if args.liger:  # Liger Kernel's RMSNorm and SwiGLU in the model (its loss stays ours: SP's, tiled)
                from liger_kernel.transformers import apply_liger_kernel_to_llama

                apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                            rms_norm=True, swiglu=True, model=self.model)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):  # CPU Adam where the optimizer is (chosen or set to be) on the host
            return adamw([{"params": list(self.parameters())}], 1e-5, (0.9, 0.999), optimizer_on_host(self.trainer))

    config = llama_config(args.shape, args.seq)
    options = {key: value for key, value in config.to_dict().items() if key in SHAPES[args.shape]
               or key in ("max_position_embeddings", "rope_theta")}
    module = Module(HuggingFaceCausalLM("llama", attn_implementation="sdpa", **options))
    if args.variant == "auto":
        # with Liger's norms and gate, ours (fused_elementwise, low-memory norms) stay off: one set of kernels
        liger = {"fused_elementwise": False, "low_memory_norms": False} if args.liger else {}
        kwargs = {"memory": {"auto": True, "seq_len": args.seq, **liger},
                  "sdpa_kernel_priority": "auto" if args.sdpa_kernel_priority == "auto"
                  else args.sdpa_kernel_priority.split(",")}
    else:
        kwargs = {"memory": memory_options(args.features), "sdpa_kernel_priority": ["cudnn"],
                  "sub_group_size": args.sub_group_size}
        if args.offload_optimizer:
            kwargs.update(offload_optimizer=True, config_overrides={
                "zero_optimization": {"offload_optimizer": {"ratio": args.offload_optimizer}}})
    strategy = UlyssesDeepSpeedStrategy(sequence_parallel_size=1, zero3_leaf_layers=args.zero3_leaf_layers == "on",
                                        **kwargs)
    timed = args.warmup + args.steps
    # --profile: two more steps after the timed ones, under torch.profiler (their tables go to the log)
    profiled = 2 if args.profile else 0
    timer = step_timer(StepProfiler(argparse.Namespace(profile=args.profile, warmup=timed)), split=args.split)
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=timed + profiled, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(module, torch.utils.data.DataLoader(RandomTokens(args.seq, config.vocab_size, timed + profiled),
                                                    batch_size=1))
    timer.profiler.finish()
    chosen = strategy.memory_choice.as_dict() if strategy.memory_choice else None
    extra = {"choice": chosen, "sdpa_kernel_priority": strategy.sdpa_kernel_priority}
    if timer.optimizer_times[args.warmup:timed]:
        extra["optimizer_step_s"] = statistics.median(timer.optimizer_times[args.warmup:timed])
    return timer.times[args.warmup:timed], extra


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=["auto", "hand"], required=True)
    parser.add_argument("--shape", choices=list(SHAPES), required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--features", default="none", help="hand: plan.memory_options syntax (ac,offload,mlp,...)")
    parser.add_argument("--offload-optimizer", type=float, default=0.0, help="hand: optimizer share on the host")
    parser.add_argument("--sub-group-size", type=int, default=10**9, help="hand: ZeRO-3 sub_group_size")
    parser.add_argument("--sdpa-kernel-priority", default="auto",
                        help="auto: the strategy's choice; else names, comma-separated (e.g. cudnn, or fa4,cudnn)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--offload-copies", choices=["overlapped", "compute-stream"], default="overlapped",
                        help="offloaded activations' copies: on a side stream (the default) or on the compute stream"
                             " (the baseline of the overlap, same results)")
    parser.add_argument("--mlp-recompute", choices=["left-out", "run"], default="left-out",
                        help="a checkpointed layer's recompute leaves its tiled MLP's forward out (the default) or runs"
                             " it (the baseline, before 2026-12-02; same results)")
    parser.add_argument("--liger", action="store_true",
                        help="auto: Liger Kernel's RMSNorm and SwiGLU in the model instead of our fused elementwise"
                             " kernels (liger-kernel; issue 35's comparison)")
    parser.add_argument("--split", action="store_true",
                        help="also time the optimizer step alone (from the end of backward, one more CUDA sync)")
    parser.add_argument("--profile", action="store_true",
                        help="two more steps after the timed ones under torch.profiler; its tables in the log")
    parser.add_argument("--zero3-leaf-layers", choices=["on", "off"], default="on",
                        help="ZeRO-3 gathers each decoder layer whole (the default) or submodule by submodule")
    args = parser.parse_args()
    from lightning_ulysses.memory import HostActivationStore
    from lightning_ulysses.memory.tiled_mlp import TiledMLP

    HostActivationStore.overlap_transfers = args.offload_copies == "overlapped"
    TiledMLP.leave_out_of_recompute = args.mlp_recompute == "left-out"
    torch.cuda.reset_peak_memory_stats()
    extra, error, times = {}, None, []
    try:
        times, extra = run(args)
    except torch.OutOfMemoryError as oom:
        error = f"OOM: {str(oom).splitlines()[0]}"
    except ValueError as refused:  # memory="auto" found nothing that fits: its message names the longest length
        error = f"refused: {refused}"
    config = llama_config(args.shape, args.seq)
    result = {"variant": args.variant, "shape": args.shape, "seq": args.seq, "features": args.features,
              "offload_optimizer": args.offload_optimizer, "offload_copies": args.offload_copies,
              "mlp_recompute": args.mlp_recompute, "zero3_leaf_layers": args.zero3_leaf_layers, "liger": args.liger,
              "error": error,
              **extra,
              "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result.update(timed_fields(config, args.seq, times))
    print("RESULT " + json.dumps(result), flush=True)


def timed_fields(config, seq: int, times: list[float]) -> dict:
    """The timing fields of a one-GPU run of one `seq`-token sequence per step (none when nothing was timed): median
    step, tokens/s, MFU of the measured and of the datasheet peak."""
    if not times:
        return {}
    step = statistics.median(times)
    flops = model_flops_per_step(config, seq, seq, _count_params(config))
    return dict(step_time_median_s=step, step_times_s=times, tokens_per_s=seq / step,
                mfu=flops / step / PEAK_BF16_FLOPS, mfu_datasheet=flops / step / DATASHEET_BF16_FLOPS)


if __name__ == "__main__":
    main()
