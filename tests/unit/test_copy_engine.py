"""The copy-engine exchange (`attention/copy_engine.py`) without processes: the plan by hand, every rank's plan
simulated in one process against the collective all-to-all's arithmetic, and the transport selection."""

import logging

import pytest
import torch

from lightning_ulysses.attention import copy_engine
from lightning_ulysses.attention.copy_engine import (CollectiveTransport, Copy2D, CopyEngineProbe, PeerCopy,
                                                     block_copies, choose_exchange, copies_2d, plan_exchange)


def test_hand_computed_plan():
    # [batch 1, heads 4, seq 2, dim 1] at SP 2, rank 1, heads scattered, tokens gathered: output [1, 2, 4, 1]
    plan = plan_exchange((1, 4, 2, 1), (8, 2, 1, 1), split_dim=1, join_dim=2, size=2, rank=1)
    assert plan.output_shape == (1, 2, 4, 1)
    assert plan.copies == (
        PeerCopy(0, (1, 2, 2, 1), 0, (8, 2, 1, 1), 2, (8, 4, 1, 1)),  # heads 0-1 → peer 0, its tokens 2-3
        PeerCopy(1, (1, 2, 2, 1), 4, (8, 2, 1, 1), 2, (8, 4, 1, 1)),  # heads 2-3 → peer 1 (myself)
    )
    # one 2-D strided copy per peer: 2 head rows of 2 tokens, written with a pitch of 4 (the whole sequence)
    assert plan.copies[0].blocks() == ((2, 2), (2, 1), (4, 1))
    # in fp32 bytes: one cudaMemcpy2DAsync, rows of 8 bytes read with a pitch of 8, written with 16 from byte 8
    assert copies_2d(plan.copies[0], 4) == [Copy2D(0, 8, 8, 16, 8, 2)]
    assert copies_2d(plan.copies[1], 4) == [Copy2D(16, 8, 8, 16, 8, 2)]


def test_blocks_merge_what_is_contiguous_on_both_sides():
    # pieces contiguous on both sides (split and join along the outermost dimension): one memcpy
    plan = plan_exchange((4, 3, 2), (6, 2, 1), split_dim=0, join_dim=0, size=2, rank=1)
    assert plan.copies[0].blocks() == ((12,), (1,), (1,)) and plan.copies[0].destination_offset == 12
    # the output's way back at batch 1, [1, seq, heads/P, d] → [1, seq/P, heads, d]: 4 token rows of 2 heads × 3,
    # read contiguously, written with a pitch of all 4 heads
    plan = plan_exchange((1, 8, 2, 3), (48, 6, 3, 1), split_dim=1, join_dim=2, size=2, rank=1)
    assert plan.copies[0].blocks() == ((4, 6), (6, 1), (12, 1)) and plan.copies[0].destination_offset == 6
    # batch 2: one 2-D copy per batch row
    plan = plan_exchange((2, 4, 2, 3), (24, 6, 3, 1), split_dim=1, join_dim=2, size=2, rank=0)
    assert plan.copies[0].blocks() == ((2, 2, 6), (24, 6, 1), (24, 12, 1))
    assert copies_2d(plan.copies[0], 2) == [Copy2D(0, 12, 0, 24, 12, 2), Copy2D(48, 12, 48, 24, 12, 2)]  # per batch row
    # one contiguous block: one call of one row
    assert copies_2d(plan_exchange((4, 3), (3, 1), 0, 0, 2, 1).copies[1], 4) == [Copy2D(24, 24, 24, 24, 24, 1)]


def simulate(inputs, split_dim, join_dim):
    """Every rank's plan executed into every peer's buffer, as the copy engine would."""
    size = len(inputs)
    plans = [plan_exchange(x.shape, x.stride(), split_dim, join_dim, size, r) for r, x in enumerate(inputs)]
    buffers = [torch.full(plans[0].output_shape, float("nan")) for _ in range(size)]
    for x, plan in zip(inputs, plans):
        for copy in plan.copies:
            block_copies(buffers[copy.peer], x, copy)
    return buffers


def collective(inputs, split_dim, join_dim):
    """`CollectiveTransport`'s arithmetic: rank p receives piece p of every rank, stacked, then joined."""
    size, transport = len(inputs), CollectiveTransport()
    rows = [x.unflatten(split_dim, (size, -1)).movedim(split_dim, 0) for x in inputs]
    return [transport.join(torch.stack([rows[r][p] for r in range(size)]), join_dim).contiguous()
            for p in range(size)]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("shape,split_dim,join_dim", [
    ((1, 8, 3, 5), 1, 2),  # [b, heads, seq/P, d] → [b, heads/P, seq, d]
    ((3, 8, 3, 5), 1, 2),  # batch > 1
    ((2, 8, 6, 5), 1, 2),  # back: [b, seq, heads/P, d] → [b, seq/P, heads, d] (tokens scattered, heads gathered)
    ((2, 8, 4, 5), 2, 1),  # the backward's reverse exchanges
    ((2, 3, 8, 5), 2, 1),
    ((2, 3, 8, 2, 3), 2, 3),  # several outer dimensions around the 2-D copies
])
def test_plan_equals_the_collective_exchange(shape, split_dim, join_dim, size):
    generator = torch.Generator().manual_seed(size)
    inputs = [torch.randn(shape, generator=generator) for _ in range(size)]
    for got, expected in zip(simulate(inputs, split_dim, join_dim), collective(inputs, split_dim, join_dim)):
        assert torch.equal(got, expected)


def test_plan_reads_strided_sources():
    # a head group of q: `chunk` along the heads leaves a non-contiguous view, read through its own strides
    full = [torch.randn(2, 8, 4, 3) for _ in range(2)]
    groups = [x.chunk(2, dim=1)[1] for x in full]
    assert not groups[0].is_contiguous()
    for got, expected in zip(simulate(groups, 1, 2), collective([g.contiguous() for g in groups], 1, 2)):
        assert torch.equal(got, expected)


def test_strided_last_dimension_copies_one_element_rows():
    # a source whose last dimension is strided: rows one element wide, still exact
    inputs = [torch.randn(2, 4, 3, 5).transpose(-1, -2) for _ in range(2)]
    plan = plan_exchange(inputs[0].shape, inputs[0].stride(), 1, 2, 2, 0)
    assert copies_2d(plan.copies[0], 4)[0].width == 4
    for got, expected in zip(simulate(inputs, 1, 2), collective([x.contiguous() for x in inputs], 1, 2)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_byte_copies_equal_torch_strided_copies(dtype):
    # the 2-D byte copies (what cudaMemcpy2DAsync would be given) against torch's own strided copy of the views
    source = torch.arange(3 * 8 * 4 * 4).reshape(3, 8, 4, 4).to(dtype)[:, 2:6]  # offset and strided
    copies = [copy for rank in range(2) for split_dim, join_dim in ((1, 2), (2, 1))
              for copy in plan_exchange(source.shape, source.stride(), split_dim, join_dim, 2, rank).copies]
    for copy in copies:
        end = copy.destination_offset + sum((n - 1) * d for n, d in zip(copy.sizes, copy.destination_strides)) + 1
        got, expected = torch.zeros(end, dtype=dtype), torch.zeros(end, dtype=dtype)
        block_copies(got, source, copy)
        copy_engine.destination_view(expected, copy).copy_(copy_engine.source_view(source, copy))
        assert torch.equal(got, expected) and expected.count_nonzero() > 0


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="not divisible by 2"):
        plan_exchange((1, 3, 4, 2), (24, 8, 2, 1), 1, 2, 2, 0)


PROBE = dict(cuda=True, group_on_one_host=True, peer_access=True, symmetric_memory=True, multicast_off=True)


@pytest.mark.parametrize("missing,reason", [
    ("group_on_one_host", "spans hosts"), ("peer_access", "no peer-to-peer access"),
    ("symmetric_memory", "symmetric memory"), ("multicast_off", "NCCL_NVLS_ENABLE=0"),
])
def test_selection_falls_back_with_one_line_or_refuses(missing, reason, caplog):
    failure = CopyEngineProbe(**dict(PROBE, **{missing: False})).failure()
    with caplog.at_level(logging.INFO, logger=copy_engine.__name__):
        assert choose_exchange("auto", failure) == "nccl"
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()
    with pytest.raises(RuntimeError, match=f'{reason}.*Use exchange="nccl"'):
        choose_exchange("copy_engine", failure)
    assert choose_exchange("nccl", failure) == "nccl"


def test_selection_where_it_can_run_and_on_cpu(caplog):
    assert choose_exchange("auto", CopyEngineProbe(**PROBE).failure()) == "copy_engine"
    assert choose_exchange("copy_engine", 0) == "copy_engine"
    assert choose_exchange("nccl", 0) == "nccl"
    cpu = CopyEngineProbe(**dict(PROBE, cuda=False)).failure()
    with caplog.at_level(logging.INFO, logger=copy_engine.__name__):
        assert choose_exchange("auto", cpu) == "nccl"  # gloo's all-to-all as always, without a line
    assert not caplog.records
    with pytest.raises(RuntimeError, match='not on CUDA devices. Use exchange="nccl"'):
        choose_exchange("copy_engine", cpu)
    with pytest.raises(ValueError, match="exchange must be one of"):
        choose_exchange("nvlink", 0)


def test_multicast_must_be_off_as_given():
    on = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert copy_engine.multicast_is_off(on)
    assert not copy_engine.multicast_is_off(dict(on, NCCL_NVLS_ENABLE="1"))
    assert not copy_engine.multicast_is_off({k: v for k, v in on.items() if k != "NVSHMEM_DISABLE_NVLS"})


class _Groups:
    ulysses_group, ulysses_size = "sp-group", 2


def decide(monkeypatch, requested, accelerator, ranks=(0, 1), failure=None, probe=None):
    """`UlyssesDeepSpeedStrategy._agree_transport` on a stand-in strategy, the probe and the all-reduce faked; the
    stand-in keeps the transport it returns as `transport`."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    from lightning_ulysses.integration import strategy as strategy_module

    seen = {}
    monkeypatch.setattr(strategy_module.torch.distributed, "get_process_group_ranks", lambda group: list(ranks))
    monkeypatch.setattr(copy_engine, "probe_copy_engine",
                        lambda devices, on_host: seen.setdefault("probe", (devices, on_host)) and probe)
    monkeypatch.setattr(copy_engine, "agreed_failure", lambda p, group, device: failure)
    fake = type("Fake", (), {})()
    fake.parallel_groups, fake._requested_exchange = _Groups(), requested
    fake.accelerator = CUDAAccelerator() if accelerator == "cuda" else CPUAccelerator()
    fake.node_rank, fake.num_processes, fake.global_rank = 0, 2, 0
    fake.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    fake.root_device = torch.device("cuda", 0)
    fake.transport = strategy_module.UlyssesDeepSpeedStrategy._agree_transport(fake)
    return fake, seen


def test_strategy_takes_the_agreed_copy_engine(monkeypatch):
    fake, seen = decide(monkeypatch, "auto", "cuda", failure=0)
    assert fake.exchange == "copy_engine"
    assert seen["probe"] == ([torch.device("cuda", 0), torch.device("cuda", 1)], True)  # mine first, then the peer's
    # handed to this run's models (`SequenceParallelRuntime.transport`), set in no module global
    assert isinstance(fake.transport, copy_engine.SymmetricMemoryTransport)


def test_strategy_on_cpu_keeps_gloo_and_refuses_copy_engine(monkeypatch):
    fake, seen = decide(monkeypatch, "auto", "cpu")
    assert fake.exchange == "nccl" and "probe" not in seen and fake.transport is None  # no collective
    with pytest.raises(RuntimeError, match='not on CUDA devices. Use exchange="nccl"'):
        decide(monkeypatch, "copy_engine", "cpu")


def test_strategy_sees_a_group_across_hosts(monkeypatch):
    fake, seen = decide(monkeypatch, "auto", "cuda", ranks=(0, 2), failure=2)
    assert seen["probe"] == ([torch.device("cuda", 0)], False) and fake.exchange == "nccl" and fake.transport is None
    with pytest.raises(RuntimeError, match="spans hosts"):
        decide(monkeypatch, "copy_engine", "cuda", ranks=(0, 2), failure=2)


def test_strategy_exchange_argument_is_checked():
    from lightning_ulysses import UlyssesDeepSpeedStrategy

    # NCCL by default until the copy engine has run on GPUs; "auto" and "copy_engine" are asked for by name.
    assert UlyssesDeepSpeedStrategy()._requested_exchange == "nccl"
    assert UlyssesDeepSpeedStrategy(exchange="auto")._requested_exchange == "auto"
    with pytest.raises(ValueError, match="exchange must be one of"):
        UlyssesDeepSpeedStrategy(exchange="nvlink")
