"""The parallel side of a Ulysses strategy's run (fit, validate, test or predict; `UlyssesDeepSpeedStrategy` and
`UlyssesFSDPStrategy` alike), which the strategy's hooks drive with what Lightning knows (ranks, devices, the
backend's settings, the LightningModule):

- `layout` and `start` (the run's distributed set-up): the layout asked for, the run's description (`RunSpec`, which
  the strategy builds from its backend's settings on that layout) and the SP/DP groups, built for every run and released at its end (`release`);
- `scan` and `prepare` (the run's `setup`): the module pipeline of `preparation.py`, with the ring size settled
  from the models' heads in between, and the sharder that cuts each batch in the final layout, publishing the
  batch's whole rows into `batch_rows`;
- `evaluate_whole_rows` / `end_whole_rows`: evaluation without sequence parallelism (opt-in).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_ulysses.attention.core import resolve_ring_size
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequencePadding, SequenceSharder
from lightning_ulysses.integration import engine, preparation
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss


class ParallelRun:
    """The groups, the run's description, the sharder and the prepared module of the strategy's current run.
    `sequence_parallel_size`, `ring_size`: as the strategy was asked (None: devices per node; the largest Ulysses
    degree the heads allow); `sequence_padding`: the sharder's."""

    def __init__(self, sequence_parallel_size: Optional[int], ring_size: Optional[int],
                 sequence_padding: SequencePadding) -> None:
        self.requested_sequence_parallel_size = sequence_parallel_size
        self.requested_ring_size = ring_size
        self.sequence_padding = sequence_padding
        self.groups: Optional[SequenceParallelGroups] = None
        self.spec: Optional[RunSpec] = None  # described in `start`, from the config and the layout
        self.failed = False  # a rank raised in this run (the strategy's `on_exception`): its groups are kept
        self.sharder: Optional[SequenceSharder] = None
        # The sharder publishes each batch's whole rows here; the attention layers read them instead of gathering.
        self.batch_rows = BatchRowsSlot()
        self.prepared = preparation.PreparedModule()  # the undo of the last module preparation
        self.hf_configs: dict[str, Any] = {}  # module path → the config save_pretrained will need (last preparation)
        self.mpu = None  # the DeepSpeed mpu of these groups that the engine was started with last
        self.whole_rows = False  # True while validate/test/predict runs with plain attention

    # -- the run's distributed set-up ----------------------------------------------------------------------------
    def layout(self, world_size: int, num_processes: int) -> ParallelLayout:
        """The layout asked for on `world_size` ranks (SP: devices per node unless given), refused before any
        collective; the ring size is settled against the model's heads in `scan`."""
        size = self.requested_sequence_parallel_size or num_processes
        return ParallelLayout(world_size=world_size, sequence_parallel_size=size,
                              ring_size=self.requested_ring_size or 1).with_ring_size(1)

    def start(self, spec: RunSpec, *, num_processes: int, num_nodes: int, barrier: Callable[[str], None],
              build_groups: Callable[[ParallelLayout], SequenceParallelGroups] = SequenceParallelGroups.build) -> None:
        """The run's description (`spec`, on `layout(...)`: built by the caller from its backend's settings, which
        refuses a configuration that cannot train exactly before any group) and the groups (`build_groups`, on every
        rank: collective): released at the end of every run (`release`), so built again for each; kept only after a
        failed run."""
        layout = spec.layout
        self.spec = spec
        self.failed = False
        if self.groups is not None and self.groups.layout.with_ring_size(1) != layout:
            self.release(layout.world_size, barrier)  # such groups, replaced by another layout
        if self.groups is None or self.groups.released:
            warning = layout.spans_nodes_warning(num_nodes, num_processes)
            if warning:
                rank_zero_warn(warning)
            self.groups = build_groups(layout)
            rank_zero_info(f"lightning_ulysses: {layout}, SP groups {layout.sequence_parallel_groups()}")
        self.use_ring_size(1)

    def use_ring_size(self, ring_size: int) -> None:
        """Split the SP group into Ulysses × ring (sub-groups built once) and shard batches in its layout."""
        if ring_size != self.groups.ring_size and ring_size > 1:
            rank_zero_info(f"lightning_ulysses: {self.groups.layout.with_ring_size(ring_size)}")
        self.groups = self.groups.with_ring_size(ring_size)
        self.spec = self.spec.with_ring_size(ring_size)
        self.sharder = SequenceSharder(self.groups.sequence_parallel_world_size, self.groups.sequence_parallel_rank,
                                       self.sequence_padding, ring_size=ring_size, batch_rows=self.batch_rows)

    def described(self) -> RunSpec:
        if self.spec is None:
            raise RuntimeError("The run is described (run_spec) when the Trainer sets up distributed training: ask it"
                               " inside fit/validate/test/predict.")
        return self.spec

    def built_groups(self) -> SequenceParallelGroups:
        if self.groups is None:
            raise RuntimeError(
                "The sequence-parallel groups are created when the Trainer sets up distributed training. Access them"
                " inside fit/validate/test/predict (e.g. in LightningModule.setup, configure_model or a step)."
            )
        return self.groups

    def loss_function(self) -> SequenceParallelCausalLMLoss:
        """The whole-sequence loss over this run's SP group, reading the batch's rows (the strategy's
        `loss_function`)."""
        groups = self.built_groups()
        group = groups.sequence_parallel_group if groups.sequence_parallel_world_size > 1 else None
        return SequenceParallelCausalLMLoss(group, self.described().loss_gradient_scale, batch_rows=self.batch_rows,
                                            order=groups.shard_order)

    # -- the module pipeline (`preparation.py`) --------------------------------------------------------------------
    def scan(self, module: torch.nn.Module) -> preparation.ModuleScan:
        """Undo the last preparation, scan the models, settle the ring size from their heads (the sub-groups are
        created here) and how the sharder numbers rows given no positions. Every refusal raises before any
        collective, on every rank alike."""
        self.prepared.restore()
        preparation.check_adapters_initialised(module)
        size = self.groups.sequence_parallel_world_size
        found = preparation.scan(module, size)
        if size > 1:  # identical on every rank (same model, same arguments): the sub-groups are created in step
            self.use_ring_size(resolve_ring_size(found.head_counts, size, self.requested_ring_size))
        self.sharder.position_rule = found.position_rule
        return found

    def prepare(self, found: preparation.ModuleScan, runtime: preparation.SequenceParallelRuntime) -> None:
        """Check everything, then prepare everything (`ModuleScan.prepare`); the undo is kept for `restore`."""
        self.prepared = found.prepare(runtime)
        self.hf_configs = self.prepared.hf_configs

    def restore(self) -> None:
        """The user's models with their own attention and loss again."""
        self.prepared.restore()

    @property
    def batches_are_sharded(self) -> bool:
        return self.sharder is not None and not self.whole_rows

    # -- evaluation without sequence parallelism (opt-in) ----------------------------------------------------------
    def evaluate_whole_rows(self, module: torch.nn.Module) -> None:
        """validate/test/predict with whole rows: the models' own attention and loss, SP metrics synced over DP."""
        if not self.whole_rows:
            self.restore()
            self.whole_rows = True
            self.prepared = preparation.bind_for_whole_rows(module, self.groups)

    def end_whole_rows(self) -> bool:
        """Whether evaluation ran on whole rows (the caller prepares the modules again for the training after it)."""
        was, self.whole_rows = self.whole_rows, False
        return was

    # -- the run's end -------------------------------------------------------------------------------------------
    def end(self) -> None:
        self.restore()
        self.batch_rows.rows = None  # the last batch's rows are not kept alive after the Trainer is done

    def release(self, world_size: int, barrier: Callable[[str], None]) -> None:
        """Destroy the SP/DP groups (and Ulysses/ring sub-groups) of this run, at the end of every run (the next one,
        e.g. validate after fit, builds them again): otherwise every Trainer of a process leaves its groups registered
        for good (gloo: a connection thread each; NCCL: communicators and their GPU memory). On every rank alike, after
        a `barrier` (no collective on them is pending anywhere), in creation order (`SequenceParallelGroups.release`);
        DeepSpeed forgets the engine's `mpu` first, after every run (local: no collective). The groups are not
        destroyed after a run that raised on a rank of a multi-rank job: the ranks may not all get here (the others
        leave through `faults`), and the barrier would wait for them."""
        engine.forget_mpu(self.mpu)  # set when the engine started (`engine.initialize`)
        self.mpu = None
        groups = self.groups
        if groups is None or groups.released or (self.failed and world_size > 1):
            return
        if world_size > 1:
            barrier("lightning_ulysses.release_groups")
        groups.release()  # sizes and ranks stay readable (`groups`), the groups do not
