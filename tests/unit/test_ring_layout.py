"""The Ulysses × ring split of an SP group, the zig-zag shard order and the automatic ring size (one process)."""

import pytest
import torch

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.attention.core import resolve_ring_size
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.parallel.layout import ParallelLayout, ShardOrder


def test_ulysses_is_the_inner_contiguous_dimension():
    layout = ParallelLayout(world_size=8, sequence_parallel_size=4, ring_size=2)
    assert layout.ulysses_size == 2
    assert layout.ulysses_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.ring_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.sequence_parallel_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # unchanged by the split
    assert str(layout) == "dp(2) × sp(4) = world_size(8), sp = ulysses(2) × ring(2)"


@pytest.mark.parametrize("ring_size", [3, 0, 1.5, True])
def test_ring_size_must_divide_the_sp_size(ring_size):
    with pytest.raises(ValueError, match=r"ring_size"):
        ParallelLayout(world_size=4, sequence_parallel_size=4, ring_size=ring_size)
    with pytest.raises(ValueError, match=r"ring_size\(3\) does not divide sequence_parallel_size\(4\).*\[1, 2, 4\]"):
        ParallelLayout(world_size=4, sequence_parallel_size=4, ring_size=3)


def test_strategy_rejects_a_ring_size_that_does_not_divide_the_sp_size():
    with pytest.raises(ValueError, match=r"Use a ring_size in \[1, 2, 4\]"):
        UlyssesDeepSpeedStrategy(sequence_parallel_size=4, ring_size=3)


@pytest.mark.parametrize(("sp", "ring"), [(4, 1), (4, 2), (4, 4), (2, 2), (6, 2), (6, 3), (8, 2)])
def test_shard_order_is_a_zig_zag_partition(sp, ring):
    order = ShardOrder(sp, ring)
    seq_len = 2 * order.length_multiple
    shards = [order.positions(seq_len, rank) for rank in range(sp)]
    assert all(len(s) == seq_len // sp for s in shards)
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(seq_len))  # every position exactly once
    assert torch.equal(order.restore(torch.cat(shards), dim=0), torch.arange(seq_len))
    chunk = seq_len // (2 * ring) if ring > 1 else seq_len
    for ring_rank in range(ring):
        # The Ulysses ranks of one ring rank hold exactly chunks r and 2R-1-r (the whole sequence without a ring).
        held = torch.cat(shards[ring_rank * (sp // ring):(ring_rank + 1) * (sp // ring)])
        expected = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk)
        if ring > 1:
            mirror = 2 * ring - 1 - ring_rank
            expected = torch.cat([expected, torch.arange(mirror * chunk, (mirror + 1) * chunk)])
        assert torch.equal(held, expected)


def test_without_ring_shards_stay_contiguous():
    assert [ShardOrder(4).runs(8, rank) for rank in range(4)] == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]


def test_causal_work_is_balanced_over_the_ring():
    order, seq_len = ShardOrder(4, 4), 64
    # Number of (query, key) pairs with key <= query that each ring rank's queries own.
    work = [int((order.positions(seq_len, rank) + 1).sum()) for rank in range(4)]
    assert len(set(work)) == 1


def test_sharder_pads_to_the_zig_zag_multiple_and_cuts_every_key_alike():
    input_ids = torch.arange(10).expand(2, -1)
    batch = {"input_ids": input_ids, "labels": input_ids + 100, "attention_mask": torch.ones_like(input_ids)}
    shards = [SequenceSharder(2, rank, ring_size=2)(batch) for rank in range(2)]
    order = ShardOrder(2, 2)  # lcm(2, 4) = 4: 10 tokens are padded to 12
    for rank, shard in enumerate(shards):
        positions = order.positions(12, rank)
        assert torch.equal(shard["position_ids"][0], positions)
        expected_ids = torch.where(positions < 10, positions, 0)
        assert torch.equal(shard["input_ids"][0], expected_ids)
        expected_labels = torch.where(positions < 10, positions + 100, -100)  # as given, padding ignored
        assert torch.equal(shard["labels"][0], expected_labels)
        assert torch.equal(shard["attention_mask"][0], (positions < 10).long())
    with pytest.raises(ValueError, match=r"2 × ring_size\(2\).*pad_to_multiple_of=4"):
        SequenceSharder(2, 0, sequence_padding="error", ring_size=2)(batch)


def test_automatic_ring_size_prefers_ulysses():
    assert resolve_ring_size([(32, 8)], 8, None) == 1  # heads split evenly: pure Ulysses
    assert resolve_ring_size([(4, 1)], 4, None) == 1  # KV replication still allows Ulysses
    assert resolve_ring_size([(2, 2)], 4, None) == 2  # 2 heads at SP 4: Ulysses 2 × ring 2
    assert resolve_ring_size([(32, 8)], 64, None) == 2  # SP beyond the heads
    assert resolve_ring_size([(3, 3)], 2, None) == 2  # no Ulysses split at all: pure ring
    assert resolve_ring_size([(4, 4), (2, 2)], 4, None) == 2  # every model must allow the Ulysses degree
    assert resolve_ring_size([], 4, None) == 1  # nothing declared: pure Ulysses (validated at the first forward)


def test_explicit_ring_size_is_checked_against_the_heads():
    assert resolve_ring_size([(4, 2)], 4, 2) == 2
    with pytest.raises(ValueError, match=r"ring_size\(1\) leaves ulysses_size.*= 4.*Use a ring_size in \[2, 4\].*here 2"):
        resolve_ring_size([(2, 2)], 4, 1)
    with pytest.raises(ValueError, match=r"must be a multiple of num_key_value_heads"):
        resolve_ring_size([(4, 3)], 4, None)


def test_sharder_keeps_each_tokens_own_position_in_zig_zag_order():
    # Packed positions (which the ring then refuses) and continuing ones: every token keeps the position it had in
    # the whole row, and the shards put back in natural order give the row again.
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]])
    batch = {"input_ids": torch.arange(8).expand(2, -1), "position_ids": positions}
    order = ShardOrder(2, 2)
    shards = [SequenceSharder(2, rank, ring_size=2)(batch) for rank in range(2)]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard["position_ids"], positions[:, order.positions(8, rank)])
    assert torch.equal(order.restore(torch.cat([s["position_ids"] for s in shards], dim=1), dim=1), positions)
