"""Multi-GPU scaling of UlyssesDeepSpeedStrategy, for N GPUs (run on 2 × H200: benchmarks/results/2026-11-29-h200x2-scaling/).

    torchrun --nproc_per_node N benchmarks/scaling.py --mode weak --tokens-per-gpu 32768
    torchrun --nproc_per_node N benchmarks/scaling.py --mode compare --seq 131072

- weak: SP = N, sequence = tokens_per_gpu × N (fixed tokens per GPU); reports tokens/s per GPU, MFU, peak memory and
  the share of step time spent in NCCL all-to-all kernels (torch.profiler over one step).
- compare: the write-ups' comparison at one sequence length on the same N GPUs: Ulysses SP = N + ZeRO-3 against pure
  ZeRO-3 (SP 1, DP = N, every GPU holding the whole sequence): memory per GPU and tokens/s (pure ZeRO-3 may OOM).
- longest: SP = N with `memory="auto"` at the longest length the planner says auto can fit (`auto.longest_fit`, from
  the GPUs' and the host's total memory, equal on every rank), then at --fractions of it until one step trains:
  the predicted limit against the measured one (targets: ≥ 500K tokens on one GPU, ≥ 4M on 8 GPUs).
--memory auto lets the strategy choose the features in weak/compare too (default: the fixed set below).
One JSON line per configuration on rank 0. Llama 3 8B shape (or --model), random init, bf16, memory features on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_ulysses  # noqa: E402,F401
from lightning_ulysses.integration.callbacks import ThroughputCallback  # noqa: E402
from lightning_ulysses.models import CausalLMModule, HuggingFaceCausalLM  # noqa: E402
from lightning_ulysses.planning.planner import MODELS  # noqa: E402

MEMORY = {"tiled_mlp": True, "tiled_logits_loss": True, "activation_checkpointing": True,
          "offload_activations": True, "expandable_segments": True}


def predicted_longest(args, devices: int) -> int:
    """auto's longest length at SP = devices from total (not free) memory, so that every rank computes the same."""
    from lightning_ulysses.planning.auto import AutoMemory, _proc_bytes, longest_fit
    from lightning_ulysses.parallel.layout import ParallelLayout
    from lightning_ulysses.parallel.run_spec import RunSpec

    total_device = torch.cuda.get_device_properties(0).total_memory
    total_host = _proc_bytes("/proc/meminfo", "MemTotal")
    run = RunSpec(layout=ParallelLayout(world_size=devices, sequence_parallel_size=devices), precision="bf16-mixed",
                  device="cuda")
    longest, _ = longest_fit(MODELS[args.model], AutoMemory(), run,
                             (total_device * args.usable, total_host * args.usable / devices))
    return longest


def run(args, sequence_parallel_size: int, seq_len: int, devices: int) -> dict:
    shape = MODELS[args.model]
    spec = HuggingFaceCausalLM("llama", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                               intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                               num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_key_value_heads,
                               max_position_embeddings=1 << 21, tie_word_embeddings=shape.tie_word_embeddings)
    module = CausalLMModule(spec)
    ids = torch.randint(0, shape.vocab_size, (args.steps * devices, seq_len))
    data = DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=1)
    memory = {"auto": True, "seq_len": seq_len} if args.memory == "auto" else MEMORY
    strategy = lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=sequence_parallel_size, stage=3,
                                                         memory=memory)
    throughput, all_to_all = ThroughputCallback(peak_flops=772e12, prog_bar=False), _AllToAllShare()
    trainer = L.Trainer(accelerator="cuda", devices=devices, strategy=strategy, precision="bf16-true",
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[throughput, all_to_all])
    result = {"model": args.model, "devices": devices, "sp": sequence_parallel_size, "seq": seq_len}
    try:
        trainer.fit(module, data)
        result.update(status="ok", **{k: v for k, v in throughput.last_metrics.items()},
                      all_to_all_share=all_to_all.share)
    except torch.OutOfMemoryError:
        result.update(status="oom")
    except ValueError as refused:  # memory="auto" found nothing that fits the free memory at start-up
        result.update(status="refused", reason=str(refused))
    if strategy.memory_choice is not None:
        result.update(choice=strategy.memory_choice.as_dict())
    return result


class _AllToAllShare(L.Callback):
    """Share of the last step's device time spent in NCCL all-to-all kernels (profiled on the last step)."""

    share = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == trainer.max_steps - 1:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == trainer.max_steps - 1:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            events = self.profiler.key_averages()
            total = sum(e.device_time_total for e in events)
            # NCCL runs all-to-all as grouped send/receive: its kernels are named ncclDevKernel_SendRecv.
            all_to_all = sum(e.device_time_total for e in events if "SendRecv" in e.key or "AllToAll" in e.key)
            self.share = all_to_all / total if total else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["weak", "compare", "longest"], default="weak")
    parser.add_argument("--memory", choices=["engine", "auto"], default="engine",
                        help='engine: the fixed feature set MEMORY; auto: memory="auto" (always, in --mode longest)')
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.95, 0.9],
                        help="longest: the shares of the predicted limit tried, in order, until one trains")
    parser.add_argument("--usable", type=float, default=0.97,
                        help="longest: the share of total GPU/host memory taken as free for the prediction")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--tokens-per-gpu", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    devices = int(os.environ.get("WORLD_SIZE", torch.cuda.device_count()))  # the processes torchrun started
    if args.mode == "longest":
        args.memory = "auto"
        longest = predicted_longest(args, devices)
        step = 64 * devices
        for fraction in args.fractions:
            result = run(args, devices, int(longest * fraction) // step * step, devices)
            result.update(predicted_longest=longest, fraction=fraction)
            if torch.distributed.get_rank() == 0:
                print(json.dumps(result), flush=True)
            if result["status"] == "ok":
                break
        return
    configs = ([(devices, args.tokens_per_gpu * devices)] if args.mode == "weak"
               else [(devices, args.seq), (1, args.seq)])
    for sequence_parallel_size, seq_len in configs:
        result = run(args, sequence_parallel_size, seq_len, devices)
        if torch.distributed.get_rank() == 0:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
