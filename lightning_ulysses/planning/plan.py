"""`python -m lightning_ulysses plan`: per-GPU memory of a training step, the longest sequence that fits, and the
published 176B figures term by term.

    python -m lightning_ulysses plan --model llama3-8b --seq 131072 --features ac,offload,mlp,logits
    python -m lightning_ulysses plan --model llama3-8b --longest --gpu-gib 134 --host-gib 112 \
        --features ac,offload,mlp,logits --offload-optimizer 0.3
    python -m lightning_ulysses plan --model gpt3-175b --seq 32768 --sp 8 --dp 4 --offload-optimizer 1 --features ac
    python -m lightning_ulysses plan --published-176b
    python -m lightning_ulysses plan --model llama3-8b --seq 131072 --auto --gpu-gib 139 --host-gib 118
    python -m lightning_ulysses plan --model llama3-8b --seq 32768 --sp 2 --backend fsdp2 --auto --gpu-gib 139
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from lightning_ulysses.parallel.layout import ParallelLayout
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning.auto import AutoMemory, choose, longest_fit
from lightning_ulysses.planning.planner import (FEATURES, GIB, MODELS, TrainingSetup, longest_sequence, memory_options,
                                                plan_memory, published_176b_comparison)

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_ulysses plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--seq", type=int, default=32768, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1, help="sequence-parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size")
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage")
    parser.add_argument("--backend", choices=["deepspeed", "fsdp2"], default="deepspeed",
                        help="what shards the model: DeepSpeed ZeRO (strategy='ulysses') or torch's FSDP2"
                             " (strategy='ulysses_fsdp': always sharded over all ranks, the optimizer on the GPU)")
    parser.add_argument("--offload-optimizer", type=float, default=0.0,
                        help="DeepSpeed's offload_optimizer.ratio: the share of optimizer sub-groups on the host")
    parser.add_argument("--sub-group-size", type=int, default=TrainingSetup.sub_group_size,
                        help="ZeRO-3 sub_group_size (DeepSpeed 1e9, Lightning's strategy 1e12): the offload unit")
    parser.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="offload_optimizer.pin_memory (pinned blocks are rounded up to powers of two)")
    parser.add_argument("--features", default="none",
                        help="comma-separated: ac, offload, mlp, logits, norms, attn, fused, everyK (or none)")
    parser.add_argument("--longest", action="store_true", help="find the longest sequence that fits")
    parser.add_argument("--gpu-gib", type=float, default=134.0, help="usable GPU memory per GPU (GiB)")
    parser.add_argument("--host-gib", type=float, default=float("inf"), help="usable host memory per GPU (GiB)")
    parser.add_argument("--published-176b", action="store_true", help="explain the quoted 176B figures")
    parser.add_argument("--auto", action="store_true",
                        help='what memory="auto" chooses for free memory of --gpu-gib (device) and --host-gib per rank'
                             " (--features pins those features on)")
    parser.add_argument("--kernel", default="cudnn", choices=["cudnn", "flash", "efficient", "math"],
                        help="with --auto: the SDPA kernel attention runs with (cudnn: the Hopper rule)")
    args = parser.parse_args(argv)
    if args.published_176b:
        print(published_176b_comparison())
        return
    setup = TrainingSetup(seq_len=args.seq, micro_batch=args.micro_batch, sequence_parallel_size=args.sp,
                          data_parallel_size=args.dp, zero_stage=args.zero, offload_optimizer=args.offload_optimizer,
                          sub_group_size=args.sub_group_size, offload_pin_memory=args.pin_memory,
                          memory=memory_options(args.features), backend=args.backend)
    shape = MODELS[args.model]
    if args.auto:
        return _auto(args, shape)
    if args.longest:
        seq = longest_sequence(shape, setup, args.gpu_gib * GIB, args.host_gib * GIB)
        print(f"longest sequence that fits {args.sp * args.dp} GPU(s) of {args.gpu_gib} GiB"
              f" (+ {args.host_gib} GiB host each): {seq} tokens")
        # none fits: show the shortest sequence's plan, whose totals say which memory is short
        setup = dataclasses.replace(setup, seq_len=seq or math.lcm(1024, args.sp))
    print(plan_memory(shape, setup).table())


def _auto(args, shape) -> int:
    pins = {name: True for name in FEATURES.values() if getattr(memory_options(args.features), name)}
    request = AutoMemory(seq_len=args.seq, micro_batch=args.micro_batch, **pins)
    # a GPU (bf16) with Triton is assumed; the planner's gated-MLP shapes are Llama-style (RMSNorms), which it fuses
    run = RunSpec(layout=ParallelLayout(world_size=args.sp * args.dp, sequence_parallel_size=args.sp),
                  zero_stage=args.zero, precision="bf16-mixed", device="cuda", backend=args.backend)
    fused = shape.gated_mlp
    if args.longest:  # the longest length auto can train, then its choice there
        args.seq, _ = longest_fit(shape, request, run, (args.gpu_gib * GIB, args.host_gib * GIB), fused_elementwise=fused)
        print(f'longest sequence memory="auto" fits: {args.seq} tokens')
        if not args.seq:
            return 1
        request = dataclasses.replace(request, seq_len=args.seq)
    try:
        print(choose(shape, request, run, (args.gpu_gib * GIB, args.host_gib * GIB), kernel=args.kernel,
                     fused_elementwise=fused).report())
    except ValueError as error:
        print(error)
        return 1
    return 0


if __name__ == "__main__":
    main()
