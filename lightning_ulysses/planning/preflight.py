"""Preflight diagnostics: the machine settings that decide whether a long-sequence run is fast and stable.

Each finding says what is in force and, where it matters, the concrete fix users otherwise learn the hard way:
all-to-all over PCIe instead of NVLink, GPUs far from their rank's CPUs, NCCL variables that slow or break
collectives, allocator fragmentation, too few cores or too little RAM for CPU optimizer offload, and bf16
gradient accumulation.

The strategy logs the report once per node at start-up (local rank 0); `python -m lightning_ulysses preflight`
prints it for a planned run on this machine (`python -m lightning_ulysses preflight --help`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_ulysses.parallel.layout import ParallelLayout
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning.planner import TrainingSetup, optimizer_offload_host_bytes, sub_groups_of

GIB = 1024**3
# Bytes per parameter that ZeRO-Offload keeps in host memory, split over all ranks: fp32 master weights, Adam's
# two fp32 moments and fp32 gradients (optimizer offload); the 16-bit parameters (parameter offload).
OPTIMIZER_OFFLOAD_BYTES_PER_PARAMETER = 4 + 8 + 4
PARAMETER_OFFLOAD_BYTES_PER_PARAMETER = 2
MIN_CORES_PER_RANK_FOR_CPU_ADAM = 4  # below this the CPU Adam step dominates the step time at long sequences


@dataclass(frozen=True)
class Finding:
    topic: str
    level: str  # "ok", "advice" or "warning"
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class PlannedRun:
    """What the checks need to know: the run's description (layout, ZeRO offload, precision), this node's share of
    it, and the model's size."""

    spec: RunSpec
    local_world_size: int  # ranks on this node
    local_rank: int = 0
    num_nodes: int = 1
    num_parameters: Optional[int] = None
    # With these the host check counts DeepSpeed's own offload buffers (lightning_ulysses.planning.planner) instead of
    # 16 B per parameter: the trainable parameter tensors' sizes in registration order.
    parameter_numels: Optional[tuple[int, ...]] = None

    @classmethod
    def of_strategy(cls, strategy: Any) -> "PlannedRun":
        """The run a set-up `UlyssesDeepSpeedStrategy` is about to train: its description (`run_spec`), and the
        LightningModule's parameters (ZeRO-3's full sizes, `ds_numel`, when they are already partitioned)."""
        parameters = list(strategy.lightning_module.parameters())
        return cls(
            spec=strategy.run_spec, local_world_size=strategy.num_processes, local_rank=strategy.local_rank,
            num_nodes=strategy.num_nodes, num_parameters=sum(getattr(p, "ds_numel", p.numel()) for p in parameters),
            parameter_numels=tuple(getattr(p, "ds_numel", p.numel()) for p in parameters if p.requires_grad),
        )

    @property
    def sub_group_size(self) -> Optional[int]:
        """ZeRO-3's configured sub-group size (the unit of a partial offload); None below ZeRO-3 or where unset."""
        return self.spec.sub_group_size if self.spec.zero3 else None


def check(run: PlannedRun, environ: Mapping[str, str] = os.environ) -> list[Finding]:
    return [
        *_interconnect(run),
        _numa(run),
        *_nccl(run, environ),
        _allocator(environ),
        *_host_resources(run),
        *_partial_offload(run),
        _accumulation_precision(run),
    ]


def format_report(findings: Sequence[Finding], title: str = "lightning_ulysses preflight") -> str:
    width = max(len(f.topic) for f in findings)
    lines = [f"{title}:"]
    for finding in findings:
        lines.append(f"  [{finding.level:7}] {finding.topic:{width}}  {finding.detail}")
        if finding.advice:
            lines.append(f"            {'':{width}}  → {finding.advice}")
    return "\n".join(lines)


# -- GPU interconnect ----------------------------------------------------------------------------------------------
def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """`nvidia-smi topo -m` → {(gpu_a, gpu_b): link}, links like "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"."""
    # nvidia-smi underlines the header with terminal escapes even into a pipe (seen on the H200 machines).
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line for line in text.splitlines() if line.strip()]
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        return {}
    gpus = [name for name in header if re.fullmatch(r"GPU\d+", name)]
    links = {}
    for line in lines:
        cells = line.split()
        if cells and re.fullmatch(r"GPU\d+", cells[0]) and cells != header:
            row = int(cells[0][3:])
            for column, cell in zip(gpus, cells[1 : 1 + len(gpus)]):
                if cell != "X":
                    links[(row, int(column[3:]))] = cell
    return links


def _interconnect(run: PlannedRun) -> list[Finding]:
    if not torch.cuda.is_available():
        return [Finding("interconnect", "ok", "no CUDA devices: nothing to check (CPU/gloo run)")]
    # SP groups are blocks of consecutive ranks; local ranks map to local devices.
    size = min(run.spec.sequence_parallel_size, run.local_world_size)
    first = (run.local_rank // size) * size
    devices = list(range(first, first + size))
    if len(devices) < 2:
        return [Finding("interconnect", "ok", "one GPU per SP group on this node: no link inside the group")]
    topology = _nvidia_smi_topology()
    slow = []
    for a in devices:
        for b in devices:
            if a < b:
                link = topology.get((a, b))
                if link is None:  # no nvidia-smi: at least tell whether peer access works
                    link = "P2P" if torch.cuda.can_device_access_peer(a, b) else "no-P2P"
                if not link.startswith("NV"):
                    slow.append(f"GPU{a}-GPU{b}: {link}")
    if not slow:
        return [Finding("interconnect", "ok", f"SP group GPUs {devices} are joined by NVLink")]
    return [Finding(
        "interconnect", "warning", f"SP group GPUs {devices} are not all NVLink-connected ({', '.join(slow)})",
        "every attention layer runs four all-to-alls inside the SP group; over PCIe they take several times longer"
        " and share the link with host transfers (offload), so step times swing. Keep SP groups on NVLink-connected"
        " GPUs (a smaller sequence_parallel_size, or CUDA_VISIBLE_DEVICES ordered by NVLink domain).",
    )]


def _nvidia_smi_topology() -> dict[tuple[int, int], str]:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return {}
    try:
        text = subprocess.run([executable, "topo", "-m"], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_topology(text)


def _numa(run: PlannedRun) -> Finding:
    if not torch.cuda.is_available() or not hasattr(os, "sched_getaffinity"):
        return Finding("numa", "ok", "no CUDA devices or no CPU affinity information")
    device = run.local_rank % torch.cuda.device_count()
    properties = torch.cuda.get_device_properties(device)
    bus = f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"
    try:
        gpu_node = int(open(f"/sys/bus/pci/devices/{bus}/numa_node").read())
    except (OSError, ValueError):
        return Finding("numa", "ok", f"GPU{device} ({bus}): NUMA node unknown")
    cpu_nodes = _numa_nodes_of(os.sched_getaffinity(0))
    if gpu_node < 0 or not cpu_nodes or cpu_nodes == {gpu_node}:
        return Finding("numa", "ok", f"GPU{device} on NUMA node {gpu_node}; this rank's CPUs on {sorted(cpu_nodes)}")
    return Finding(
        "numa", "advice", f"GPU{device} is on NUMA node {gpu_node}; this rank may run on CPUs of nodes {sorted(cpu_nodes)}",
        f"bind each rank to its GPU's NUMA node (e.g. `numactl --cpunodebind={gpu_node} --membind={gpu_node}`):"
        " host-to-device copies (offload, pinned buffers) cross the socket link otherwise.",
    )


def _numa_nodes_of(cpus: set[int]) -> set[int]:
    nodes = set()
    root = "/sys/devices/system/node"
    if not os.path.isdir(root):
        return nodes
    for entry in os.listdir(root):
        if re.fullmatch(r"node\d+", entry):
            if cpus & _parse_cpu_list(open(f"{root}/{entry}/cpulist").read()):
                nodes.add(int(entry[4:]))
    return nodes


def _parse_cpu_list(text: str) -> set[int]:
    cpus = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            cpus.update(range(int(low), int(high) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


# -- NCCL and the allocator --------------------------------------------------------------------------------------
def _nccl(run: PlannedRun, environ: Mapping[str, str]) -> list[Finding]:
    settings = {key: value for key, value in environ.items() if key.startswith("NCCL_")}
    findings = [Finding("nccl", "ok", "in force: " + (", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
                                                      or "none set (NCCL's defaults)"))]
    if settings.get("NCCL_P2P_DISABLE") == "1":
        findings.append(Finding("nccl", "warning", "NCCL_P2P_DISABLE=1: GPU-to-GPU copies go through host memory",
                                "unset it: the all-to-alls inside SP groups lose NVLink/PCIe peer-to-peer bandwidth."))
    if "NCCL_ALGO" in settings:
        findings.append(Finding("nccl", "advice", f"NCCL_ALGO={settings['NCCL_ALGO']} forces one algorithm for every"
                                " collective", "keep it only if measured on this cluster: ZeRO's all-gathers and"
                                " reduce-scatters may be slower with it; all-to-all is unaffected."))
    buffer = settings.get("NCCL_BUFFSIZE")
    if buffer is not None and buffer.isdigit() and int(buffer) < 4 * 1024**2:
        findings.append(Finding("nccl", "advice", f"NCCL_BUFFSIZE={buffer} is below NCCL's 4 MiB default",
                                "large all-to-alls of long sequences pipeline better with the default or larger."))
    if run.num_nodes > 1 and settings.get("NCCL_IB_DISABLE") == "1":
        findings.append(Finding("nccl", "warning", "NCCL_IB_DISABLE=1 on a multi-node run: inter-node traffic uses"
                                " TCP sockets", "unset it unless the nodes have no InfiniBand/RoCE."))
    return findings


def _allocator(environ: Mapping[str, str]) -> Finding:
    setting = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF") or ""
    if "expandable_segments:true" in setting.replace(" ", "").lower():
        return Finding("allocator", "ok", f"expandable segments on ({setting})")
    if not torch.cuda.is_available():
        return Finding("allocator", "ok", "no CUDA devices")
    return Finding(
        "allocator", "advice", f"expandable segments off ({setting or 'PYTORCH_CUDA_ALLOC_CONF unset'})",
        "long sequences allocate many large tensors of changing sizes; out-of-memory errors that report GiBs"
        " 'reserved but unallocated' are fragmentation, fixed by PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        " (set before the first CUDA allocation).",
    )


# -- host resources for offload ------------------------------------------------------------------------------------
def _host_resources(run: PlannedRun) -> list[Finding]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores_per_rank = cores / max(1, run.local_world_size) if cores == (os.cpu_count() or cores) else cores
    available = _memory_available()
    findings = []
    per_rank_gib = available / GIB / max(1, run.local_world_size) if available else None
    ram = f"{per_rank_gib:.1f} GiB free RAM per rank" if per_rank_gib is not None else "free RAM unknown"
    detail = f"{cores_per_rank:.3g} CPU cores and {ram} ({run.local_world_size} ranks on this node)"
    if not (run.spec.offloads_optimizer or run.spec.offloads_parameters):
        return [Finding("host", "ok", detail + "; no offload")]
    findings.append(Finding("host", "ok", detail))
    if run.spec.offloads_optimizer and cores_per_rank < MIN_CORES_PER_RANK_FOR_CPU_ADAM:
        findings.append(Finding(
            "host", "warning", f"optimizer offload with {cores_per_rank:.3g} cores per rank",
            f"DeepSpeed's CPU Adam runs on the rank's cores; below {MIN_CORES_PER_RANK_FOR_CPU_ADAM} per rank its step"
            " dominates the step time. Give each rank more cores (fewer ranks per node, or pin ranks to disjoint core"
            " sets), or offload only part of the optimizer (zero_optimization.offload_optimizer.ratio).",
        ))
    if run.num_parameters and per_rank_gib is not None:
        needed, basis = _offload_host_bytes(run)
        needed_gib = needed / GIB
        level = "warning" if needed_gib > per_rank_gib else "ok"
        findings.append(Finding(
            "host", level, f"offload needs {needed_gib:.1f} GiB per rank ({basis}), {per_rank_gib:.1f} GiB free",
            "" if level == "ok" else "the run will be killed by the OOM killer mid-training: add nodes, offload only"
            " part of the optimizer (offload_optimizer.ratio), or keep parameters on the GPU.",
        ))
    return findings


def _offload_host_bytes(run: PlannedRun) -> tuple[float, str]:
    """Host bytes per rank that the offload will hold, and how they were counted."""
    parameters = PARAMETER_OFFLOAD_BYTES_PER_PARAMETER * run.num_parameters / run.spec.world_size if (
        run.spec.offloads_parameters) else 0.0
    if not run.spec.offloads_optimizer:
        return parameters, f"16-bit parameters: {run.num_parameters / 1e9:.2f}B × 2 B / {run.spec.world_size} ranks"
    if run.parameter_numels is None or run.spec.zero_stage == 0:
        per_parameter = OPTIMIZER_OFFLOAD_BYTES_PER_PARAMETER + (
            PARAMETER_OFFLOAD_BYTES_PER_PARAMETER if run.spec.offloads_parameters else 0)
        return (run.num_parameters * per_parameter / run.spec.world_size,
                f"{run.num_parameters / 1e9:.2f}B parameters × {per_parameter} B / {run.spec.world_size} ranks")
    # ZeRO-1/2 offload the optimizer whole; a ratio splits ZeRO-3's sub-groups (see _partial_offload).
    share = run.spec.optimizer_share_on_host
    optimizer = sum(optimizer_offload_host_bytes(run.parameter_numels, _training_setup(run, share)).values())
    basis = ("DeepSpeed's offload buffers: fp32 master + Adam m, v and fp32 gradients of the host sub-groups"
             + (", 16-bit gradients of all parameters" if run.spec.zero3 else "")
             + (", pinned blocks rounded up to powers of two" if run.spec.optimizer_offload_pin_memory else "")
             + (", 16-bit parameters" if run.spec.offloads_parameters else ""))
    return optimizer + parameters, basis


def _training_setup(run: PlannedRun, offload_ratio: float) -> TrainingSetup:
    """The planner's view of the run's model states (lengths do not matter for them)."""
    return TrainingSetup.of_run(run.spec, 1, offload_optimizer=offload_ratio,
                                sub_group_size=run.sub_group_size or TrainingSetup.sub_group_size)


def _partial_offload(run: PlannedRun) -> list[Finding]:
    """DeepSpeed (ZeRO-3) splits the optimizer by *count* of sub-groups: sub-groups `i >= int((1 - ratio) · n)` go to
    the host (`runtime/zero/stage3.py`). With one sub-group (Lightning's `sub_group_size` is 1e12) any ratio > 0
    offloads all of it, so a partial offload silently becomes a full one (the planner counts the same way)."""
    ratio = run.spec.optimizer_offload_ratio
    if not (run.spec.offloads_optimizer and ratio is not None and ratio < 1 and run.num_parameters
            and run.sub_group_size):
        return []
    local = math.ceil(run.num_parameters / run.spec.world_size)
    if run.parameter_numels is not None:  # exact: a sub-group closes at the first parameter tensor that fills it
        groups = len(sub_groups_of(run.parameter_numels, _training_setup(run, ratio)))
    else:  # from a parameter count alone: about
        groups = math.ceil(local / run.sub_group_size)
    on_host = groups - int((1 - ratio) * groups)
    summary = (f"offload_optimizer.ratio={ratio:g}: {on_host} of {groups} optimizer sub-group(s) on the"
               f" host (sub_group_size={run.sub_group_size:.3g}, {local / 1e9:.2f}B parameters per rank)")
    if on_host < groups:
        return [Finding("offload", "ok", summary)]
    return [Finding("offload", "warning", summary,
                    f"the whole optimizer goes to the host. Set zero_optimization.sub_group_size to about"
                    f" {max(1, local // 32):.3g} (some 32 sub-groups) so the ratio can split it (e.g."
                    " UlyssesDeepSpeedStrategy(sub_group_size=...) or config_overrides).")]


def _memory_available() -> Optional[int]:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _accumulation_precision(run: PlannedRun) -> Finding:
    if run.spec.compute_bytes == 4:
        return Finding("precision", "ok", f"precision {run.spec.precision}: gradients accumulate in fp32")
    if (run.spec.grad_accum_dtype or "").lower() in ("fp32", "float32"):
        return Finding("precision", "ok", f"precision {run.spec.precision} with fp32 gradient accumulation")
    return Finding(
        "precision", "advice", f"precision {run.spec.precision}: gradients accumulate and reduce in 16 bits",
        "long runs (many micro-batches, many ranks) lose gradient bits and can blow up; accumulate in fp32 with"
        " config_overrides={'data_types': {'grad_accum_dtype': 'fp32'}} (the published 176B long-sequence setup).",
    )


# -- command line ------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ulysses preflight",
                                     description="Check this machine for a planned sequence-parallel run.")
    parser.add_argument("--sequence-parallel-size", type=int, default=None, help="default: GPUs on this machine")
    parser.add_argument("--devices", type=int, default=None, help="ranks on this node (default: GPUs, or 1)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--parameters", type=float, default=None, help="model size, e.g. 8e9")
    parser.add_argument("--offload-optimizer", action="store_true")
    parser.add_argument("--offload-parameters", action="store_true")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--grad-accum-dtype", default=None)
    args = parser.parse_args(argv)
    devices = args.devices or max(1, torch.cuda.device_count())
    spec = RunSpec(
        layout=ParallelLayout(world_size=devices * args.num_nodes,
                              sequence_parallel_size=args.sequence_parallel_size or devices),
        optimizer_offload_device="cpu" if args.offload_optimizer else None,
        parameter_offload_device="cpu" if args.offload_parameters else None, precision=args.precision,
        grad_accum_dtype=args.grad_accum_dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    run = PlannedRun(spec, local_world_size=devices, num_nodes=args.num_nodes,
                     num_parameters=int(args.parameters) if args.parameters else None)
    print(format_report(check(run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
