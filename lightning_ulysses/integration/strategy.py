"""`UlyssesDeepSpeedStrategy`: Lightning glue only.

groups (layout.py) → DP-only sampler → sequence sharding (sharding.py) → Ulysses attention (attention/) →
SP-aware loss (loss.py) → DeepSpeed with an `mpu`, so ZeRO partitions and reduces over all DP×SP ranks.
The policies live with their owners: the run's description (layout, ZeRO options, precision, device; the DeepSpeed
config and its dialect) in `run_spec`, `memory="auto"` in `auto`, the DeepSpeed engine's start and release in
`engine`, the checkpoint protocol and resume state in `checkpoint`, signals, requeue and the rank watchdog in
`faults`, the start-up report in `preflight`; every private Lightning name the strategy needs is reached through
`_lightning_private`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.planning import auto, preflight
from lightning_ulysses.integration import console, engine, faults, preparation, pretrained
from lightning_ulysses.attention import copy_engine
from lightning_ulysses.attention.backends import check_sdpa_kernel_priority, sdpa_priority
from lightning_ulysses.attention.core import check_overlap_head_groups, resolve_ring_size
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.check import CheckBatches, SameBatchCheck
from lightning_ulysses.integration.callbacks import correct_progress_bar
from lightning_ulysses.integration.checkpoint.resume import StrategyCheckpoints
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.memory import MemoryOptions, apply_allocator_settings
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss, refuse_shard_local_loss
from lightning_ulysses.integration.notebook import configure_launcher
from lightning_ulysses.integration.rng import SequenceParallelRNG, seed_workers_by_data_parallel_rank
from lightning_ulysses.parallel.run_spec import RunSpec, deep_merge, inference_config, read_sequence_parallel_size
from lightning_ulysses.batch.sharding import SequencePadding, SequenceSharder

# A child of Lightning's logger, so the start-up report prints wherever Lightning's own messages do.
_log = logging.getLogger("lightning.pytorch.ulysses")


def _step_hook(name: str) -> Callable[..., Any]:
    """The parent's step hook `name` under the strategy's SDPA kernel order and, on shards, drawing from this SP
    rank's own random stream (`rng.py`)."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_priority(self.sdpa_kernel_priority), self._step_random_stream():
            return getattr(super(UlyssesDeepSpeedStrategy, self), name)(*args, **kwargs)

    step.__name__ = step.__qualname__ = name
    return override(step)


def _from_groups(name: str) -> property:
    return property(lambda self: getattr(self.parallel_groups, name), doc=f"`parallel_groups.{name}`")


class UlyssesDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed (ZeRO) with DeepSpeed-Ulysses sequence parallelism.

    Args:
        sequence_parallel_size: ranks that share one sequence (each holds `seq / sequence_parallel_size`
            tokens). Must divide the number of processes and the model's head count. `None` (the default):
            the number of devices per node, so every SP group is one node and DP runs across nodes. `1`: plain
            ZeRO. May also come from a DeepSpeed config block `"ulysses": {"enable": true,
            "sequence_parallel_world_size": N}`, which is removed before DeepSpeed sees the config.
        ring_size: how many ranks of each SP group form a ring (ring attention, K/V blocks passed around) while
            the other factor, `sequence_parallel_size / ring_size`, splits heads with Ulysses all-to-alls (hybrid,
            for SP sizes the head counts cannot follow). `None` (default): the largest Ulysses degree the model's
            head counts allow, so pure Ulysses whenever possible. With a ring, each rank holds two zig-zag chunks
            of the sequence (causal load balance) and lengths are padded to a multiple of
            `lcm(sequence_parallel_size, 2 · ring_size)`.
        sequence_padding: `"pad"` (default) pads sequences whose length is not a multiple of the SP size at the
            end, with ignored labels; `"error"` rejects them.
        stage: ZeRO stage; 3 by default (parameters, gradients and optimizer state sharded over all ranks).
        sequence_parallel_in_evaluation: `False` runs validate/test/predict (also the validation inside fit) with
            whole sequences and the models' own attention and loss, on every rank of the SP group; training
            stays sequence-parallel. For evaluation lengths that fit on one device.
        config_overrides: merged (recursively) into the DeepSpeed config built from the other arguments, for
            settings that have no argument, e.g. `{"data_types": {"grad_accum_dtype": "fp32"}}`; `None` values
            are skipped.
        memory: the long-sequence memory features (`lightning_ulysses.memory.MemoryOptions` or a mapping of its
            fields: tiled MLP, tiled logits + loss, activation checkpointing with host offload, expandable segments),
            applied to every Hugging Face causal LM and native GPT in the module; all off by default. `"auto"` (or
            `lightning_ulysses.planning.auto.AutoMemory`, or a mapping with `"auto": True` and its fields, e.g.
            `{"auto": True, "seq_len": 131072, "tiled_mlp": False}`): the planner picks the features, the optimizer's
            share on the host and its sub-group size with the shortest predicted step that fits the free memory of
            every rank, once, in `setup`; fields given are kept; the decision is logged (`memory_choice`).
        start_method: how the ranks are started. `None` (the default): Lightning's script launch (re-runs the
            script, or ranks come from torchrun/SLURM). `"fork"`: fork the current process, for Jupyter notebooks
            (`strategy="ulysses_notebook"`); see `lightning_ulysses.integration.notebook`.
        sdpa_kernel_priority: SDPA kernels to try first, in order, for every training/evaluation step and its
            backward, e.g. `("cudnn",)` on Hopper GPUs (names: cudnn, flash, efficient, math; the others follow in
            torch's order). `None` (default): torch's own order, which tries flash first; cuDNN's causal kernels are
            faster on Hopper (measured: `benchmarks/results/`).
        overlap_head_groups: cut the attention heads into this many groups and pipeline them, so that one group's
            all-to-alls run while another group's attention computes (forward and backward); exact for any value.
            1 (default): no overlap. A count the heads do not allow (each group must give every SP rank whole
            query and KV heads) runs with the largest smaller one; with a ring (`ring_size > 1`) it is not used (the
            ring overlaps its own K/V exchanges). Measured: `benchmarks/results/`.
        exchange: the transport of the Ulysses all-to-alls. `"nccl"`: `all_to_all_single` (NCCL on GPUs, gloo on
            CPU). `"copy_engine"`: every rank copies its pieces straight into its peers' symmetric-memory buffers,
            the layout permute fused into the copies, run by the copy engines instead of SM kernels (so they do not
            slow the attention they overlap); needs CUDA, the SP group on one host with peer access between its
            GPUs, torch symmetric memory and NVLink multicast off (`NCCL_NVLS_ENABLE=0`,
            `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NVSHMEM_DISABLE_NVLS=1` in the environment), refused otherwise.
            `"auto"`: the copy engine where all of that holds on every rank of the group, else NCCL with one log
            line naming why (on CPU: gloo, silently). `"nccl"` is the default until the copy engine has run on
            GPUs: it is exact against NCCL on CPU through an emulation of its copies, and nothing CUDA-specific of
            it has run yet.
        check_batches: whether the ranks of an SP group are compared to hold the same batch (one tiny all-gather
            of a fingerprint per checked batch; ranks fed different samples, e.g. by an `IterableDataset` sharded by
            global rank or a sampler of its own, train silently wrong otherwise): `"first"` (default) the first
            batches of every loop, `"every"` each batch (debugging), `"never"`.
        zero3_leaf_layers: under ZeRO-3, gather each decoder layer's parameters whole, once around its forward and
            once around its backward (DeepSpeed "leaf" modules), instead of linear by linear: a few hooks per layer
            instead of one set per submodule, the host work that bounds short steps (measured:
            `benchmarks/results/`). Costs one layer's 16-bit parameters gathered at a time, which the planner
            counts. Left off for `checkpoint_interval` > 1 (a stretch's recompute runs layers outside their hooks).
            `True` by default; the same math either way.
        heartbeat_timeout: seconds after which a rank that stopped sending heartbeats (killed, crashed, frozen)
            makes every other rank exit with status 75 and a message naming it, instead of hanging until the
            collective timeout (`lightning_ulysses.integration.faults`). `None` turns the watchdog off.
        quiet_third_party: hide, by their own texts, the third-party messages nobody can act on (torch's
            deprecations of the collectives DeepSpeed calls, Lightning's tips and migration notes, DeepSpeed's op
            probes and "untested optimizer" for SGD, Lightning's "not resumable" where the resume is exact; the list:
            `lightning_ulysses.integration.console`), from the strategy's creation on, in every rank. Their other warnings,
            every error and everything of this package still show. `False` installs nothing.
        **kwargs: every other `lightning.pytorch.strategies.DeepSpeedStrategy` argument.

    Checkpoints (`lightning_ulysses.integration.checkpoint`) are saved atomically, resume exactly (RNG states and the position
    in the epoch's data included), resume at any other SP × DP split of the same number of ranks, and are
    exported with `python -m lightning_ulysses checkpoint export`. A SIGTERM (and, under SLURM with Lightning's
    auto-requeue on, its requeue signal SIGUSR1) saves `hpc_ckpt_<n>.ckpt` in the Trainer's `default_root_dir` at
    the next step boundary, on every rank together; `fit` then raises Lightning's `SIGTERMException`, a `SystemExit`
    without status, so a script that lets it through exits with status 0 (`recipes/train.py` exits with
    `faults.EXIT_PREEMPTED`, 79, and prints the command that continues the run). Resume with `ckpt_path="hpc"` (the
    highest-numbered one) or its path; SLURM requeues the job when auto-requeue is on. A rank that raises makes the
    others exit at once naming it.
    """

    strategy_name = "ulysses"

    def __init__(
        self,
        sequence_parallel_size: Optional[int] = None,
        *,
        ring_size: Optional[int] = None,
        sequence_padding: SequencePadding = "pad",
        stage: int = 3,
        config: Optional[Union[str, dict[str, Any]]] = None,
        config_overrides: Optional[Mapping[str, Any]] = None,
        sequence_parallel_in_evaluation: bool = True,
        memory: Union[MemoryOptions, "auto.AutoMemory", str, Mapping[str, Any], None] = None,
        start_method: Optional[Literal["fork"]] = None,
        heartbeat_timeout: Optional[float] = 120.0,
        sdpa_kernel_priority: Union[Literal["auto"], Sequence[str], None] = "auto",
        overlap_head_groups: int = 1,
        check_batches: CheckBatches = "first",
        exchange: copy_engine.Exchange = "nccl",
        zero3_leaf_layers: bool = True,
        quiet_third_party: bool = True,
        **kwargs: Any,
    ) -> None:
        if quiet_third_party:  # first: Lightning's Trainer prints its notes, and DeepSpeed is first imported, below
            console.quiet_third_party()
        self.quiet_third_party = quiet_third_party
        memory = auto.coerce_memory(memory)  # bad options fail here, in the launching process
        if sdpa_kernel_priority != "auto":
            sdpa_kernel_priority = check_sdpa_kernel_priority(sdpa_kernel_priority)
        check_overlap_head_groups(overlap_head_groups)
        self._requested_exchange = copy_engine.check_exchange(exchange)
        config, sequence_parallel_size = read_sequence_parallel_size(
            lightning_private.load_deepspeed_config(self, config), sequence_parallel_size, ring_size)
        if sequence_padding not in ("pad", "error"):
            raise ValueError(f"sequence_padding must be 'pad' or 'error', got {sequence_padding!r}")
        if heartbeat_timeout is not None and heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat_timeout must be a positive number of seconds or None, got {heartbeat_timeout}.")
        if start_method not in (None, "fork"):
            raise ValueError(
                f"start_method must be None (script launch) or 'fork' (notebooks), got {start_method!r}."
            )
        super().__init__(stage=stage, config=config, **kwargs)
        if config_overrides:
            self.config = deep_merge(self.config, config_overrides)
        self._requested_sequence_parallel_size = sequence_parallel_size
        self._requested_ring_size = ring_size
        self.sequence_padding = sequence_padding
        self._groups: Optional[SequenceParallelGroups] = None
        self._run: Optional[RunSpec] = None  # described in `setup_distributed`, from the config and the layout
        self._mpu = None  # the DeepSpeed mpu of our groups that `_initialize_engine` set last
        self._run_failed = False  # a rank raised in this run (`on_exception`): its groups are not released
        self._sharder: Optional[SequenceSharder] = None
        # The sharder publishes each batch's whole rows here; the attention layers read them instead of gathering.
        self._batch_rows = BatchRowsSlot()
        self._prepared = preparation.PreparedModule()  # the undo of the last module preparation
        self.sequence_parallel_in_evaluation = sequence_parallel_in_evaluation
        # `memory="auto"` is decided in `setup` (`_decide_auto`); until then `memory` is the request.
        self.memory: Union[MemoryOptions, auto.AutoMemory] = memory
        self.memory_choice: Optional[auto.AutoChoice] = None
        # What the first training steps measured against the choice (`AutoMemory.confirm_steps`), once known.
        self.memory_confirmation: Optional[auto.Confirmation] = None
        self._memory_probe: Optional[auto.StepProbe] = None  # until it has confirmed
        self._unsharded_evaluation = False  # True while validate/test/predict runs with plain attention
        # Ours, not DDPStrategy's `_start_method` (which DeepSpeedStrategy leaves at "popen", the script launch).
        self.start_method = start_method
        self.heartbeat_timeout = heartbeat_timeout
        self._requested_sdpa_kernel_priority = sdpa_kernel_priority
        # "auto" is decided in `setup`; until then (and on CPU, where torch ignores it) torch's order
        self.sdpa_kernel_priority = None if sdpa_kernel_priority == "auto" else sdpa_kernel_priority
        self.overlap_head_groups = overlap_head_groups
        self.zero3_leaf_layers = zero3_leaf_layers
        self.exchange: Optional[str] = None  # "nccl" or "copy_engine" once agreed in `setup` (`_decide_exchange`)
        self._transport = None  # the all-to-all transport `_decide_exchange` agreed (None: the collective one)
        self._batch_check = SameBatchCheck(check_batches)
        self._watchdog: Optional[faults.RankWatchdog] = None
        self._signals = faults.SchedulerSignals()
        # Dropout masks differ between the SP ranks: the steps draw from a stream of their own (`rng.py`).
        self._random_streams = SequenceParallelRNG()
        self._checkpoints = StrategyCheckpoints(self, self._random_streams, quiet=quiet_third_party)
        # Micro-batches whose gradients the engine holds without having stepped yet (`backward`): a checkpoint
        # saved inside an accumulation window records it, and a resume from it is refused (`checkpoint/resume.py`).
        self.micro_batches_accumulated = 0
        self._hf_model_configs: dict[str, Any] = {}  # module path → the config save_pretrained will need
        self._preflight_reported = False

    # -- the run and its parallel layout -------------------------------------------------------------------------
    @property
    def run_spec(self) -> RunSpec:
        """The run's description (`run_spec.RunSpec`: layout, ZeRO stage and offload, precision, device), made when
        the Trainer sets up distributed training from the DeepSpeed config; every reader asks it, not the config."""
        if self._run is None:
            raise RuntimeError("The run is described (run_spec) when the Trainer sets up distributed training: ask it"
                               " inside fit/validate/test/predict.")
        return self._run

    @property
    def parallel_groups(self) -> SequenceParallelGroups:
        """The SP/DP groups of this rank; available once the strategy has set up distributed training."""
        if self._groups is None:
            raise RuntimeError(
                "The sequence-parallel groups are created when the Trainer sets up distributed training. Access them"
                " inside fit/validate/test/predict (e.g. in LightningModule.setup, configure_model or a step)."
            )
        return self._groups

    # This rank's SP and DP process groups, ranks and sizes, as `parallel_groups` holds them.
    sequence_parallel_group = _from_groups("sequence_parallel_group")
    sequence_parallel_rank = _from_groups("sequence_parallel_rank")
    sequence_parallel_world_size = _from_groups("sequence_parallel_world_size")
    data_parallel_group = _from_groups("data_parallel_group")
    data_parallel_rank = _from_groups("data_parallel_rank")
    data_parallel_world_size = _from_groups("data_parallel_world_size")

    @property
    def hf_model_configs(self) -> dict[str, Any]:
        """Module path → config of every Hugging Face model the strategy prepared, as the user built it (while it
        trains the model holds a copy with Ulysses attention): what `save_pretrained` of the trained model needs."""
        return dict(self._hf_model_configs)

    @property
    def check_batches(self) -> CheckBatches:
        return self._batch_check.mode

    @property
    def batches_are_sharded(self) -> bool:
        """Whether the step sees this rank's shard of the batch (False during evaluation with
        `sequence_parallel_in_evaluation=False`, where whole batches pass through)."""
        return self._sharder is not None and not self._unsharded_evaluation

    @property
    def loss_function(self) -> SequenceParallelCausalLMLoss:
        """`loss_function(logits, labels)`: the whole-sequence token-mean loss with the right ZeRO gradient, for
        modules that compute their loss from logits. `labels`: as Hugging Face takes them, unshifted — the batch's
        `labels`, `batch["input_ids"]`, labels built in the step; see `SequenceParallelCausalLMLoss`."""
        groups = self.parallel_groups
        group = groups.sequence_parallel_group if groups.sequence_parallel_world_size > 1 else None
        return SequenceParallelCausalLMLoss(group, self.run_spec.loss_gradient_scale, batch_rows=self._batch_rows,
                                            order=groups.shard_order)

    # -- launch, environment and groups ------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        if not configure_launcher(self):  # fork, or no launch in a notebook (notebook.py); else Lightning's own
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        apply_allocator_settings(self.memory)  # before this rank initialises CUDA (AutoMemory has the field too)
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
        else:
            # DeepSpeedStrategy refuses non-CUDA accelerators; DeepSpeed itself runs on CPU with gloo.
            DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        if isinstance(self.accelerator, CUDAAccelerator):
            lightning_private.validate_device_index_selection(self.parallel_devices)  # CPU devices have no index
        else:
            engine.skip_shared_memory_all_reduce_build(quiet=self.quiet_third_party)
        reset_seed()
        self.set_world_ranks()
        lightning_private.init_deepspeed_distributed(self)
        self._setup_parallel_groups()
        # After `reset_seed`, on every set-up (fit twice seeds it twice alike); a resume restores it later, at the
        # first batch or (at an epoch boundary) in `process_dataloader`, both after this.
        self._random_streams.reset(self.sequence_parallel_rank, self.sequence_parallel_world_size, self.root_device)
        if self._watchdog is None:
            self._watchdog = faults.start_watchdog(self.cluster_environment, self.global_rank, self.world_size,
                                                   self.heartbeat_timeout)

    def _setup_parallel_groups(self) -> None:
        size = self._requested_sequence_parallel_size or self.num_processes
        # Raises before any collective; the ring size is settled against the model's heads in _prepare_modules.
        layout = ParallelLayout(world_size=self.world_size, sequence_parallel_size=size,
                                ring_size=self._requested_ring_size or 1).with_ring_size(1)
        # Refuses a configuration that cannot train exactly, before any group.
        self._run = RunSpec.of_config(self.config, layout=layout, precision=str(self.precision_plugin.precision),
                                      device=self.root_device)
        self._run_failed = False
        # Released at the end of every run (`teardown`), so built again for each; kept only after a failed run.
        if self._groups is not None and self._groups.layout.with_ring_size(1) != layout:
            self._release_groups()  # such groups, replaced by another layout
        if self._groups is None or self._groups.released:
            warning = layout.spans_nodes_warning(self.num_nodes, self.num_processes)
            if warning:
                rank_zero_warn(warning)
            self._groups = SequenceParallelGroups.build(layout)
            rank_zero_info(f"lightning_ulysses: {layout}, SP groups {layout.sequence_parallel_groups()}")
        self._use_ring_size(1)

    def _use_ring_size(self, ring_size: int) -> None:
        """Split the SP group into Ulysses × ring (sub-groups built once) and shard batches in its layout."""
        if ring_size != self._groups.ring_size and ring_size > 1:
            rank_zero_info(f"lightning_ulysses: {self._groups.layout.with_ring_size(ring_size)}")
        self._groups = self._groups.with_ring_size(ring_size)
        self._run = self._run.with_ring_size(ring_size)
        self._sharder = SequenceSharder(self._groups.sequence_parallel_world_size, self._groups.sequence_parallel_rank,
                                        self.sequence_padding, ring_size=ring_size, batch_rows=self._batch_rows)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every rank of an SP group must see the same samples; only DP groups get different ones.
        groups = self.parallel_groups
        return {"num_replicas": groups.data_parallel_world_size, "rank": groups.data_parallel_rank}

    # -- model preparation --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        # Under ZeRO-3, `from_pretrained` in `configure_model` loads straight into the partitions (`pretrained.py`).
        with super().model_sharded_context(), pretrained.zero3_loading(self.config if self.zero_stage_3 else None):
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.micro_batches_accumulated = 0  # a new engine holds no gradients
        correct_progress_bar(trainer)  # before the bar draws anything (its first draw is at `on_train_start`)
        self._prepare_modules()
        super().setup(trainer)
        # Once per node (links, NUMA and host memory are per machine) and per strategy: fit → validate → test in
        # one process sets up again on the same machine.
        if self.local_rank == 0 and not self._preflight_reported:
            self._preflight_reported = True
            _log.info(preflight.format_report(preflight.check(preflight.PlannedRun.of_strategy(self)),
                                              title=f"lightning_ulysses preflight (node {self.node_rank})"))

    @override
    def on_train_start(self) -> None:
        # Lightning registers its signal handlers after `setup`; replace its collective ones once they exist.
        self._signals.install(self.lightning_module.trainer, self.cluster_environment)
        super().on_train_start()

    def _prepare_modules(self) -> None:
        """The module pipeline (`preparation.py`): scan the models, settle the ring size from their heads, build the
        runtime, check everything, then prepare everything."""
        self._restore_modules()
        preparation.check_adapters_initialised(self.lightning_module)  # raises before any collective, on every rank alike
        size = self.parallel_groups.sequence_parallel_world_size
        found = preparation.scan(self.lightning_module, size)  # raises before any collective
        if size > 1:  # identical on every rank (same model, same arguments): the sub-groups are created in step
            self._use_ring_size(resolve_ring_size(found.head_counts, size, self._requested_ring_size))
        self._sharder.position_rule = found.position_rule
        self._decide_exchange()
        self._decide_auto(found)
        runtime = preparation.SequenceParallelRuntime(
            self.parallel_groups, self._sharder, self._batch_rows, self.loss_function, self.memory,
            self.overlap_head_groups, leaf_layers=self.zero3_leaf_layers and self.zero_stage_3,
            transport=self._transport)
        self._prepared = found.prepare(runtime)
        self._hf_model_configs = self._prepared.hf_configs

    def _decide_exchange(self) -> None:
        """`exchange`, agreed over the Ulysses group: off CUDA without a collective (the accelerator is the same on
        every rank), on CUDA by the largest failure code of every rank's probe (one all-reduce), so that every rank
        takes the same transport and an impossible `"copy_engine"` is refused on every rank alike."""
        groups = self.parallel_groups
        group = groups.ulysses_group if groups.ulysses_size > 1 else None
        self._transport = None
        if group is None:
            self.exchange = "nccl"  # nothing is exchanged
            return
        if self._requested_exchange == "nccl" or not isinstance(self.accelerator, CUDAAccelerator):
            failure = 1  # not (to be) on CUDA devices
        else:
            ranks = torch.distributed.get_process_group_ranks(group)
            base = self.node_rank * self.num_processes  # this host's first global rank (contiguous groups)
            on_host = all(base <= r < base + self.num_processes for r in ranks)
            peers = [self.parallel_devices[r - base] for r in ranks if on_host and r != self.global_rank]
            probe = copy_engine.probe_copy_engine([self.root_device] + peers, on_host)
            failure = copy_engine.agreed_failure(probe, group, self.root_device)
        self.exchange = copy_engine.choose_exchange(self._requested_exchange, failure)
        # Handed to this run's models only (`SequenceParallelRuntime.transport`, on their bindings).
        self._transport = copy_engine.transport_for(self.exchange)

    def _decide_auto(self, found: preparation.ModuleScan) -> None:
        """`memory="auto"` and `sdpa_kernel_priority="auto"`, once per run (`auto.decide`); the optimizer offload
        chosen is written into the DeepSpeed config through the run's description."""
        request = self.memory
        kernel_auto = self._requested_sdpa_kernel_priority == "auto"
        cuda = isinstance(self.accelerator, CUDAAccelerator)
        if not (isinstance(request, auto.AutoMemory) or (kernel_auto and cuda)) or self.memory_choice is not None:
            return
        models = [m for adapter, modules in found.found if isinstance(adapter, preparation.MemoryEngine)
                  for m in modules]
        self.sdpa_kernel_priority, choice = auto.decide(
            request, self._run, models, kernel_priority=self._requested_sdpa_kernel_priority if kernel_auto
            else self.sdpa_kernel_priority, local_ranks=self.num_processes,
            reduce=torch.distributed.is_initialized() and self.world_size > 1)
        if choice is None:
            return
        self.memory, self.memory_choice = choice.memory, choice
        if request.confirm_steps:
            self._memory_probe = auto.StepProbe(choice, int(request.confirm_steps),
                                                self.lightning_module.trainer.accumulate_grad_batches)
        self._run = self._run.with_memory_choice(choice.offload_optimizer, choice.sub_group_size)
        self.config.update(self._run.written_into(self.config))  # in place: the dict Lightning and DeepSpeed read
        rank_zero_info(choice.report())

    def _restore_modules(self) -> None:
        self._prepared.restore()

    @override
    def teardown(self) -> None:
        # The user's models leave the Trainer with their own attention and loss again.
        self._restore_modules()
        self._batch_rows.rows = None  # the last batch's rows are not kept alive after the Trainer is done
        self._checkpoints.end_resume()  # a resumed run that trained no batch
        self._release_groups()  # while the watchdog runs: a rank lost at the barrier is named, not waited for
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        super().teardown()
        try:
            # The engine stays `self.model` until the next run replaces it: `trainer.save_checkpoint` after `fit`
            # still saves through it (it needs no hook).
            engine.release(self.model)
        except Exception as error:  # DeepSpeed internals this relies on moved: a leak, not a reason to fail the run
            rank_zero_warn(f"lightning_ulysses: the DeepSpeed engine of this run could not be freed ({error!r}); it"
                           " stays in memory until the process ends.")

    def _release_groups(self) -> None:
        """Destroy the SP/DP groups (and Ulysses/ring sub-groups) this strategy created, at the end of every run
        (the next one, e.g. validate after fit, builds them again): otherwise every Trainer of a process leaves its
        groups registered for good (gloo: a connection thread each; NCCL: communicators and their GPU memory).
        On every rank alike, after a barrier (no collective on them is pending anywhere), in creation order
        (`SequenceParallelGroups.release`). Not after a run that raised on a rank of a multi-rank job: the ranks
        may not all get here (the others leave through `faults`), and the barrier would wait for them."""
        groups = self._groups
        if groups is None or groups.released or (self._run_failed and self.world_size > 1):
            return
        engine.forget_mpu(self._mpu)  # set by `_initialize_engine`
        self._mpu = None
        if self.world_size > 1:
            self.barrier("lightning_ulysses.release_groups")
        groups.release()  # sizes and ranks stay readable (`parallel_groups`), the groups do not

    # -- evaluation without sequence parallelism (opt-in) ----------------------------------------------------------
    # The parents' validation/test/predict start and end hooks are no-ops, so one pair serves all three loops.
    @override
    def on_validation_start(self) -> None:
        if not self.sequence_parallel_in_evaluation and not self._unsharded_evaluation:
            self._restore_modules()
            self._unsharded_evaluation = True
            self._prepared = preparation.bind_for_whole_rows(self.lightning_module, self.parallel_groups)

    @override
    def on_validation_end(self) -> None:
        if self._unsharded_evaluation:
            self._unsharded_evaluation = False
            self._prepare_modules()  # back to sequence parallelism for the training that may follow

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    # -- DeepSpeed engine -----------------------------------------------------------------------------------------
    # Lightning's two `deepspeed.initialize` call sites, re-stated with the arguments Lightning passes (2.6) plus
    # two: our `mpu` (without it ZeRO reduces and partitions as if every rank held different data) and the device
    # rank, which Lightning leaves None on CPU (DeepSpeed then crashes comparing None >= 0).
    @override
    def _setup_model_and_optimizer(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer],
                                   lr_scheduler: Optional[Any] = None) -> tuple[Any, Any]:
        auto.check_optimizer(self.memory_choice, optimizer)
        with console.verified_optimizer(optimizer) if self.quiet_third_party else contextlib.nullcontext():
            started, deepspeed_optimizer, _, _ = self._initialize_engine(
                config=self.config, model=model, model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
                optimizer=optimizer, lr_scheduler=lr_scheduler)
        return started, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: torch.nn.Module) -> None:
        lightning_private.remove_module_hooks(model)  # as Lightning does before it builds the inference engine
        self.model, _, _, _ = self._initialize_engine(
            config=inference_config(self.config, self.zero_stage_3), model=model, optimizer=None, lr_scheduler=None,
            model_parameters=[])

    def _initialize_engine(self, **kwargs: Any) -> tuple[Any, ...]:
        device_rank = self.root_device.index if self.root_device.index is not None else self.local_rank
        started, self._mpu = engine.initialize(self.parallel_groups, device_rank, **kwargs)
        return started

    # -- checkpoints (`checkpoint.resume.StrategyCheckpoints`) -------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Atomic: every rank writes into `<path>.partial`; rank 0 renames it to `<path>` once all have finished."""
        self._checkpoints.save(checkpoint, filepath, storage_options, super().save_checkpoint, self._hf_model_configs)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, functools.partial(super().load_checkpoint,
                                                                         weights_only=weights_only))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._checkpoints.load_model_state_dict(checkpoint, strict):
            super().load_model_state_dict(checkpoint, strict)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """After a resume in the middle of an epoch, skip the samples that epoch already trained on; seed data-loader
        workers by the DP rank, so that the ranks of an SP group load the same samples."""
        dataloader = self._checkpoints.process_dataloader(dataloader)
        seed_workers_by_data_parallel_rank(dataloader, self.parallel_groups.data_parallel_rank)
        return dataloader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._checkpoints.on_train_batch_start()  # the resumed random generators; the epoch of the batch's data
        self._signals.agree(self.lightning_module.trainer, self.world_size, self.root_device)
        self._confirm_memory_choice()
        super().on_train_batch_start(batch, batch_idx)

    def _confirm_memory_choice(self) -> None:
        """`memory="auto"`: time the first steps of the first fit and log them against the prediction."""
        if self._memory_probe is None:
            return
        confirmation = self._memory_probe.on_batch_start(
            self.root_device, torch.distributed.is_initialized() and self.world_size > 1)
        if confirmation is not None:
            self.memory_confirmation, self._memory_probe = confirmation, None
            (rank_zero_warn if confirmation.exceeds_plan else rank_zero_info)(confirmation.report())

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._run_failed = True  # the groups are not released at this run's teardown (`_release_groups`)
        if isinstance(exception, SIGTERMException) and self._groups is not None:
            # Raised on every rank at the same step boundary (`SchedulerSignals.agree`): all ranks save together.
            self._signals.save_and_requeue(self.lightning_module.trainer, self.cluster_environment,
                                           self.is_global_zero)
        else:
            faults.on_rank_exception(self._watchdog, exception)  # the other ranks leave at once, naming this one
        super().on_exception(exception)

    # -- steps ----------------------------------------------------------------------------------------------------
    # The SDPA kernel priority holds for every step and its backward: a recompute in backward must pick the kernels
    # its forward picked (keep_attention_outputs replays them). Lightning has no single point around both (its
    # precision plugin's step contexts wrap the forward only), so each hook enters the same context here; the SP
    # rank's own random stream (`rng.py`) is entered alongside.
    training_step = _step_hook("training_step")
    validation_step = _step_hook("validation_step")
    test_step = _step_hook("test_step")
    predict_step = _step_hook("predict_step")

    def _step_random_stream(self) -> contextlib.AbstractContextManager:
        """This SP rank's own random stream while batches are sharded (each rank drops its own tokens and heads);
        whole rows (`sequence_parallel_in_evaluation=False`) draw from the shared one, alike on every rank."""
        return self._random_streams.steps() if self.batches_are_sharded else contextlib.nullcontext()

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning's automatic optimization already divides each micro-batch's loss by `accumulate_grad_batches`
        # (`loops/optimization/automatic.py`) and gives DeepSpeed the same k as `gradient_accumulation_steps`;
        # `DeepSpeedEngine.backward` would divide by k again (`scale_wrt_gas`), making every update (and the norm
        # that gradient clipping compares) k times too small. DeepSpeed still counts the micro-steps, so its step
        # boundary stays where it was; its loss scaler (fp16) is applied either way. Manual optimization has k = 1.
        kwargs.setdefault("scale_wrt_gas", False)
        if self.batches_are_sharded:  # a loss of this rank's shard alone is refused at SP > 1
            refuse_shard_local_loss(args[0] if args else kwargs["closure_loss"], self.sequence_parallel_world_size)
        if self.lightning_module is not None and self.lightning_module.automatic_optimization:
            self._mark_accumulation_boundary()
        with sdpa_priority(self.sdpa_kernel_priority), self._step_random_stream():
            return super().backward(*args, **kwargs)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning's loop owns the accumulation windows, as for DDP — they restart at every epoch, the
        epoch's last (partial) window steps too, and only a window's last micro-batch reaches `optimizer_step`
        (`engine.step()`). Lightning's `DeepSpeedStrategy` says True and lets DeepSpeed count micro-steps over the
        whole run instead: whenever an epoch's batches are not a multiple of `accumulate_grad_batches`, the two step at
        different micro-batches and a partial window's gradients leak into the next epoch's first step (1.5× the
        update measured, issue 37). The engine learns where each window ends in `backward`."""
        return False

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: Lightning enters this around a window's inner micro-batches (now that it owns the windows)
        and would call the engine's `no_sync`, which ZeRO-2/3 refuse; the boundary set in `backward` already keeps
        ZeRO from reducing before the window's last micro-batch."""
        yield None

    def _mark_accumulation_boundary(self) -> None:
        """Tell the engine, before this micro-batch's backward, whether it ends Lightning's accumulation window:
        ZeRO reduces (and DeepSpeed's `step` applies) at that boundary and only there. DeepSpeed's own counter of
        micro-steps would not know about epochs, `limit_train_batches` or an iterable dataset's end."""
        ends_window = not lightning_private.should_accumulate(self.lightning_module.trainer)
        self.model.set_gradient_accumulation_boundary(ends_window)
        self.micro_batches_accumulated = 0 if ends_window else self.micro_batches_accumulated + 1

    # -- data ---------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if not self.batches_are_sharded:
            return batch
        self._batch_check(batch, self.parallel_groups, self.lightning_module.trainer.state.stage, self.root_device,
                          self.global_rank)
        return self._sharder(batch)

    # -- registry -----------------------------------------------------------------------------------------------
    _REGISTERED = {  # name: (description, arguments)
        "ulysses": ("DeepSpeed-Ulysses sequence parallelism, ZeRO-3, SP = devices per node", {}),
        **{f"ulysses_stage_{stage}": (f"DeepSpeed-Ulysses with ZeRO stage {stage}", {"stage": stage})
           for stage in (1, 2, 3)},
        "ulysses_notebook": ("DeepSpeed-Ulysses with ZeRO-3, ranks forked from the current process (Jupyter notebooks)",
                             {"start_method": "fork"}),
        "ulysses_stage_3_offload": ("DeepSpeed-Ulysses with ZeRO-3, optimizer and parameters offloaded to CPU",
                                    {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
    }

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        # Not calling super(): it would re-register the "deepspeed*" names, which the registry refuses.
        for name, (description, arguments) in cls._REGISTERED.items():
            strategy_registry.register(name, cls, description=description, **arguments)
