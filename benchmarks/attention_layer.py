"""Attention-layer time (forward + backward, causal) of Ulysses, ring and hybrid attention against plain SDPA on
the full sequence, one GPU per rank; SP = the number of processes.

    python benchmarks/attention_layer.py                                           # 1 GPU: the SP-1 overhead
    torchrun --nproc_per_node 2 benchmarks/attention_layer.py                      # SP 2 vs one GPU, full sequence
    torchrun --nproc_per_node 4 benchmarks/attention_layer.py --modes sdpa hybrid  # Ulysses 2 × ring 2
    torchrun --nproc_per_node 2 benchmarks/attention_layer.py --device cpu --tiny  # CPU smoke test (gloo)

Modes (each on this rank's shard `[batch, heads, seq/P, head_dim]`, except sdpa):
- `sdpa`: `F.scaled_dot_product_attention(is_causal=True)` on the whole sequence, on every rank alike (the
  "one GPU runs the full sequence" baseline, measured concurrently on every GPU).
- `ulysses`: `UlyssesAttention` over all ranks (all-to-alls + SDPA). At 1 process: the module unbound, i.e. the
  overhead of our path over plain SDPA.
- `local`: what each Ulysses rank computes, without any exchange: SDPA over heads/P heads on the whole
  sequence (the compute floor of `ulysses`).
- `exchange`: the Ulysses all-to-alls alone (forward and backward), around an elementwise q + k + v in place of
  the attention (MHA only): `ulysses` ≈ `local` + `exchange` − what overlaps.
- `ulysses_separate`: `ulysses` with each exchange finished before the next is launched (no q/k/v in flight
  together); `ulysses_stack_cat`: with the exchange this project used before session 4 (per tensor,
  `torch.stack` of the chunks, blocking wait, `torch.cat`). A/B baselines for the exchange; MHA/GQA with KV heads
  divisible by the number of processes only (no KV replication).
- `ring`: ring attention over all ranks (zig-zag shards, K/V blocks passed around). At 1 process: our fused
  kernel + custom backward on one block.
- `hybrid`: `ulysses_size = P / 2` × `ring_size = 2` (Ulysses over neighbouring ranks, a ring across the two
  halves); needs an even number of processes, at least 4.

`--ring-kernels flash cudnn`: one `ring`/`hybrid` variant per block kernel (the ring takes the first of cuDNN and
flash in the SDPA priority in force, so each variant runs with its kernel first); `block_kernel` says what ran.
The ring's block kernels against SDPA + cuDNN on one H200 (Llama-3-8B attention, ~2 minutes):

    python benchmarks/attention_layer.py --modes sdpa ring --ring-kernels flash cudnn --sdpa-kernel cudnn \
        --seq 32768 131072 --kv-heads 8 --warmup 3 --iters 20 --check yes

Timing: CUDA events around each forward+backward, `--warmup` untimed iterations, median (and p10/p90) of
`--iters`; ranks are barrier-synchronised before the timed loop. `speedup_vs_sdpa` = sdpa median / mode median
at the same length (SP 2 target: ≥ 1.92× at 32K, ≥ 1.98× at 128K). One JSON line per (mode, length) on rank 0.
`--check` (default for lengths ≤ 32K) also reports the largest deviation of the output and of the q/k/v gradients
from full SDPA on the same inputs (absolute, and relative to the largest reference value), and on CUDA how far SDPA's
own flash and cuDNN kernels are apart (`sdpa_flash_vs_cudnn`, in the sdpa line): `within_tolerance` holds when every
relative deviation is at most twice that spread or 2^-7 (half a bf16 step at the largest value), whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses.attention import copy_engine
from lightning_ulysses.attention import ring
from lightning_ulysses.attention.all_to_all import start_exchange
from lightning_ulysses.attention.backends import SDPA_KERNELS, sdpa_priority
from lightning_ulysses.attention.core import UlyssesAttention
from lightning_ulysses.attention.ring import block_kernel_kind, ring_attention, sdpa_kernel_order
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups, ShardOrder

MODES = ("sdpa", "local", "exchange", "ulysses", "ulysses_separate", "ulysses_stack_cat", "ring", "hybrid")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes, few iterations, fp32 (smoke test)")
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["sdpa", "ulysses", "ring", "hybrid"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: as many as --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--check", choices=("auto", "yes", "no"), default="auto",
                        help="compare with full SDPA (auto: lengths <= 32K)")
    parser.add_argument("--head-groups", type=int, nargs="+", default=[1],
                        help="ulysses and exchange modes: one variant per count of pipelined head groups (overlap_head_groups)")
    parser.add_argument("--exchange", nargs="+", choices=("nccl", "copy_engine"), default=["nccl"],
                        help="ulysses and exchange modes: one variant per all-to-all transport (the strategy's"
                             " exchange); copy_engine on CPU runs its gloo emulation (a smoke test, not a timing)")
    parser.add_argument("--high-priority-streams", action="store_true",
                        help="ulysses and exchange modes: also run each variant over an SP group whose NCCL stream has high"
                             " priority")
    parser.add_argument("--sdpa-kernel", choices=("default",) + tuple(SDPA_KERNELS), default="default",
                        help="SDPA kernel tried first for every mode (default: torch's own order)")
    parser.add_argument("--ring-kernels", nargs="+", choices=("flash", "cudnn"), default=None,
                        help="ring and hybrid modes: one variant per block kernel (default: the SDPA priority's)")
    parser.add_argument("--profile", default=None,
                        help="folder: also trace 2 iterations of each variant (CUDA kernels) and report how long NCCL"
                             " kernels ran beside compute kernels; the traces are written there")
    parser.add_argument("--label", default="", help="recorded in every JSON line (e.g. the environment settings)")
    parser.add_argument("--output", default=None, help="append the JSON lines to this file too")
    args = parser.parse_args()
    if args.tiny:
        args.seq = [64, 256] if args.seq == parser.get_default("seq") else args.seq
        args.heads, args.head_dim, args.dtype = min(args.heads, 8), min(args.head_dim, 16), "fp32"
        args.warmup, args.iters = min(args.warmup, 1), min(args.iters, 3)
    args.kv_heads = args.kv_heads or args.heads
    return args


def init_distributed(device_type: str) -> torch.device:
    if "RANK" not in os.environ:  # plain `python`: a one-process group, so every mode runs the same code
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


class Timer:
    """Per-iteration wall time of forward+backward: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: list = []

    def time(self, step) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            self.pairs.append((start, end))
        else:
            start = time.perf_counter()
            step()
            self.pairs.append((start, time.perf_counter()))

    def milliseconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.pairs]
        return [(end - start) * 1e3 for start, end in self.pairs]


class _StackCatAllToAll(torch.autograd.Function):
    """The per-tensor all-to-all this project used before session 4 (kept here as an A/B baseline)."""

    @staticmethod
    def exchange(tensor, group, scatter_dim, gather_dim):
        send = torch.stack(tensor.chunk(dist.get_world_size(group), dim=scatter_dim))
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group, async_op=True).wait()
        return torch.cat(receive.unbind(0), dim=gather_dim)

    @staticmethod
    def forward(ctx, tensor, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _StackCatAllToAll.exchange(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad_output):
        return _StackCatAllToAll.exchange(grad_output, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def per_tensor_ulysses(attend, group, library_exchange: bool, transport=None):
    """Ulysses with each all-to-all waited for at once: through the library's `start_exchange` (over `transport`) or
    the old stack/cat."""

    def exchange(tensor, scatter_dim, gather_dim):
        if library_exchange:
            return start_exchange(tensor, group, scatter_dim, gather_dim, transport).finish()
        return _StackCatAllToAll.apply(tensor, group, scatter_dim, gather_dim)

    def attention(q, k, v):
        q, k, v = (exchange(t, 1, 2) for t in (q, k, v))
        return exchange(attend(q, k, v).transpose(1, 2), 1, 2).transpose(1, 2)

    return attention


def high_priority_group(device: torch.device):
    """The whole world again as a group whose NCCL stream has high priority (its kernels get SMs first)."""
    if device.type != "cuda":
        return dist.new_group(list(range(dist.get_world_size())))
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return dist.new_group(list(range(dist.get_world_size())), pg_options=options)


def causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))


def checking(seq_len, args) -> bool:
    return args.check == "yes" or (args.check == "auto" and seq_len <= 32768)


def build_attention(mode: str, base_groups: SequenceParallelGroups, args, head_groups: int = 1, group=None,
                    transport=None):
    """(attention callable on local shards, shard order, (ulysses_size, ring_size)) or None when not applicable.
    `transport`: the all-to-all transport of the pure-Ulysses modes (the ring's Ulysses sub-group exchanges
    collectively)."""
    world = base_groups.sequence_parallel_world_size
    if mode in ("local", "ulysses_separate", "ulysses_stack_cat") and args.kv_heads % world:
        return None  # these cut the KV heads like the query heads: no KV replication
    if mode in ("sdpa", "local"):  # local: measure() hands it one rank's share of the heads, all tokens
        return causal_sdpa, None, (1, 1)
    if mode in ("ulysses_separate", "ulysses_stack_cat"):
        attention = per_tensor_ulysses(causal_sdpa, base_groups.sequence_parallel_group, mode == "ulysses_separate",
                                       transport)
        return attention, ShardOrder(world), (world, 1)
    if mode in ("ulysses", "exchange"):
        if mode == "exchange" and args.kv_heads != args.heads:
            return None
        # exchange: an elementwise stand-in for the attention, so that only the all-to-alls cost time
        attention = UlyssesAttention(causal_sdpa if mode == "ulysses" else (lambda q, k, v: q + k + v),
                                     overlap_head_groups=head_groups)
        attention.bind_parallel_groups(base_groups)
        if group is not None and world > 1:
            attention.bind(group)
        attention.bind_transport(transport)
        return attention, ShardOrder(world), (world, 1)
    ring = {"ring": world, "hybrid": 2}[mode]
    if mode == "hybrid" and (world < 4 or world % 2):
        return None
    if world == 1:  # no group to bind: the ring's own kernel path on the single block
        return (lambda q, k, v: ring_attention(q, k, v, None, True)), ShardOrder(1), (1, 1)
    groups = base_groups.with_ring_size(ring)
    attention = UlyssesAttention(causal=True)
    attention.bind_parallel_groups(groups)
    return attention, groups.shard_order, (groups.ulysses_size, groups.ring_size)


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_overlap(step, mode, seq_len, rank, args) -> dict:
    """Trace two iterations; per iteration: time NCCL kernels ran, time compute kernels ran, and how much of the
    NCCL time had a compute kernel running beside it (the overlap the pipelining is for)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    path = os.path.join(args.profile, f"{mode}-{seq_len}-{args.label or 'run'}-rank{rank}-{time.time_ns()}.json")
    os.makedirs(args.profile, exist_ok=True)
    trace.export_chrome_trace(path)
    with open(path) as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("cat") == "kernel"]
    nccl = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if "nccl" in e["name"].lower()])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if "nccl" not in e["name"].lower()])
    length = sum(end - start for start, end in nccl)
    return {"trace": os.path.basename(path), "nccl_kernel_ms": length / 2e3,
            "compute_kernel_ms": sum(end - start for start, end in compute) / 2e3,
            "nccl_beside_compute_ms": _intersection(nccl, compute) / 2e3}


def full_inputs(seq_len, device, args) -> list[torch.Tensor]:
    """q, k, v and the output gradient on the whole sequence, the same on every rank and for every mode."""
    generator = torch.Generator(device=device).manual_seed(1234 + seq_len)

    def full(heads):
        return torch.randn(args.batch, heads, seq_len, args.head_dim, device=device, dtype=DTYPES[args.dtype],
                           generator=generator)

    return [full(args.heads), full(args.kv_heads), full(args.kv_heads), full(args.heads)]


def _output_and_gradients(attention, inputs, grad_out) -> dict:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = attention(*leaves)
    out.backward(grad_out)
    return {"out": out.detach(), **{f"grad_{name}": t.grad for name, t in zip("qkv", leaves)}}


def deviations(mine: dict, reference: dict) -> dict:
    """Largest absolute deviation per tensor and relative to the reference's largest value, worst over ranks."""
    result = {}
    for name, tensor in reference.items():
        worst = torch.stack([(mine[name].float() - tensor.float()).abs().max(), tensor.float().abs().max()])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result[name] = {"abs": worst[0].item(), "rel": (worst[0] / worst[1]).item()}
    return result


def sdpa_kernel_spread(seq_len, device, args) -> dict:
    """How far SDPA's flash and cuDNN kernels are apart on the same inputs: the yardstick of an exact bf16 kernel."""
    q, k, v, grad = full_inputs(seq_len, device, args)
    runs = []
    for kernel in ("flash", "cudnn"):
        with sdpa_priority((kernel,)):
            runs.append(_output_and_gradients(causal_sdpa, (q, k, v), grad))
    return deviations(*runs)


def check_against_sdpa(attention, local, grad_out, full, order, rank, spread, args) -> dict:
    reference = _output_and_gradients(causal_sdpa, full[:3], full[3])
    if order is not None:
        reference = {name: order.shard(t, rank, dim=2) for name, t in reference.items()}
    found = deviations(_output_and_gradients(attention, local, grad_out), reference)
    floor = 2.0**-7
    bounds = {name: max(2 * spread[name]["rel"], floor) if spread else floor for name in found}
    return {"max_error_vs_sdpa": found["out"]["abs"], "errors_vs_sdpa": found,
            "within_tolerance": all(found[name]["rel"] <= bounds[name] for name in found)}


def measure(mode, attention, order, seq_len, groups, device, args, spread=None):
    rank = groups.sequence_parallel_rank
    q_full, k_full, v_full, grad_full = full_inputs(seq_len, device, args)
    if mode == "local":  # what one Ulysses rank attends over: heads/P heads, every token
        world = groups.sequence_parallel_world_size
        local = [t[:, : t.size(1) // world].contiguous() for t in (q_full, k_full, v_full)]
        grad_out = grad_full[:, : args.heads // world].contiguous()
    elif order is None:
        local = [q_full, k_full, v_full]
        grad_out = grad_full
    else:
        local = [order.shard(t, rank, dim=2).contiguous() for t in (q_full, k_full, v_full)]
        grad_out = order.shard(grad_full, rank, dim=2).contiguous()
    local = [t.requires_grad_() for t in local]

    def step():
        for tensor in local:
            tensor.grad = None
        attention(*local).backward(grad_out)

    checked = {"max_error_vs_sdpa": None}
    if mode not in ("local", "exchange") and checking(seq_len, args):
        checked = check_against_sdpa(attention, local, grad_out, [q_full, k_full, v_full, grad_full], order, rank,
                                     spread, args)
    del q_full, k_full, v_full, grad_full

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    dist.barrier()
    timer = Timer(device)
    for _ in range(args.iters):
        timer.time(step)
    times = sorted(timer.milliseconds())
    median = torch.tensor(statistics.median(times), dtype=torch.float64, device=device)
    slowest = median.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    overlap = kernel_overlap(step, mode, seq_len, rank, args) if args.profile and device.type == "cuda" else {}
    return {**overlap,
        "median_ms": median.item(), "slowest_rank_median_ms": slowest.item(),
        "p10_ms": times[len(times) // 10], "p90_ms": times[(9 * len(times)) // 10],
        "peak_memory_gib": peak, **checked,
    }


def block_kernels_ran(device, args) -> dict:
    """The ring's block kernel under the SDPA priority in force, and what it settled for cuDNN (per heads)."""
    decided = {f"{heads} heads, {kv_heads} KV heads": kind + (", KV heads unrepeated" if unrepeated else "")
               for (_, _, heads, kv_heads, _), (kind, unrepeated) in ring._decided.items()}
    return {"block_kernel": block_kernel_kind(device.type, DTYPES[args.dtype], sdpa_kernel_order()),
            "cudnn_decisions": decided}


def exchange_transport(exchange: str, group, device: torch.device):
    """The transport `exchange` names for `group`, refused as the strategy refuses it (`choose_exchange`); on CPU
    the copy engine's gloo emulation."""
    if exchange == "nccl":
        return None
    if device.type == "cpu":
        return copy_engine.EmulatedCopyTransport()
    world, local = dist.get_world_size(group), int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    devices = [device] + [torch.device("cuda", i) for i in range(world) if i != device.index]
    probe = copy_engine.probe_copy_engine(devices, group_on_one_host=local >= world)
    copy_engine.choose_exchange("copy_engine", copy_engine.agreed_failure(probe, group, device))
    return copy_engine.SymmetricMemoryTransport()


def run_variant(mode, head_groups, stream, ring_kernel, group, seq_len, sdpa_ms, spread, base_groups, device, args,
                exchange="nccl"):
    """Measure one variant at one length, print its JSON line; returns the sdpa baseline time (set by mode sdpa)."""
    world = dist.get_world_size()
    exchange_group = group if group is not None else base_groups.ulysses_group
    transport = exchange_transport(exchange, exchange_group, device) if world > 1 else None
    built = build_attention(mode, base_groups, args, head_groups, group, transport)
    point = {"mode": mode, "world_size": world, "seq_len": seq_len, "batch": args.batch, "heads": args.heads,
             "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype, "device": device.type,
             "sdpa_kernel": args.sdpa_kernel, "label": args.label}
    if mode in ("ulysses", "exchange"):
        point.update(head_groups=head_groups, nccl_stream=stream, exchange=exchange)
    if mode == "sdpa" and spread:
        point["sdpa_flash_vs_cudnn"] = spread
    if built is None:
        point["skipped"] = {"exchange": "MHA only", "hybrid": "needs an even number of ranks, at least 4"}.get(
            mode, "KV heads must be divisible by the number of processes (no KV replication in this mode)")
    else:
        attention, order, (ulysses_size, ring_size) = built
        needed = (order or ShardOrder(1)).length_multiple
        if seq_len % needed:
            point["skipped"] = f"seq_len must be a multiple of {needed}"
        else:
            point.update(ulysses_size=ulysses_size, ring_size=ring_size, warmup=args.warmup, iters=args.iters)
            # a ring variant runs with its block kernel first in SDPA's priority, which is what the ring follows
            with sdpa_priority(None if ring_kernel is None else (ring_kernel,)):
                point.update(measure(mode, attention, order, seq_len, base_groups, device, args, spread))
                if mode in ("ring", "hybrid"):
                    point.update(ring_kernel=ring_kernel, **block_kernels_ran(device, args))
            # causal forward 2·B·H·N²·D flops (two matmuls, half the scores), backward 2.5× that
            flops = 3.5 * 2 * args.batch * args.heads * seq_len**2 * args.head_dim
            gpus = {"sdpa": 1, "local": 1}.get(mode, world)  # local: the flops of its heads only
            flops = flops / world if mode == "local" else flops
            point["tflops_per_device"] = flops / gpus / (point["slowest_rank_median_ms"] * 1e-3) / 1e12
            if mode == "sdpa":
                sdpa_ms = point["slowest_rank_median_ms"]
            elif sdpa_ms is not None:
                point["speedup_vs_sdpa"] = sdpa_ms / point["slowest_rank_median_ms"]
    if dist.get_rank() == 0:
        line = json.dumps(point)
        print(line, flush=True)
        if args.output:
            with open(args.output, "a") as file:
                file.write(line + "\n")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sdpa_ms


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device)
    base_groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), dist.get_world_size()))
    modes = [m for m in MODES if m in args.modes]  # sdpa first: the others are compared with it
    streams = {"normal": None}
    if args.high_priority_streams:
        streams["high"] = high_priority_group(device)
    ulysses_variants = [(g, stream, x) for stream in streams for g in args.head_groups for x in args.exchange]
    ring_kernels = args.ring_kernels or [None]
    variants = [(mode, g, stream, x, kernel) for mode in modes
                for g, stream, x in (ulysses_variants if mode in ("ulysses", "exchange") else [(1, "normal", "nccl")])
                for kernel in (ring_kernels if mode in ("ring", "hybrid") else [None])]
    with sdpa_priority(None if args.sdpa_kernel == "default" else (args.sdpa_kernel,)):
        for seq_len in args.seq:
            sdpa_ms = None
            spread = sdpa_kernel_spread(seq_len, device, args) if checking(seq_len, args) and device.type == "cuda" \
                else None
            for mode, head_groups, stream, exchange, kernel in variants:
                sdpa_ms = run_variant(mode, head_groups, stream, kernel, streams[stream], seq_len, sdpa_ms, spread,
                                      base_groups, device, args, exchange)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
