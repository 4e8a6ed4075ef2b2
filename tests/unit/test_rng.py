"""The SP ranks' random streams (`lightning_ulysses.integration.rng`), one process: each SP rank's steps draw their own values,
the shared stream stays where it was, runs with the same seed draw the same, checkpoints keep both streams."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.integration.rng import STATE_KEY, SequenceParallelRNG, next_shared_value, stream_seed

CPU = torch.device("cpu")


def _streams(sp_rank: int, sp_size: int = 2, seed: int = 7) -> SequenceParallelRNG:
    torch.manual_seed(seed)  # what Lightning's reset_seed does before the strategy resets the streams
    streams = SequenceParallelRNG()
    streams.reset(sp_rank, sp_size, CPU)
    return streams


def _in_step(streams: SequenceParallelRNG, n: int = 8) -> torch.Tensor:
    with streams.steps():
        return torch.rand(n)


def test_each_sp_rank_draws_its_own_values_and_the_shared_stream_does_not_move():
    ranks = [_streams(rank) for rank in range(4)]
    torch.manual_seed(7)
    draws = [_in_step(streams) for streams in ranks]
    assert all(not torch.equal(draws[i], draws[j]) for i in range(4) for j in range(i))
    # Nothing drawn inside a step came from the shared stream: it gives what a fresh seed 7 gives.
    after = torch.rand(8)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(8))


def test_the_own_stream_continues_from_step_to_step_and_repeats_with_the_seed():
    first = _streams(1)
    steps = [_in_step(first) for _ in range(3)]
    assert not torch.equal(steps[0], steps[1])
    again = _streams(1)  # another run, or a second fit: set up again after the same seed
    assert all(torch.equal(_in_step(again), step) for step in steps)
    assert not torch.equal(_in_step(_streams(1, seed=8)), steps[0])  # another seed, other masks


def test_sp_size_one_keeps_lightnings_single_stream():
    streams = _streams(0, sp_size=1)
    inside = _in_step(streams)
    torch.manual_seed(7)
    assert torch.equal(inside, torch.rand(8))
    assert STATE_KEY not in streams.collect()


def test_the_seed_is_read_from_the_shared_stream_without_drawing_from_it():
    torch.manual_seed(3)
    value = next_shared_value()
    assert value == next_shared_value()
    torch.manual_seed(3)
    before = torch.rand(4)
    torch.manual_seed(3)
    next_shared_value()
    assert torch.equal(torch.rand(4), before)
    assert len({stream_seed(value, rank) for rank in range(8)}) == 8
    assert stream_seed(value, 1) == stream_seed(value, 1)


def test_steps_are_reentrant_and_restore_the_shared_stream_when_they_raise():
    streams = _streams(1)
    torch.manual_seed(5)
    with streams.steps():
        with streams.steps():  # a manual_backward inside a training step
            inner = torch.rand(4)
        outer = torch.rand(4)
    expected = _streams(1)
    torch.manual_seed(5)
    assert torch.equal(_in_step(expected, 4), inner) and torch.equal(_in_step(expected, 4), outer)
    with pytest.raises(ValueError), streams.steps():
        raise ValueError("a failing step")
    assert not streams.active
    assert torch.equal(torch.rand(4), _shared_after_seed(5))


def _shared_after_seed(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.rand(4)


def test_collect_and_restore_give_back_both_streams_also_when_collected_inside_a_step():
    streams = _streams(1)
    _in_step(streams)
    saved = streams.collect()
    with streams.steps():
        assert _same_states(streams.collect(), saved)  # a save from inside a step keeps the same states
    expected_own, expected_shared = _in_step(streams), torch.rand(4)
    streams.restore(saved)
    assert torch.equal(_in_step(streams), expected_own)
    assert torch.equal(torch.rand(4), expected_shared)
    with pytest.raises(RuntimeError, match="inside a step"), streams.steps():
        streams.restore(saved)


def _same_states(a: dict, b: dict) -> bool:
    return (torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
            and torch.equal(a[STATE_KEY]["torch"], b[STATE_KEY]["torch"]))


def test_a_checkpoint_without_the_own_stream_leaves_the_seeded_one():
    streams = _streams(1)
    expected = _in_step(_streams(1))
    old = streams.collect()
    del old[STATE_KEY]  # written before the streams existed
    streams.restore(old)
    assert torch.equal(_in_step(streams), expected)


def test_dropout_masks_differ_between_sp_ranks_and_recomputes_replay_them():
    """nn.Dropout in a step: other masks on the other SP rank; the memory engine's recomputes (a stretch of two
    checkpointed layers, the backward in a step of its own as Lightning runs it) replay the rank's own masks."""
    import copy

    from lightning_ulysses.memory import MemoryOptions, apply_memory_options
    from tests.unit.test_memory import _assert_same, _batch, _loss_and_grads, _tiny_gpt2

    dropout = torch.nn.Dropout(0.5)
    masks = [_masks(dropout, _streams(rank)) for rank in range(2)]
    assert not torch.equal(masks[0], masks[1])

    plain = _tiny_gpt2(dropout=0.2)
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, checkpoint_interval=2))
    input_ids, labels = _batch()
    results = []
    for network in (plain, model):
        streams = _streams(1, seed=11)
        network.zero_grad()
        with streams.steps():
            loss = network(input_ids=input_ids, labels=labels).loss
        torch.rand(3)  # the shared stream moves between forward and backward (as data loading may)
        with streams.steps():
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in network.named_parameters()}))
    _assert_same(results[0], results[1])
    torch.manual_seed(11)
    assert not torch.equal(_loss_and_grads(plain, input_ids, labels)[0], results[0][0])  # the own stream's masks


def _masks(dropout: torch.nn.Module, streams: SequenceParallelRNG) -> torch.Tensor:
    with streams.steps():
        return dropout(torch.ones(64)) == 0


class _RandomSamples(torch.utils.data.Dataset):
    """A dataset drawing in its workers (random crops, masking, augmentation...)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


def _loaded(global_rank: int, data_parallel_rank=None, worker_init_fn=None) -> list[float]:
    """What one rank's loader yields, with Lightning's worker seeding as `fit` adds it (`seed_everything(workers=True)`)
    and, if `data_parallel_rank` is given, the strategy's `process_dataloader` before it."""
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn

    from types import SimpleNamespace

    from lightning_ulysses import UlyssesDeepSpeedStrategy

    torch.manual_seed(0)  # seed_everything: the same on every rank
    loader = torch.utils.data.DataLoader(_RandomSamples(), num_workers=1, worker_init_fn=worker_init_fn)
    if data_parallel_rank is not None:
        strategy = UlyssesDeepSpeedStrategy()
        strategy.runtime.parallel.groups = SimpleNamespace(data_parallel_rank=data_parallel_rank)  # as set up on that rank
        loader = strategy.process_dataloader(loader)
    _auto_add_worker_init_fn(loader, global_rank)
    return [float(sample) for sample in loader]


def test_data_loader_workers_are_seeded_alike_over_an_sp_group(monkeypatch):
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    # Lightning alone seeds workers by the global rank: the two ranks of one SP group would load other samples.
    assert _loaded(0) != _loaded(1)
    # By the DP rank: global ranks 0 and 1 (SP group 0, DP rank 0) alike, global rank 2 (DP rank 1) its own.
    assert _loaded(0, 0) == _loaded(1, 0) != _loaded(2, 1)
    assert _loaded(1, 0) == _loaded(0)  # Lightning's own seeding, with the DP rank for the rank
    own = lambda worker_id: torch.manual_seed(123)  # noqa: E731 - a user's own function is kept
    assert _loaded(0, 0, own) == _loaded(1, 0, own) == _loaded(0, None, own)
