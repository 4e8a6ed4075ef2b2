"""The strategy's side of checkpoints (the checkpoint hooks of `UlyssesDeepSpeedStrategy` and `UlyssesFSDPStrategy`
delegate to `StrategyCheckpoints`; the parent strategy's own save and load write and read the shards): the staged save and its barriers (the files and the commit: `protocol`), the loop state
rewritten to the data position, the resume state kept from load to the first batch, the epoch's data continued at the
same sample (`ResumableSampler`), and evaluation loads of ZeRO-3 checkpoints (which DeepSpeed cannot load into an
engine without optimizer).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler,
                              SubsetRandomSampler, WeightedRandomSampler)

from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.integration import console
from lightning_ulysses.integration.checkpoint.protocol import (CheckpointManifest, commit, consolidated_state_dict,
                                                               deepspeed_tag, load_rng_state, prepare_staging,
                                                               read_manifest, resolve_checkpoint, save_hf_configs,
                                                               save_rng_state, staging_path)
from lightning_ulysses.integration.rng import SequenceParallelRNG


# -- data position -------------------------------------------------------------------------------------------------
# torch's samplers that draw an epoch's order from a torch generator as their iteration starts: the global one, or
# their own `generator`. A new process's generators are elsewhere: the order it draws is another.
DRAWING_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
# Samplers whose epoch order a resumed run repeats: set by seed and epoch, fixed, or drawn where the wrapper replays.
_EXACT_ORDER_SAMPLERS = (DistributedSampler, SequentialSampler, *DRAWING_SAMPLERS)


class ResumableSampler(Sampler):
    """Wraps a training sampler so that the first epoch after a resume skips what was already trained on, in the order
    that epoch had.

    Lightning restores its loop counters but restarts the epoch's data from the beginning. The distributed
    sampler gives DP rank `r` samples `order[r], order[r + dp], ...` of the epoch's order (fixed by seed and
    epoch), so the first `k` batches of all ranks together are exactly the prefix `order[: k * batch * dp]`.
    Skipping that prefix is therefore exact at the same DP size and at any other DP size that divides it.

    A sampler that draws its order when its iteration starts (`DRAWING_SAMPLERS`: `DataLoader(shuffle=True)`'s
    `RandomSampler`) draws another one in a new process. The wrapper keeps the generator states each epoch's order
    was drawn from (`epoch_order`, saved with the checkpoint); a resume puts them back for that one draw
    (`replay_once`), so the order, and the skipped prefix of it, are the saved epoch's.
    """

    def __init__(self, sampler: Sampler, data_parallel_size: int) -> None:
        self.sampler = sampler
        self.data_parallel_size = data_parallel_size
        self._skip_per_rank = 0
        self._replay: Optional[dict[str, Any]] = None
        # The global torch generator's state and the sampler's own generator's where this epoch's iteration began.
        self.epoch_order: Optional[dict[str, Any]] = None

    def skip_once(self, epoch_samples_consumed: int, saved_global_batch: Optional[int] = None,
                  global_batch: Optional[int] = None) -> None:
        """Skip `epoch_samples_consumed` (counted over all DP ranks) at the start of the next iteration."""
        if saved_global_batch is not None and global_batch is not None and saved_global_batch != global_batch:
            raise ValueError(
                f"The checkpoint was written in the middle of an epoch with a global batch of {saved_global_batch}"
                f" samples (batch size × data-parallel size) and this run has {global_batch}: Lightning counts the"
                " epoch's progress in batches, so the data position cannot be continued. Keep the global batch (e.g."
                " halve the batch size when doubling the data-parallel size) or resume from an epoch-end checkpoint."
            )
        if epoch_samples_consumed % self.data_parallel_size:
            raise ValueError(
                f"The checkpoint was written after {epoch_samples_consumed} samples of the current epoch, which the"
                f" data-parallel size {self.data_parallel_size} does not divide: the resumed run cannot continue at"
                " the same sample. Resume with a data-parallel size that divides it, or from an epoch boundary."
            )
        self._skip_per_rank = epoch_samples_consumed // self.data_parallel_size

    def replay_once(self, epoch_order: dict[str, Any]) -> None:
        """Draw the next iteration's order from the generator states `epoch_order` (a saved `epoch_order`)."""
        self._replay = epoch_order

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        # A generator: this runs where the wrapped sampler's own iteration would begin (the batch sampler's first
        # draw), so the states recorded are those it draws from.
        skip, self._skip_per_rank = self._skip_per_rank, 0
        replay, self._replay = self._replay, None
        own = getattr(self.sampler, "generator", None)
        outside = torch.get_rng_state()
        if replay is not None:
            torch.set_rng_state(replay["torch"])
            if own is not None and replay["generator"] is not None:
                own.set_state(replay["generator"])
        self.epoch_order = {"torch": torch.get_rng_state(), "generator": None if own is None else own.get_state()}
        iterator = iter(self.sampler)
        first = next(iterator, _END)  # the sampler draws its order here (RandomSampler: its seed)
        if replay is not None:  # the replayed draw leaves the rest of the process's stream as it found it
            torch.set_rng_state(outside)
        if first is _END:
            return
        iterator = itertools.chain([first], iterator)
        for _ in range(skip):
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        # The full length: Lightning counts the skipped batches as done (its restored progress), so the epoch ends
        # where it would have.
        return len(self.sampler)


_END = object()


# -- the strategy's side ------------------------------------------------------------------------------------------
def _refuse_resume_inside_window(path: Path, manifest: CheckpointManifest) -> None:
    """A checkpoint saved inside a gradient-accumulation window holds the weights of the window's start but not the
    gradients of its first micro-batches: continuing from it would step on part of a window. The same on every rank
    (one manifest), before training."""
    pending = manifest.micro_batches_accumulated
    if pending:
        raise ValueError(
            f"{path} was saved inside a gradient-accumulation window, after {pending} micro-batch(es) whose gradients"
            " a checkpoint does not hold: resuming training from it cannot be exact. Resume from a checkpoint saved at"
            " an optimizer step (ModelCheckpoint(every_n_train_steps=...), the end of an epoch, a preemption save), or"
            " make mid-epoch validation fall on steps (val_check_interval a multiple of accumulate_grad_batches);"
            " validate/test/predict and `checkpoint export` read this checkpoint as it is.")


def _refuse_undrawable_order(sampler: Sampler, epoch_order: Optional[dict[str, Any]]) -> None:
    """A checkpoint saved in the middle of an epoch without the generator states the epoch's order was drawn from
    (written before they were kept, or by another strategy): the resumed run would skip the first samples of another
    order, training some samples twice and others never. Refused on every rank alike (one manifest, one loader),
    before training."""
    if epoch_order is not None:
        return
    raise ValueError(
        f"The checkpoint was saved in the middle of an epoch whose order a {type(sampler).__name__} drew, and it does"
        " not hold the generator states it was drawn from (it was written by another strategy, or before"
        " lightning_ulysses kept them): this run would draw another order and skip the wrong samples. Resume from a"
        " checkpoint saved at an epoch's end, or from one this version of the strategy saved; or train with Lightning's"
        " DistributedSampler (Trainer(use_distributed_sampler=True), the default), whose order the epoch fixes.")


@dataclass
class PendingResume:
    """What a loaded checkpoint still has to restore once training starts."""

    epoch_samples_consumed: int
    global_batch_size: Optional[int]
    rng_state: Optional[dict[str, Any]]
    epoch_order: Optional[dict[str, Any]] = None  # the saved epoch's `ResumableSampler.epoch_order` (this rank's)


class StrategyCheckpoints:
    """The checkpoint protocol behind `UlyssesDeepSpeedStrategy`'s `save_checkpoint`, `load_checkpoint`,
    `load_model_state_dict`, `process_dataloader` and `on_train_batch_start`, and the resume state between them.

    `strategy` is the `UlyssesDeepSpeedStrategy` (its ranks, groups, config and trainer), `random_streams` the
    random streams its steps draw from; the parent `DeepSpeedStrategy`'s own save and load are passed in by the hooks
    as `write` and `load`. `quiet`: Lightning's warning that a resume in the middle of an epoch is unreliable is
    hidden where this resume is exact (see `process_dataloader`).
    """

    def __init__(self, strategy: Any, random_streams: Optional[SequenceParallelRNG] = None,
                 quiet: bool = False) -> None:
        self.strategy = strategy
        self.random_streams = random_streams if random_streams is not None else SequenceParallelRNG()
        self.resume: Optional[PendingResume] = None
        # Lightning warns at the start of every resumed epoch loop whose step count is not a whole number of epochs and
        # whose dataloader has no `state_dict` (`training_epoch_loop.py`), between `process_dataloader` and the first
        # batch: suspended there when the data continues exactly.
        self._not_resumable = console.SuspendedWarning(console.NOT_RESUMABLE[1], PossibleUserWarning) if quiet else None
        self.data_epoch: Optional[int] = None  # the epoch the last training batch came from (see `resumable_loops`)
        # The training loader's sampler wrapper of this run, which knows what its epoch's order was drawn from.
        self.order_sampler: Optional[ResumableSampler] = None
        self._load_consolidated_weights = False  # see `load`

    @property
    def trainer(self):
        return self.strategy.lightning_module.trainer

    # -- save -------------------------------------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any],
             write: Callable[[dict[str, Any], Any, Optional[Any]], None], hf_model_configs: Mapping[str, Any]) -> None:
        """Atomic: every rank writes into `<path>.partial`; rank 0 renames it to `<path>` once all have finished."""
        strategy = self.strategy
        path = Path(strategy.broadcast(str(filepath)))
        if strategy.is_global_zero:
            prepare_staging(path)
        strategy.barrier("lightning_ulysses.integration.checkpoint.staging")
        staging = staging_path(path)
        if "loops" in checkpoint:
            checkpoint = {**checkpoint, "loops": self.resumable_loops(checkpoint["loops"])}
        write(checkpoint, staging, storage_options)
        save_rng_state(staging, strategy.global_rank, self.random_streams,
                       self.order_sampler.epoch_order if self.order_sampler is not None else None)
        if strategy.is_global_zero:
            save_hf_configs(staging, hf_model_configs, strategy.lightning_module)
        strategy.barrier("lightning_ulysses.integration.checkpoint.written")
        if strategy.is_global_zero:
            commit(path, self.manifest(hf_model_configs))
        strategy.barrier("lightning_ulysses.integration.checkpoint.committed")

    def manifest(self, hf_model_configs: Mapping[str, Any]) -> CheckpointManifest:
        groups = self.strategy.parallel_groups
        return CheckpointManifest(
            world_size=self.strategy.world_size,
            sequence_parallel_size=groups.sequence_parallel_world_size,
            data_parallel_size=groups.data_parallel_world_size,
            zero_stage=self.strategy.run_spec.zero_stage,
            epoch_samples_consumed=self.epoch_samples_consumed(),
            global_batch_size=self.global_batch_size(),
            micro_batches_accumulated=self.strategy.micro_batches_accumulated,
            hf_models=tuple(hf_model_configs),
            global_step=self.trainer.global_step,
            backend=self.strategy.run_spec.backend,
        )

    def global_batch_size(self) -> Optional[int]:
        batch_size = getattr(self.trainer.train_dataloader, "batch_size", None)
        return None if batch_size is None else batch_size * self.strategy.parallel_groups.data_parallel_world_size

    def epoch_position(self) -> tuple[int, bool]:
        """Batches of the current epoch trained on so far, and whether that epoch's data is used up."""
        done, is_last_batch = lightning_private.epoch_batch_progress(self.trainer)
        return done, is_last_batch or done >= self.trainer.num_training_batches

    def epoch_samples_consumed(self) -> int:
        """Samples of the current epoch trained on so far, over all DP ranks (0 between epochs)."""
        done, used_up = self.epoch_position()
        if used_up or not done:
            return 0
        global_batch = self.global_batch_size()
        if global_batch is None:  # a custom batch sampler: positions cannot be counted in samples
            return -1
        return done * global_batch

    def resumable_loops(self, loops: dict[str, Any]) -> dict[str, Any]:
        """Lightning's loop state as the uninterrupted run had it at this data position, so that a resume continues
        on the same epoch's sampler permutation with the same epoch counters.

        Lightning counts an epoch as processed (and, after `fit`, completed) as soon as its epoch loop ends, also
        when `max_steps` ends it inside the epoch; a resume then sets the sampler to the next epoch and calls the
        rest of the old one's batches part of it. And a checkpoint whose epoch ran to its end resumes with the
        batch counter at the end of that epoch: with `max_steps` (which makes Lightning treat every resume as a
        restart) it trains one batch of the next epoch and ends that epoch there. Both are rewritten to the
        state between the same two steps of an uninterrupted run: the epoch in progress, or the next one not yet
        begun. A save inside a batch hook (ModelCheckpoint every n steps, a callback) comes before Lightning counts
        the epoch and resumes correctly as it is; in mid-epoch its epoch counters are written out consistently
        too (after some of Lightning's own restarts, `ready` lags `processed` by one)."""
        fit = loops.get("fit_loop")
        epoch = self.data_epoch
        if fit is None or epoch is None:  # nothing trained since this process started (or loaded) the run
            return loops
        epochs_key, batches_key = lightning_private.FIT_LOOP_EPOCH_PROGRESS, lightning_private.FIT_LOOP_BATCH_PROGRESS
        counters = lightning_private.PROGRESS_COUNTERS
        done, used_up = self.epoch_position()
        counted = fit[epochs_key]["current"]["processed"] > epoch  # Lightning has counted the data's epoch
        if used_up and counted:
            epochs = dict.fromkeys(counters, epoch + 1)
            batches = {**fit[batches_key], "is_last_batch": False, "current": dict.fromkeys(counters, 0)}
        elif done and not used_up:
            epochs = {"ready": epoch + 1, "started": epoch + 1, "processed": epoch, "completed": epoch}
            batches = fit[batches_key]
        else:
            return loops
        fit = {**fit, epochs_key: {"total": dict(epochs), "current": dict(epochs)}, batches_key: batches}
        return {**loops, "fit_loop": fit}

    # -- load -------------------------------------------------------------------------------------------------------
    def load(self, checkpoint_path: Any, load: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """Refuse interrupted saves and, under ZeRO, other world sizes (FSDP2's Distributed Checkpoint reshards), keep
        what a resume must restore later, and load (`load`: the parent's `load_checkpoint`), or consolidate ZeRO-3
        shards for an evaluation."""
        strategy = self.strategy
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        manifest = None
        if os.path.isdir(checkpoint_path) or not os.path.exists(checkpoint_path):
            path = resolve_checkpoint(Path(checkpoint_path))  # refuses interrupted saves
            manifest = read_manifest(path)
            # FSDP2's Distributed Checkpoint reshards model and optimizer state to any number of ranks; ZeRO's files
            # are cut per rank (DeepSpeed's universal checkpoints are not used).
            if manifest is not None and manifest.world_size != strategy.world_size and manifest.backend != "fsdp2":
                raise ValueError(
                    f"{path} was written by {manifest.world_size} ranks (SP {manifest.sequence_parallel_size} × DP"
                    f" {manifest.data_parallel_size}) and this run has {strategy.world_size}: ZeRO shards are cut per"
                    f" rank. Resume with {manifest.world_size} ranks (any SP × DP split works), or export the weights"
                    f" with `python -m lightning_ulysses checkpoint export {path} <folder>` and start a new run from"
                    " them."
                )
            checkpoint_path = str(path)
        if fitting and manifest is not None:
            _refuse_resume_inside_window(path, manifest)
            same_layout = (manifest.sequence_parallel_size == strategy.sequence_parallel_world_size
                           and manifest.world_size == strategy.world_size)
            rng_state, epoch_order = load_rng_state(Path(checkpoint_path), strategy.global_rank)
            self.resume = PendingResume(
                epoch_samples_consumed=manifest.epoch_samples_consumed,
                global_batch_size=manifest.global_batch_size,
                # Each rank's generators continue where they were; at another split ranks play other roles.
                rng_state=rng_state if same_layout else None,
                epoch_order=epoch_order,  # the same on every rank that loads the same samples
            )
        if (fitting or strategy.run_spec.fsdp2 or not strategy.zero_stage_3 or strategy.load_full_weights
                or not os.path.isdir(checkpoint_path)):
            return load(checkpoint_path)  # (FSDP2: Distributed Checkpoint loads into the shards in any run)
        return self._load_consolidated(Path(checkpoint_path))

    def _load_consolidated(self, path: Path) -> dict[str, Any]:
        """validate/test/predict(ckpt_path=<ZeRO-3 checkpoint>): DeepSpeed 0.19 cannot load a ZeRO-3 checkpoint
        into an engine without optimizer (it calls `_restore_from_bit16_weights` on `DeepSpeedZeRoOffload`).
        Consolidate the fp32 weights from the shards instead; `load_model_state_dict` then lets Lightning's
        full-weights path copy them into the partitioned parameters, module by module."""
        # Lightning's own entries (epoch, callbacks, ...) are saved as DeepSpeed client state in every model-state file.
        states = path / deepspeed_tag(path) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        checkpoint = torch.load(states, map_location="cpu", weights_only=False)
        # Only global rank 0 reads the weights (`_restore_zero_state` copies them in from rank 0 alone): one full
        # fp32 copy of the model in host memory, not one per rank.
        checkpoint["state_dict"] = consolidated_state_dict(path) if self.strategy.is_global_zero else {}
        self._load_consolidated_weights = True
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool) -> bool:
        """Copy consolidated weights (see `_load_consolidated`) in; False: not ours, the parent's hook loads."""
        if not self._load_consolidated_weights:
            return False
        self._load_consolidated_weights = False
        self.strategy.model_to_device()
        lightning_private.restore_zero_state(self.strategy, checkpoint, strict)
        return True

    # -- resume -----------------------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader, its sampler wrapped (`ResumableSampler`) where a resume needs it: after a resume in
        the middle of an epoch, to skip the samples that epoch already trained on; and in every run whose sampler
        draws each epoch's order (`DRAWING_SAMPLERS`), to record what it drew from for the checkpoints, and replay
        that on a resume. At an epoch boundary, the random generators are restored here. Where the epoch's order
        is one the resumed run repeats, the data then continues exactly, and Lightning's warning that it may not is
        suspended until the first batch."""
        self.order_sampler = None
        # (a loader processed outside a run, no module attached: nothing to record or to resume)
        if self.strategy.lightning_module is None or self.trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        resume = self.resume
        at_boundary = resume is not None and resume.epoch_samples_consumed == 0
        if at_boundary and resume.rng_state is not None:
            # Between an epoch's last step and the next one, the uninterrupted run drew from the global generator
            # for the new epoch's data loader iterator (its base seed, a drawing sampler's order); Lightning creates
            # that iterator right after this call, so the generators continue from here, not from the first batch.
            self.random_streams.restore(resume.rng_state)
            resume.rng_state = None
        # An iterable dataset's DataLoader has a sampler too (torch's placeholder), which it never draws from.
        sampler = getattr(dataloader, "sampler", None)
        iterable = not isinstance(dataloader, DataLoader) or sampler is None or isinstance(dataloader.dataset,
                                                                                           IterableDataset)
        mid_epoch = resume is not None and resume.epoch_samples_consumed != 0
        if mid_epoch and (resume.epoch_samples_consumed < 0 or iterable):
            rank_zero_warn("The checkpoint's position inside its epoch cannot be restored for this dataloader (a"
                           " custom batch sampler or an iterable dataset): the epoch's data restarts from its beginning.")
            return dataloader
        if iterable or not (mid_epoch or isinstance(sampler, DRAWING_SAMPLERS)):
            if resume is not None:
                self._continues_exactly(dataloader)
            return dataloader
        data_parallel_size = self.strategy.parallel_groups.data_parallel_world_size
        wrapped = ResumableSampler(sampler, data_parallel_size)
        if mid_epoch:
            global_batch = None if dataloader.batch_size is None else dataloader.batch_size * data_parallel_size
            saved_global_batch = resume.global_batch_size
            if self.strategy.run_spec.fsdp2 and None not in (saved_global_batch, global_batch):
                # FSDP2: Lightning's count of the epoch's batches is translated to this run's batch size (e.g. a world
                # of 4 at DP 2 resumed by a world of 2 at DP 1 accumulating 2 batches: the same samples per step).
                self._count_epoch_batches(resume.epoch_samples_consumed, global_batch)
                saved_global_batch = None
            # Raises before any collective (every rank has the same manifest and loader) if the position cannot
            # continue.
            wrapped.skip_once(resume.epoch_samples_consumed, saved_global_batch, global_batch)
            if isinstance(sampler, DRAWING_SAMPLERS):
                _refuse_undrawable_order(sampler, resume.epoch_order)
                wrapped.replay_once(resume.epoch_order)
            resume.epoch_samples_consumed = 0
        try:
            rebuilt = lightning_private.update_dataloader(dataloader, wrapped, mode=RunningStage.TRAINING)
        except Exception:
            if mid_epoch:
                raise  # Lightning names what its re-instantiation of this loader lacks
            # Only recording (a DataLoader subclass Lightning cannot re-instantiate): the loader trains as given, and
            # a later resume in the middle of one of its epochs is refused for the states it lacks.
            return dataloader
        if resume is not None:
            self._continues_exactly(dataloader)
        self.order_sampler = wrapped
        return rebuilt

    def _count_epoch_batches(self, epoch_samples_consumed: int, global_batch: int) -> None:
        """Lightning's restored position in the epoch, in this run's batches of `global_batch` samples (over all DP
        ranks); refused (before any collective, on every rank alike) where they do not fall on the same sample.
        DeepSpeed keeps its own count of micro-batches for the accumulation boundary, so there the batch stays."""
        batches, rest = divmod(epoch_samples_consumed, global_batch)
        if rest:
            raise ValueError(
                f"The checkpoint was written after {epoch_samples_consumed} samples of the current epoch, and this run's"
                f" batches hold {global_batch} samples (batch size × data-parallel size), which do not divide it: the"
                " epoch cannot continue at the same sample. Choose a batch size whose global batch divides it, or"
                " resume from an epoch-end checkpoint.")
        lightning_private.count_epoch_batches_as(self.trainer, batches)

    def _continues_exactly(self, dataloader: object) -> None:
        """Suspend Lightning's "not resumable" warning when the epoch's sample order is one the resumed run repeats:
        set by seed and epoch (`DistributedSampler`, which Lightning puts in by default), fixed
        (`SequentialSampler`), or drawn from generator states the checkpoint kept (`DRAWING_SAMPLERS`, e.g.
        `DataLoader(shuffle=True)`'s `RandomSampler`). Any other sampler may not repeat it, and the warning stays."""
        sampler = getattr(dataloader, "sampler", None)
        if self._not_resumable is not None and isinstance(sampler, _EXACT_ORDER_SAMPLERS):
            self._not_resumable.suspend()

    def end_resume(self) -> None:
        """Lightning's "not resumable" warning back in force (at the first batch after a resume and at teardown)."""
        if self._not_resumable is not None:
            self._not_resumable.resume()

    def on_train_batch_start(self) -> None:
        self.end_resume()  # Lightning's check ran when the epoch loop started
        # Mid-epoch, restored here, not at load: the dataloader and anything between load and the first step would
        # otherwise consume random numbers the uninterrupted run did not (at an epoch boundary: process_dataloader).
        if self.resume is not None:
            if self.resume.rng_state is not None:
                self.random_streams.restore(self.resume.rng_state)
            self.resume = None
        # Lightning set the sampler's epoch from this counter when the epoch began; it stays until the epoch loop
        # ends (a checkpoint needs it after that, see `resumable_loops`).
        self.data_epoch = lightning_private.epochs_processed(self.trainer)
