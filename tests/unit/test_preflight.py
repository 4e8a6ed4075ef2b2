"""Preflight findings from given settings (topology text, environment, planned run)."""

from __future__ import annotations

from lightning_ulysses.parallel.layout import ParallelLayout
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning import preflight
from lightning_ulysses.planning.preflight import PlannedRun


def planned(sequence_parallel_size, local_world_size, world_size, *, num_nodes=1, num_parameters=None,
            parameter_numels=None, **run) -> PlannedRun:
    """A planned run on `world_size` ranks, `local_world_size` of them on this node; `run`: `RunSpec` fields."""
    layout = ParallelLayout(world_size=world_size, sequence_parallel_size=sequence_parallel_size)
    return PlannedRun(RunSpec(layout=layout, **run), local_world_size=local_world_size, num_nodes=num_nodes,
                      num_parameters=num_parameters, parameter_numels=parameter_numels)

# `nvidia-smi topo -m` of a machine with two NVLink pairs joined over the CPU interconnect.
TOPOLOGY = """
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tSYS\tSYS\t0-31\t0\t\tN/A
GPU1\tNV18\t X \tSYS\tSYS\t0-31\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tNV18\t32-63\t1\t\tN/A
GPU3\tSYS\tSYS\tNV18\t X \t32-63\t1\t\tN/A

Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
"""


def test_topology_parsing():
    links = preflight.parse_topology(TOPOLOGY)
    assert links[(0, 1)] == links[(2, 3)] == "NV18"
    assert links[(1, 2)] == links[(3, 0)] == "SYS"
    assert (0, 0) not in links and len(links) == 12


def test_topology_parsing_of_real_output_with_terminal_escapes():
    # Verbatim from the lent 2 × H200 machine (benchmarks/results/2026-11-29-h200x2-attention-layer/topology.txt):
    # the header carries an underline escape that once made the check report NVLink GPUs as "P2P".
    text = "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \tNV18\t0-31\t0\t\tN/A\n" \
           "GPU1\tNV18\t X \t0-31\t0\t\tN/A\n"
    assert preflight.parse_topology(text) == {(0, 1): "NV18", (1, 0): "NV18"}


def levels(findings, topic):
    return [(f.level, f.detail) for f in findings if f.topic == topic]


def test_nccl_settings_that_hurt_are_named_with_the_fix():
    run = planned(sequence_parallel_size=8, local_world_size=8, world_size=16, num_nodes=2)
    findings = preflight._nccl(run, {"NCCL_P2P_DISABLE": "1", "NCCL_ALGO": "Ring", "NCCL_BUFFSIZE": "1048576",
                                     "NCCL_IB_DISABLE": "1"})
    assert [f.level for f in findings] == ["ok", "warning", "advice", "advice", "warning"]
    assert "NCCL_ALGO=Ring" in findings[0].detail and all(f.advice for f in findings[1:])
    assert [f.level for f in preflight._nccl(run, {})] == ["ok"]


def test_allocator_advice_unless_expandable_segments():
    assert preflight._allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).level == "ok"


def test_offload_memory_and_cores_are_checked_against_the_model(monkeypatch):
    monkeypatch.setattr(preflight, "_memory_available", lambda: 64 * preflight.GIB)
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 16)
    run = planned(sequence_parallel_size=8, local_world_size=8, world_size=8, num_parameters=8_000_000_000,
                     optimizer_offload_device="cpu")
    findings = preflight._host_resources(run)
    # 8e9 × 16 B / 8 ranks = 14.9 GiB per rank against 64 / 8 = 8 GiB free; 16 cores / 8 ranks = 2 < 4.
    assert [f.level for f in findings] == ["ok", "warning", "warning"]
    assert "14.9 GiB per rank" in findings[2].detail and "8.0 GiB free" in findings[2].detail
    fits = planned(sequence_parallel_size=2, local_world_size=2, world_size=16, num_parameters=8_000_000_000,
                      optimizer_offload_device="cpu")
    assert [f.level for f in preflight._host_resources(fits)] == ["ok", "ok"]


def test_bf16_without_fp32_accumulation_gets_advice():
    bf16 = planned(sequence_parallel_size=1, local_world_size=1, world_size=1, precision="bf16-mixed")
    assert preflight._accumulation_precision(bf16).level == "advice"
    fp32_accumulation = planned(sequence_parallel_size=1, local_world_size=1, world_size=1,
                                   precision="bf16-mixed", grad_accum_dtype="fp32")
    assert preflight._accumulation_precision(fp32_accumulation).level == "ok"


def test_report_and_command(capsys):
    assert preflight.main(["--devices", "2", "--parameters", "1e9", "--offload-optimizer"]) == 0
    report = capsys.readouterr().out
    assert report.startswith("lightning_ulysses preflight:") and "[advice ] precision" in report


def test_partial_offload_with_one_sub_group_is_a_full_offload():
    """DeepSpeed splits the optimizer by sub-group count: Lightning's sub_group_size (1e12) leaves one sub-group, so
    ratio 0.3 offloads everything — warned with the fix; enough sub-groups split as asked."""
    run = dict(sequence_parallel_size=1, local_world_size=1, world_size=1, num_parameters=8_030_000_000,
               optimizer_offload_device="cpu", optimizer_offload_ratio=0.3)
    [one_group] = preflight._partial_offload(planned(**run, sub_group_size=10**12))
    assert one_group.level == "warning" and "1 of 1 optimizer sub-group(s) on the host" in one_group.detail
    assert "whole optimizer goes to the host" in one_group.advice and "sub_group_size to about 2.51e+08" in one_group.advice
    [split] = preflight._partial_offload(planned(**run, sub_group_size=2**28))
    assert split.level == "ok" and "9 of 30 optimizer sub-group(s)" in split.detail  # about: DeepSpeed closes a
    # sub-group at the first parameter that fills it (the planner follows that exactly: 8 of 26 for Llama 3 8B)
    assert preflight._partial_offload(planned(**{**run, "optimizer_offload_ratio": None}, sub_group_size=10**12)) == []
    # With the model's parameter tensors (the strategy passes them) the count is exact, as the planner's.
    from lightning_ulysses.planning.planner import MODELS

    numels = tuple(MODELS["llama3-8b"].parameter_numels())
    [exact] = preflight._partial_offload(planned(**run, sub_group_size=2**28, parameter_numels=numels, zero_stage=3))
    assert "8 of 26 optimizer sub-group(s)" in exact.detail


def test_offload_host_need_counts_deepspeeds_buffers(monkeypatch):
    """With the model's parameter tensors the host check counts DeepSpeed's own offload buffers (planner terms), not
    16 B per parameter: a full ZeRO-3 optimizer offload of the 8B shape needs fp32 master + Adam m, v (12 B), the fp32
    gradients and the 16-bit gradients of all parameters in pinned blocks rounded up to powers of two — 137.7 GiB,
    which 125 GiB of free RAM does not hold although the old 16 B/parameter estimate (119.7 GiB) said it did."""
    from lightning_ulysses.planning.planner import MODELS, TrainingSetup, plan_memory

    monkeypatch.setattr(preflight, "_memory_available", lambda: 125 * preflight.GIB)
    numels = tuple(MODELS["llama3-8b"].parameter_numels())
    n = sum(numels)
    block = lambda nbytes: 1 << (nbytes - 1).bit_length()  # noqa: E731  (pinned host blocks)
    full = dict(sequence_parallel_size=1, local_world_size=1, world_size=1, num_parameters=n, optimizer_offload_device="cpu",
                precision="bf16-mixed", sub_group_size=10**12)
    old = preflight._host_resources(planned(**full))[-1]
    assert old.level == "ok" and "119.7 GiB per rank" in old.detail and "× 16 B" in old.detail
    new = preflight._host_resources(planned(**full, parameter_numels=numels, zero_stage=3))[-1]
    expected = (12 * n + block(4 * n) + block(2 * n)) / preflight.GIB
    assert f"{expected:.1f} GiB per rank" in new.detail and "DeepSpeed's offload buffers" in new.detail
    assert new.level == "warning" and "OOM killer" in new.advice and round(expected, 1) == 137.7
    # A partial offload (ratio 0.45 over sub-groups of 2.09e8, the measured one-GPU 360K configuration) counts
    # exactly the optimizer terms the planner counts for that run, on the same split.
    partial = planned(**{**full, "sub_group_size": 209_000_000}, optimizer_offload_ratio=0.45, parameter_numels=numels,
                         zero_stage=3)
    needed, _ = preflight._offload_host_bytes(partial)
    plan = plan_memory(MODELS["llama3-8b"], TrainingSetup(seq_len=360_448, offload_optimizer=0.45,
                                                          sub_group_size=209_000_000))
    not_optimizer = ("process baseline", "checkpointed layer inputs", "kept attention outputs", "largest host transient")
    assert needed == sum(v for k, v in plan.host.items() if not k.startswith(not_optimizer))
    # Unpinned buffers are not rounded up; ZeRO-2 offloads its one partition whole whatever the ratio.
    unpinned, _ = preflight._offload_host_bytes(planned(**full, parameter_numels=numels, zero_stage=3,
                                                            optimizer_offload_pin_memory=False))
    assert unpinned == 12 * n + 4 * n + 2 * n
    zero2, basis = preflight._offload_host_bytes(planned(**{**full, "optimizer_offload_ratio": 0.3}, parameter_numels=numels,
                                                            zero_stage=2, optimizer_offload_pin_memory=False))
    assert zero2 == 16 * n and "16-bit gradients" not in basis
