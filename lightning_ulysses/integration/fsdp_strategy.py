"""`UlyssesFSDPStrategy`: DeepSpeed-Ulysses sequence parallelism on torch's FSDP2 — Lightning's hooks, each delegating.

The same runtime as `UlyssesDeepSpeedStrategy` (`runtime.UlyssesRuntime`, driven by `SequenceParallelHooks`): groups
(`parallel/layout.py`, as the two dimensions of a DTensor device mesh) → DP-only sampler → sequence sharding
(`batch/sharding.py`) → Ulysses attention → SP-aware loss (`training/loss.py`); then FSDP2's `fully_shard` over all
ranks (`fsdp.py`) instead of DeepSpeed. The run's description, with what FSDP2 refuses, is `RunSpec.of_fsdp_arguments`.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Mapping, Optional, Sequence, Union, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ulysses.batch.check import CheckBatches
from lightning_ulysses.batch.sharding import SequencePadding
from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.integration import fsdp
from lightning_ulysses.integration.callbacks import correct_progress_bar
from lightning_ulysses.integration.pretrained import ShardedPretrainedLoads
from lightning_ulysses.integration.logged_values import PerRankValues
from lightning_ulysses.integration.runtime import UlyssesRuntime
from lightning_ulysses.integration.sequence_parallel_hooks import SequenceParallelHooks
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.parallel.layout import SequenceParallelGroups
from lightning_ulysses.parallel.run_spec import RunSpec, read_sequence_parallel_size


class UlyssesFSDPStrategy(SequenceParallelHooks, ModelParallelStrategy):
    """FSDP2 (`fully_shard`, DTensor) with DeepSpeed-Ulysses sequence parallelism: `strategy="ulysses_fsdp"`. The
    user's module is the one `strategy="ulysses"` trains, unchanged; parameters, gradients and optimizer state are
    sharded over all DP × SP ranks (as ZeRO-3), each decoder layer one FSDP2 unit.

    Args:
        sequence_parallel_size: ranks sharing one sequence; must divide the processes and the heads. `None`: devices
            per node; `1`: plain FSDP2.
        ring_size, sequence_padding, sequence_parallel_in_evaluation, sdpa_kernel_priority, overlap_head_groups,
            check_batches, per_rank_values, heartbeat_timeout, quiet_third_party: as `UlyssesDeepSpeedStrategy`'s (a SIGTERM or SLURM's
            requeue signal saves `hpc_ckpt_<n>.ckpt` at the next step boundary on every rank; a rank that raises makes
            the others exit naming it).
        memory: the memory features (`MemoryOptions` or its fields), every one of the DeepSpeed strategy's; or
            `"auto"` (`planning.auto.AutoMemory`), which plans FSDP2's memory (`planning/planner.py`) and keeps the
            optimizer on the device (a pinned `offload_optimizer` share is refused: `RunSpec._check_fsdp2`).
        reshard_after_forward: FSDP2's: free each layer's gathered parameters after its forward (gathered again in
            backward); `False` keeps them, trading memory for one all-gather per layer and step.
        process_group_backend, timeout: `ModelParallelStrategy`'s.

    Checkpoints are torch Distributed Checkpoint folders (`ModelParallelStrategy`'s, always distributed), saved
    atomically with the same manifest as the DeepSpeed strategy's (`checkpoint/`): they resume exactly, at any other
    SP × DP split and on any other number of ranks (Distributed Checkpoint reshards); `python -m lightning_ulysses
    checkpoint export` and the `ExportPretrained` callback write `save_pretrained` folders. `from_pretrained` in
    `configure_model` builds on the meta device; each rank reads its own shards after `fully_shard`
    (`pretrained.ShardedPretrainedLoads`).

    Refused before training (`RunSpec.of_fsdp_arguments`), with the fix: DeepSpeed's options (`stage`, `config`,
    offloads, ...), tensor-parallel sizes, a share of the optimizer on the host, precisions other than 32-true and bf16-mixed
    (bf16-mixed is FSDP2's `MixedPrecisionPolicy`: bf16 compute, fp32 parameters and gradient reduction).
    """

    strategy_name = "ulysses_fsdp"

    def __init__(
        self,
        sequence_parallel_size: Optional[int] = None,
        *,
        ring_size: Optional[int] = None,
        sequence_padding: SequencePadding = "pad",
        sequence_parallel_in_evaluation: bool = True,
        memory: Union[MemoryOptions, str, Mapping[str, Any], None] = None,
        sdpa_kernel_priority: Union[Literal["auto"], Sequence[str], None] = "auto",
        overlap_head_groups: int = 1,
        check_batches: CheckBatches = "first",
        per_rank_values: Optional[PerRankValues] = None,
        reshard_after_forward: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        heartbeat_timeout: Optional[float] = 120.0,
        quiet_third_party: bool = True,
        **unsupported: Any,
    ) -> None:
        # The run's description: what FSDP2 cannot do is refused here, in the launching process (layout later).
        self._requested_run = RunSpec.of_fsdp_arguments(
            {"memory": memory, "reshard_after_forward": reshard_after_forward, **unsupported})
        _, sequence_parallel_size = read_sequence_parallel_size(None, sequence_parallel_size, ring_size)
        # Everything both strategies are made of (`runtime.py`), every argument checked.
        self.runtime = UlyssesRuntime(
            self, sequence_parallel_size=sequence_parallel_size, ring_size=ring_size, sequence_padding=sequence_padding,
            memory=memory, sdpa_kernel_priority=sdpa_kernel_priority, overlap_head_groups=overlap_head_groups,
            check_batches=check_batches, per_rank_values=per_rank_values, heartbeat_timeout=heartbeat_timeout,
            sequence_parallel_in_evaluation=sequence_parallel_in_evaluation, quiet_third_party=quiet_third_party)
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend, timeout=timeout)
        self._shard_mesh = None  # the one-dimensional mesh of all ranks that fully_shard uses (`setup_environment`)
        # from_pretrained in configure_model: built on the meta device, each rank's shards read after fully_shard.
        self._pretrained_loads = ShardedPretrainedLoads()

    @property
    def shard_mesh(self):
        """The mesh of every rank that FSDP2 shards over (for a user's own `fully_shard` in `configure_model`);
        `device_mesh` is the two-dimensional `("data_parallel", "sequence_parallel")` one."""
        if self._shard_mesh is None:
            raise RuntimeError("The meshes exist once the Trainer has set up distributed training.")
        return self._shard_mesh

    # -- environment, groups and meshes -------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        self._enter_process_state()
        # The run on its layout, refused before the process group exists (every rank alike).
        layout = self.runtime.parallel.layout(self.world_size, self.num_processes)
        run = self._requested_run.with_layout(layout, precision=str(self.precision_plugin.precision),
                                              device=self.root_device)
        lightning_private.init_model_parallel_distributed(self)
        self.runtime.parallel.start(run, num_processes=self.num_processes, num_nodes=self.num_nodes, barrier=self.barrier,
                             build_groups=self._build_groups)
        self._shard_mesh = fsdp.world_mesh(self.root_device.type)
        lightning_private.hand_device_mesh(self.lightning_module, lightning_private.device_mesh_of(self))
        self.runtime.random_streams.reset(self.sequence_parallel_rank, self.sequence_parallel_world_size, self.root_device)
        self.runtime.faults.start_watchdog(self.cluster_environment, self.global_rank, self.world_size)

    def _build_groups(self, layout) -> SequenceParallelGroups:
        groups, mesh = SequenceParallelGroups.build_device_mesh(layout, self.root_device.type)
        lightning_private.set_device_mesh(self, mesh)
        return groups

    # -- model preparation and sharding --------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """`ModelParallelStrategy.setup` (re-stated: `_lightning_private.MIRRORED`) without its demand that
        `configure_model` apply the parallelism: the module pipeline prepares the models, then `fully_shard` shards
        them, before the optimizers exist."""
        correct_progress_bar(trainer)
        self.accelerator.setup(trainer)
        found = self._prepare_modules()
        fsdp.shard_models(self.lightning_module, found.memory_engine_models(), self.shard_mesh, self.run_spec,
                          self.root_device, pretrained=self._pretrained_loads)
        lightning_private.materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            lightning_private.optimizers_to_device(self.optimizers, self.root_device)

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """`configure_model`: `from_pretrained` there builds on the meta device and reads nothing; `setup` reads each
        rank's shards once `fully_shard` has placed them (`pretrained.ShardedPretrainedLoads`)."""
        with self._pretrained_loads.deferring(), super().model_sharded_context():
            yield

    # (checkpoints, data loaders and the batch's start: `SequenceParallelHooks`; the shards: torch Distributed
    # Checkpoint, through ModelParallelStrategy's own save and load)

    # -- registry -----------------------------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="DeepSpeed-Ulysses sequence parallelism on FSDP2, SP = devices per node")
