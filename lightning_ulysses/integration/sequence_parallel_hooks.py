"""`SequenceParallelHooks`: the Lightning hooks of a Ulysses strategy, whatever shards the parameters (DeepSpeed's
ZeRO in `strategy.py`, FSDP2 in `fsdp_strategy.py`), each delegating to the strategy's `runtime`
(`runtime.UlyssesRuntime`, which owns the collaborators).

A strategy that mixes it in (first, before its Lightning parent) builds `self.runtime` in its `__init__` and fills in
what differs per backend: `_agree_transport` (the all-to-all transport), `_adopt_run` (what `memory="auto"` chose,
written where the backend reads it), `_runtime_options` (the backend's preparation options), `_start_backward` (what
the backend's backward needs told first) and `_release_backend` (after Lightning's teardown). What this class gives it:
the groups and the run's description by name, the DP-only sampler, the sequence sharding of every batch, the module
pipeline, the steps under the SDPA kernel order and the SP rank's own random stream, the whole-sequence loss, the
refusal of a shard-local loss (and of a shard-local value logged in evaluation), evaluation on whole rows (opt-in),
the accumulation count, a scheduler's signals turned into one save at a step boundary, a rank's exception told to
the others, and the run's teardown.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ulysses.attention.backends import sdpa_priority
from lightning_ulysses.batch.check import CheckBatches
from lightning_ulysses.batch.sharding import SequencePadding
from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.integration import faults, preparation
from lightning_ulysses.integration.rng import seed_workers_by_data_parallel_rank
from lightning_ulysses.integration.runtime import UlyssesRuntime
from lightning_ulysses.memory import apply_allocator_settings
from lightning_ulysses.parallel.layout import SequenceParallelGroups
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss


def _step_hook(name: str) -> Callable[..., Any]:
    """The parent's step hook `name` under the strategy's SDPA kernel order and, on shards, drawing from this SP
    rank's own random stream (`rng.py`)."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_priority(self.sdpa_kernel_priority), self._step_random_stream():
            return getattr(super(SequenceParallelHooks, self), name)(*args, **kwargs)

    step.__name__ = step.__qualname__ = name
    return override(step)


def _checked_step_hook(name: str) -> Callable[..., Any]:
    """`_step_hook(name)` whose logged tensors (and in training under automatic optimization, the loss it returns) are
    compared over the SP group after the step while rows are sharded: a value of this rank's shard alone is refused
    on every rank of the group, before the loss reaches `backward` and before any logger sees a value
    (`logged_values.SameValueCheck`)."""
    parent_step = _step_hook(name)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if not self.batches_are_sharded:
            return parent_step(self, *args, **kwargs)
        returns_loss = name == "training_step" and module.automatic_optimization
        return self.runtime.value_check.run_step(lambda: parent_step(self, *args, **kwargs), module, name,
                                                 module.trainer.state.stage, self.parallel_groups, self.root_device,
                                                 returns_loss)

    step.__name__ = step.__qualname__ = name
    return override(step)


def _from_groups(name: str) -> property:
    return property(lambda self: getattr(self.parallel_groups, name), doc=f"`parallel_groups.{name}`")


def _from_auto(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.runtime.auto, name), doc=f"{doc} (`auto.AutoDecisions.{name}`)")


class SequenceParallelHooks:
    """The sequence-parallel half of a Ulysses strategy (see the module docstring)."""

    runtime: UlyssesRuntime  # built by the strategy's `__init__`

    # -- the arguments both strategies take, as the runtime holds them ---------------------------------------------
    @property
    def quiet_third_party(self) -> bool:
        return self.runtime.quiet_third_party

    @property
    def overlap_head_groups(self) -> int:
        return self.runtime.overlap_head_groups

    @property
    def sequence_parallel_in_evaluation(self) -> bool:
        return self.runtime.sequence_parallel_in_evaluation

    @sequence_parallel_in_evaluation.setter
    def sequence_parallel_in_evaluation(self, value: bool) -> None:
        self.runtime.sequence_parallel_in_evaluation = bool(value)

    @property
    def micro_batches_accumulated(self) -> int:
        """Micro-batches whose gradients are held without a step yet (`runtime.UlyssesRuntime`)."""
        return self.runtime.micro_batches_accumulated

    # -- the run and its parallel layout -------------------------------------------------------------------------
    @property
    def run_spec(self) -> RunSpec:
        """The run's description (`run_spec.RunSpec`: backend, layout, sharding options, precision, device), made
        when the Trainer sets up distributed training; every reader asks it, not the strategy's settings."""
        return self.runtime.parallel.described()

    @property
    def parallel_groups(self) -> SequenceParallelGroups:
        """The SP/DP groups of this rank; available once the strategy has set up distributed training."""
        return self.runtime.parallel.built_groups()

    # This rank's SP and DP process groups, ranks and sizes, as `parallel_groups` holds them.
    sequence_parallel_group = _from_groups("sequence_parallel_group")
    sequence_parallel_rank = _from_groups("sequence_parallel_rank")
    sequence_parallel_world_size = _from_groups("sequence_parallel_world_size")
    data_parallel_group = _from_groups("data_parallel_group")
    data_parallel_rank = _from_groups("data_parallel_rank")
    data_parallel_world_size = _from_groups("data_parallel_world_size")
    # `memory="auto"` and `sdpa_kernel_priority="auto"`, as decided (`auto.AutoDecisions`)
    memory = _from_auto("memory", "The memory features: the request until `memory=\"auto\"` is decided in `setup`")
    memory_choice = _from_auto("choice", "What `memory=\"auto\"` chose (`auto.AutoChoice`), once decided")
    memory_confirmation = _from_auto("confirmation", "What the first training steps measured against the choice")
    sdpa_kernel_priority = _from_auto("kernel_priority", "The SDPA kernels tried first (None: torch's order)")

    @property
    def heartbeat_timeout(self) -> Optional[float]:
        return self.runtime.faults.heartbeat_timeout

    @property
    def sequence_padding(self) -> SequencePadding:
        return self.runtime.parallel.sequence_padding

    @property
    def hf_model_configs(self) -> dict[str, Any]:
        """Module path → config of every Hugging Face model the strategy prepared, as the user built it (while it
        trains the model holds a copy with Ulysses attention): what `save_pretrained` of the trained model needs."""
        return dict(self.runtime.parallel.hf_configs)

    @property
    def check_batches(self) -> CheckBatches:
        return self.runtime.batch_check.mode

    @property
    def batches_are_sharded(self) -> bool:
        """Whether the step sees this rank's shard of the batch (False during evaluation with
        `sequence_parallel_in_evaluation=False`, where whole batches pass through)."""
        return self.runtime.parallel.batches_are_sharded

    @property
    def loss_function(self) -> SequenceParallelCausalLMLoss:
        """`loss_function(logits, labels)`: the whole-sequence token-mean loss with the right gradient scale for the
        backend's reduction, for modules that compute their loss from logits. `labels`: as Hugging Face takes them,
        unshifted — the batch's `labels`, `batch["input_ids"]`, labels built in the step; see
        `SequenceParallelCausalLMLoss`."""
        return self.runtime.parallel.loss_function()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every rank of an SP group must see the same samples; only DP groups get different ones.
        groups = self.parallel_groups
        return {"num_replicas": groups.data_parallel_world_size, "rank": groups.data_parallel_rank}

    # -- faults (`faults.RunFaults`) ------------------------------------------------------------------------------
    @property
    def preemption_note(self) -> bool:
        """Whether global rank 0 prints, after a scheduler's signal stopped `fit` (every rank saved
        `hpc_ckpt_<n>.ckpt`, the job exits 79), the one line saying how to continue; the recipes print their own
        continue command and turn it off."""
        return self.runtime.faults.preemption_note

    @preemption_note.setter
    def preemption_note(self, value: bool) -> None:
        self.runtime.faults.preemption_note = bool(value)

    @override
    def _configure_launcher(self) -> None:
        lightning_private.configure_launcher_above(SequenceParallelHooks, self)
        faults.mark_launching_process(self)  # the ranks Lightning's script launcher starts from here inherit it

    @override
    def on_train_start(self) -> None:
        # Lightning registers its signal handlers after `setup`; replace its collective ones once they exist.
        self.runtime.faults.signals.install(self.lightning_module.trainer, self.cluster_environment)
        super().on_train_start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.runtime.parallel.failed = True  # the groups are not released at this run's teardown (`ParallelRun.release`)
        # (the trainer read only where a signal is saved: an exception may come before the module is attached)
        self.runtime.faults.on_exception(exception, lambda: self.lightning_module.trainer, self.cluster_environment,
                                  self.is_global_zero, groups_built=self.runtime.parallel.groups is not None)
        super().on_exception(exception)

    # -- evaluation without sequence parallelism (opt-in) ----------------------------------------------------------
    # The parents' validation/test/predict start and end hooks are no-ops, so one pair serves all three loops.
    @override
    def on_validation_start(self) -> None:
        if not self.sequence_parallel_in_evaluation:
            self.runtime.parallel.evaluate_whole_rows(self.lightning_module)

    @override
    def on_validation_end(self) -> None:
        if self.runtime.parallel.end_whole_rows():
            self._prepare_modules()  # back to sequence parallelism for the training that may follow

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    # -- steps ----------------------------------------------------------------------------------------------------
    # The SDPA kernel priority holds for every step and its backward: a recompute in backward must pick the kernels
    # its forward picked (keep_attention_outputs replays them). Lightning has no single point around both (its
    # precision plugin's step contexts wrap the forward only), so each hook enters the same context here; the SP
    # rank's own random stream (`rng.py`) is entered alongside.
    # The loss and the logged values of this rank's shard alone are refused (`logged_values.py`); Lightning refuses
    # `self.log` in `predict_step` itself.
    training_step = _checked_step_hook("training_step")
    validation_step = _checked_step_hook("validation_step")
    test_step = _checked_step_hook("test_step")
    predict_step = _step_hook("predict_step")

    # -- checkpoints (`checkpoint.resume.StrategyCheckpoints`, `_checkpoints`) and data ---------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Atomic: every rank writes its part (DeepSpeed's files, or its Distributed Checkpoint shard) into
        `<path>.partial`; rank 0 renames it to `<path>` once all have finished, with the manifest."""
        self.runtime.checkpoints.save(checkpoint, filepath, storage_options, super().save_checkpoint, self.hf_model_configs)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.runtime.checkpoints.load(checkpoint_path, functools.partial(super().load_checkpoint,
                                                                         weights_only=weights_only))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """After a resume in the middle of an epoch, skip the samples that epoch already trained on; seed data-loader
        workers by the DP rank, so that the ranks of an SP group load the same samples."""
        dataloader = self.runtime.checkpoints.process_dataloader(dataloader)
        seed_workers_by_data_parallel_rank(dataloader, self.parallel_groups.data_parallel_rank)
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.runtime.checkpoints.on_train_batch_start()  # the resumed random generators; the epoch of the batch's data
        self.runtime.faults.signals.agree(self.lightning_module.trainer, self.world_size, self.root_device)
        # memory="auto": the first steps of the first fit, timed and logged against the prediction
        confirmation = self.runtime.auto.confirm(self.root_device, self._reduces_over_ranks())
        if confirmation is not None:
            (rank_zero_warn if confirmation.exceeds_plan else rank_zero_info)(confirmation.report())
        super().on_train_batch_start(batch, batch_idx)

    def _reduces_over_ranks(self) -> bool:
        return torch.distributed.is_initialized() and self.world_size > 1

    def _step_random_stream(self) -> contextlib.AbstractContextManager:
        """This SP rank's own random stream while batches are sharded (each rank drops its own tokens and heads);
        whole rows (`sequence_parallel_in_evaluation=False`) draw from the shared one, alike on every rank."""
        return self.runtime.random_streams.steps() if self.batches_are_sharded else contextlib.nullcontext()

    # -- the module pipeline (`preparation.py`, through `ParallelRun`) ------------------------------------------------
    def _prepare_modules(self) -> preparation.ModuleScan:
        """Scan the models and settle the ring size from their heads (raising before any collective, on every rank
        alike), agree the all-to-all transport, decide what is "auto", then check everything and prepare everything
        with the backend's options."""
        parallel = self.runtime.parallel
        found = parallel.scan(self.lightning_module)
        transport = self._agree_transport()
        run = self.runtime.auto.decide(self.run_spec, found.memory_engine_models(),
                                       on_cuda=isinstance(self.accelerator, CUDAAccelerator), local_ranks=self.num_processes,
                                       reduce=self._reduces_over_ranks(),
                                       accumulate=self.lightning_module.trainer.accumulate_grad_batches)
        if run is not None:
            parallel.spec = run
            self._adopt_run(run)
            rank_zero_info(self.memory_choice.report())
        parallel.prepare(found, preparation.SequenceParallelRuntime(
            self.parallel_groups, parallel.sharder, parallel.batch_rows, self.loss_function, self.memory,
            self.overlap_head_groups, transport=transport, **self._runtime_options()))
        return found

    def _agree_transport(self) -> Optional[Any]:
        """The all-to-all transport this run's models use (None: the collective one)."""
        return None

    def _adopt_run(self, run: RunSpec) -> None:
        """What `memory="auto"` chose (`run`), where the backend reads it (nothing beyond the run's description)."""

    def _runtime_options(self) -> dict[str, Any]:
        """The backend's own `preparation.SequenceParallelRuntime` options."""
        return {}

    # -- backward and the accumulation window --------------------------------------------------------------------
    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        # A loss given to `manual_backward` in a checked step: compared over the SP group before the step's own
        # optimizer step (under automatic optimization `training_step` compared it already, `logged_values.py`).
        if self.runtime.value_check.in_checked_step:
            self.runtime.value_check.check_backward(args[0] if args else kwargs["closure_loss"])
        ends_window = None
        if self.lightning_module is not None and self.lightning_module.automatic_optimization:
            ends_window = not lightning_private.should_accumulate(self.lightning_module.trainer)
            self.runtime.count_micro_batch(ends_window)
        kwargs = self._start_backward(ends_window, kwargs)
        with sdpa_priority(self.sdpa_kernel_priority), self._step_random_stream():
            return super().backward(*args, **kwargs)

    def _start_backward(self, ends_window: Optional[bool], kwargs: dict) -> dict:
        """The backend's backward arguments, told first whether this micro-batch ends Lightning's accumulation
        window (`ends_window`; None under manual optimization)."""
        return kwargs

    # -- the run's end --------------------------------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        try:
            self.runtime.parallel.end()  # the user's models leave the Trainer with their own attention and loss again
            self.runtime.checkpoints.end_resume()  # a resumed run that trained no batch
            # While the watchdog runs: a rank lost at the barrier is named, not waited for.
            self.runtime.parallel.release(self.world_size, self.barrier)
            self.runtime.faults.stop_watchdog()
            super().teardown()
            self._release_backend()
        finally:
            # Also when a step above raised (Lightning tears down after an exception too): DeepSpeed's linear in
            # place of torch's, the allocator's setting (`process_state.py`).
            self.runtime.process_state.restore()
        self.runtime.faults.after_teardown(self.launcher, self.is_global_zero)  # a preemption: the job's exit, one line

    def _release_backend(self) -> None:
        """What the backend keeps after Lightning's teardown, released."""

    def _enter_process_state(self) -> None:
        """First in the backend's `setup_environment` (every run's first hook, before `configure_model` and before
        this rank initialises CUDA): the process as this run finds it, put back at its teardown (`process_state.py`),
        and the allocator's setting (AutoMemory has the field too), undone there."""
        self.runtime.process_state.take()
        self.runtime.process_state.add_undo(apply_allocator_settings(self.memory))

    # -- data ---------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if not self.batches_are_sharded:
            return batch
        self.runtime.batch_check(batch, self.parallel_groups, self.lightning_module.trainer.state.stage, self.root_device,
                          self.global_rank)
        return self.runtime.parallel.sharder(batch)
