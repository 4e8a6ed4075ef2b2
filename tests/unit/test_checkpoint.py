"""Atomic commit, interrupted-save detection and the data-position skip, without processes."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_ulysses.integration.checkpoint import protocol, resume
from lightning_ulysses.integration.faults import RankWatchdog


def manifest(world_size=2, stage=3, consumed=0, global_step=None):
    return protocol.CheckpointManifest(world_size=world_size, sequence_parallel_size=2, data_parallel_size=1,
                                          zero_stage=stage, epoch_samples_consumed=consumed, global_step=global_step)


def write_shards(directory, world_size=2, step=0):
    """DeepSpeed's shard files; the model states hold Lightning's `global_step` as DeepSpeed's client state does."""
    shards = directory / protocol.DEEPSPEED_TAG
    shards.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        torch.save({"global_step": step}, shards / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        torch.save({"step": step}, shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (directory / "latest").write_text(protocol.DEEPSPEED_TAG)


def save(path, step, recorded=False):
    """A complete checkpoint at `path` (committed as the strategy commits it) of global step `step`, with the step
    in its manifest if `recorded` (only in the shards otherwise, as before manifests recorded it)."""
    staging = protocol.prepare_staging(path)
    write_shards(staging, step=step)
    protocol.commit(path, manifest(consumed=step, global_step=step if recorded else None))


def test_commit_replaces_the_previous_checkpoint_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "last.ckpt"
    save(path, 1)
    save(path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert protocol.read_manifest(protocol.resolve_checkpoint(path)).epoch_samples_consumed == 2


def test_a_save_interrupted_before_commit_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    save(path, 1)
    write_shards(protocol.prepare_staging(path), world_size=1, step=2)  # one rank of two wrote, then a crash
    assert protocol.read_manifest(protocol.resolve_checkpoint(path)).epoch_samples_consumed == 1
    with pytest.raises(protocol.IncompleteCheckpointError):
        protocol.resolve_checkpoint(protocol.staging_path(path))
    with pytest.raises(protocol.IncompleteCheckpointError, match="1 of 2 optimizer-state files"):
        protocol.commit(path, manifest(consumed=2))  # commit itself refuses an incomplete staging folder
    save(path, 3)  # the next save clears the leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_crash_between_the_two_renames_falls_back_to_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    save(path, 1)
    path.rename(protocol.previous_path(path))  # first rename done, second never happened
    assert protocol.resolve_checkpoint(path) == protocol.previous_path(path)
    save(path, 2)  # and the next save repairs the folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_the_saved_global_step_is_read_from_the_manifest_or_the_shards(tmp_path):
    save(tmp_path / "recorded.ckpt", 7, recorded=True)
    for shard in (tmp_path / "recorded.ckpt" / protocol.DEEPSPEED_TAG).glob("*model_states.pt"):
        shard.unlink()  # the manifest alone answers: no shard is opened
    assert protocol.saved_global_step(tmp_path / "recorded.ckpt") == 7
    save(tmp_path / "older.ckpt", 5)  # a manifest from before the step was recorded: Lightning's entry in the shards
    assert protocol.saved_global_step(tmp_path / "older.ckpt") == 5
    torch.save({"global_step": 3, "state_dict": {}}, tmp_path / "single_file.ckpt")  # another strategy's file
    assert protocol.saved_global_step(tmp_path / "single_file.ckpt") == 3


def test_a_folder_without_manifest_next_to_a_staging_folder_is_refused(tmp_path):
    path = tmp_path / "epoch=0.ckpt"
    path.mkdir()
    with pytest.raises(protocol.IncompleteCheckpointError, match="interrupted"):
        protocol.resolve_checkpoint(path)
    write_shards(path)  # a checkpoint of Lightning's own DeepSpeedStrategy: accepted as it is
    assert protocol.resolve_checkpoint(path) == path


@pytest.mark.parametrize("new_data_parallel_size", [1, 2, 4])
def test_skipping_the_consumed_prefix_continues_the_epoch_at_any_data_parallel_size(new_data_parallel_size):
    dataset, seed, epoch = list(range(24)), 0, 3
    reference = DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed)
    reference.set_epoch(epoch)
    order = list(reference)  # the epoch's order: fixed by seed and epoch
    consumed = 8  # e.g. 2 steps of a global batch of 4
    remaining = []
    for rank in range(new_data_parallel_size):
        inner = DistributedSampler(dataset, num_replicas=new_data_parallel_size, rank=rank, seed=seed)
        sampler = resume.ResumableSampler(inner, new_data_parallel_size)
        sampler.set_epoch(epoch)
        sampler.skip_once(consumed)
        remaining += list(sampler)
        assert len(list(sampler)) == len(inner)  # the skip applies to one iteration only
    assert sorted(remaining) == sorted(order[consumed:])


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-generator", "own-generator"])
def test_a_drawn_epoch_order_is_replayed_from_the_states_it_was_drawn_from(own_generator):
    """`DataLoader(shuffle=True)`'s RandomSampler draws its order when its iteration starts, from the global generator
    (or its own): a new process draws another. The wrapper records the states of each epoch's draw; replayed, the
    resumed iteration is the saved epoch's order with its prefix skipped, and the global stream is left as it was."""
    from torch.utils.data import RandomSampler

    def sampler_of_a_process(seed):
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed + 100) if own_generator else None
        return resume.ResumableSampler(RandomSampler(list(range(12)), generator=generator), 1)

    first = sampler_of_a_process(1)
    torch.rand(3)  # what the process drew before the epoch began
    order = list(first)
    saved = first.epoch_order
    resumed = sampler_of_a_process(2)  # another process: other generator states
    assert list(sampler_of_a_process(2)) != order  # what a plain skip of its own order would have continued
    resumed.skip_once(4)
    resumed.replay_once(saved)
    before = torch.get_rng_state()
    assert list(resumed) == order[4:]
    if not own_generator:
        assert torch.equal(torch.get_rng_state(), before)  # the replayed draw consumed nothing of this process's
    assert resumed.epoch_order["torch"].equal(saved["torch"])  # and the next save records the same epoch


def test_a_mid_epoch_resume_of_a_drawn_order_without_its_states_is_refused():
    from torch.utils.data import DataLoader, RandomSampler

    data = list(range(16))
    strategy_checkpoints = _resuming(consumed=4)  # epoch_order None: a checkpoint that did not keep it
    with pytest.raises(ValueError, match="RandomSampler drew.*does not hold the generator states"):
        strategy_checkpoints.process_dataloader(DataLoader(data, batch_size=2, sampler=RandomSampler(data)))


def test_a_position_the_new_data_parallel_size_cannot_reach_is_refused():
    sampler = resume.ResumableSampler(DistributedSampler(list(range(12)), num_replicas=4, rank=0), 4)
    with pytest.raises(ValueError, match="data-parallel size 4 does not divide"):
        sampler.skip_once(6)


def test_a_different_global_batch_cannot_continue_an_epoch():
    sampler = resume.ResumableSampler(DistributedSampler(list(range(12)), num_replicas=2, rank=0), 2)
    with pytest.raises(ValueError, match="global batch of 4 .* this run has 2"):
        sampler.skip_once(8, saved_global_batch=4, global_batch=2)
    sampler.skip_once(8, saved_global_batch=4, global_batch=4)


def test_a_mid_epoch_resume_of_an_iterable_dataset_says_the_epoch_restarts():
    # Its DataLoader has torch's placeholder sampler: wrapping that skipped nothing, and said nothing.
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    trainer = SimpleNamespace(state=SimpleNamespace(stage=RunningStage.TRAINING))
    strategy = SimpleNamespace(lightning_module=SimpleNamespace(trainer=trainer))
    strategy_checkpoints = resume.StrategyCheckpoints(strategy)
    strategy_checkpoints.resume = resume.PendingResume(epoch_samples_consumed=4, global_batch_size=2, rng_state=None)
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match="an iterable dataset.*restarts from its beginning"):
        assert strategy_checkpoints.process_dataloader(loader) is loader


def test_watchdog_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="positive"):
        RankWatchdog("127.0.0.1", 1, rank=0, world_size=2, timeout=0)


def _resuming(quiet=True, consumed=4):
    from lightning.pytorch.trainer.states import RunningStage

    progress = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)))
    trainer = SimpleNamespace(state=SimpleNamespace(stage=RunningStage.TRAINING), fit_loop=progress)
    strategy = SimpleNamespace(lightning_module=SimpleNamespace(trainer=trainer),
                               parallel_groups=SimpleNamespace(data_parallel_world_size=1),
                               run_spec=SimpleNamespace(fsdp2=False))
    strategy_checkpoints = resume.StrategyCheckpoints(strategy, quiet=quiet)
    strategy_checkpoints.resume = resume.PendingResume(epoch_samples_consumed=consumed, global_batch_size=2,
                                                       rng_state=None)
    return strategy_checkpoints


def _lightning_says_not_resumable() -> list[str]:
    """What shows of Lightning's warning at the start of a resumed epoch loop (`training_epoch_loop.py`, between
    `process_dataloader` and the first batch)."""
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    from lightning_ulysses.integration.console import NOT_RESUMABLE

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", append=True)  # behind the filters in force
        warnings.warn(f"{NOT_RESUMABLE[1]} and your dataloader is not resumable.", PossibleUserWarning)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("consumed", [4, 0], ids=["mid-epoch", "epoch-boundary"])
def test_lightnings_not_resumable_warning_is_hidden_only_while_an_exact_resume_starts(consumed):
    """Lightning warns at every resume inside an epoch that its data may not continue exactly; ours does (the
    sampler's prefix skipped, `DistributedSampler` or `SequentialSampler` orders), so the warning is hidden from
    `process_dataloader` to the first batch. Kept: for a sampler whose order a new process may not repeat, an
    iterable dataset (the epoch restarts), with `quiet_third_party=False`, and after the first batch."""
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    data = list(range(16))
    exact = _resuming(consumed=consumed)
    exact.process_dataloader(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0)))
    assert _lightning_says_not_resumable() == []
    exact.on_train_batch_start()
    assert len(_lightning_says_not_resumable()) == 1
    sequential = _resuming(consumed=consumed)
    sequential.process_dataloader(DataLoader(data, batch_size=2))
    assert _lightning_says_not_resumable() == []
    sequential.end_resume()  # (the strategy's teardown, where no batch ran)
    assert len(_lightning_says_not_resumable()) == 1
    drawn = _resuming(consumed=consumed)  # its order drawn from generator states the checkpoint kept
    drawn.resume.epoch_order = {"torch": torch.get_rng_state(), "generator": None}
    drawn.process_dataloader(DataLoader(data, batch_size=2, sampler=RandomSampler(data)))
    assert _lightning_says_not_resumable() == []
    drawn.end_resume()

    class OwnOrder(torch.utils.data.Sampler):  # a sampler of the user's own: whether it repeats is unknown
        def __iter__(self):
            return iter(range(16))

        def __len__(self):
            return 16

    own_order = DataLoader(data, batch_size=2, sampler=OwnOrder())
    for strategy_checkpoints, loader in [(_resuming(consumed=consumed), own_order),
                                         (_resuming(quiet=False, consumed=consumed), DataLoader(data, batch_size=2)),
                                         (_resuming(consumed=consumed), DataLoader(Stream(), batch_size=2))]:
        strategy_checkpoints.process_dataloader(loader)  # (for the iterable dataset, ours says the epoch restarts)
        assert len(_lightning_says_not_resumable()) == 1


def test_distributed_checkpoint_is_read_through_public_names_only():
    """`checkpoint export` of FSDP2 checkpoints used `state_dict_loader._load_state_dict_from_keys` (private in torch
    2.13); the package now names nothing private of `torch.distributed.checkpoint` (docs/internals.md)."""
    import ast
    from pathlib import Path

    import lightning_ulysses

    found = []
    for source in Path(lightning_ulysses.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed.checkpoint"):
                found += [f"{source.name}: {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") or "._" in node.module]
    assert not found, found


@pytest.mark.parametrize(("folder", "stamp"), [
    ("outputs/2026-12-04/13-27-54", "2026-12-04"),  # the recipes' unnamed run folder
    ("runs/20261204_132754", "20261204_132754"), ("runs/exp/13:27:54", "13:27:54"),
    ("lightning_logs/version_3", "version_3"),  # a logger's version folder: the next launch makes version_4
    ("runs/my_experiment", None), ("runs/lr-3e-4/seed-12", None), ("runs/v100-2x8", None),
    ("runs/slurm-4242/2026-12-04", None),  # keyed by the job, which a requeue keeps
])
def test_a_folder_named_for_its_launch_is_recognised(folder, stamp):
    from pathlib import Path

    from lightning_ulysses.integration.faults import launch_stamped_component

    assert launch_stamped_component(Path(folder), job_id="4242") == stamp
