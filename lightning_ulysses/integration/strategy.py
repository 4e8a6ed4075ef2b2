"""`UlyssesDeepSpeedStrategy`: Lightning's hooks, each delegating to the owner of what it does.

groups (`parallel/layout.py`) → DP-only sampler → sequence sharding (`batch/sharding.py`) → Ulysses attention
(`attention/`, `hf/`) → SP-aware loss (`training/loss.py`) → DeepSpeed with an `mpu`, so ZeRO partitions and reduces
over all DP×SP ranks. The owners: the run's groups, description, sharder and prepared module in `parallel_run`
(the description itself — layout, ZeRO options, precision, device; the DeepSpeed config and its dialect — in
`parallel/run_spec`), the module pipeline in `preparation`, `memory="auto"` in `planning/auto`, the exchange's
agreement in `attention/copy_engine`, the DeepSpeed engine's start and release in `engine`, the checkpoint protocol
and resume state in `checkpoint/`, signals, requeue and the rank watchdog in `faults`, the start-up report in
`planning/preflight`; every private Lightning name the strategy needs is reached through `fences/_lightning_private`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Literal, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_ulysses.attention import copy_engine
from lightning_ulysses.attention.backends import check_sdpa_kernel_priority, sdpa_priority
from lightning_ulysses.attention.core import check_overlap_head_groups
from lightning_ulysses.batch.check import CheckBatches, SameBatchCheck
from lightning_ulysses.batch.sharding import SequencePadding, check_sequence_padding
from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.integration import console, engine, faults, preparation, pretrained
from lightning_ulysses.integration.callbacks import correct_progress_bar
from lightning_ulysses.integration.checkpoint.resume import StrategyCheckpoints
from lightning_ulysses.integration.logged_values import ShardLocalLogCheck
from lightning_ulysses.integration.notebook import check_start_method, configure_launcher
from lightning_ulysses.integration.parallel_run import ParallelRun
from lightning_ulysses.integration.sequence_parallel_hooks import SequenceParallelHooks
from lightning_ulysses.integration.rng import SequenceParallelRNG
from lightning_ulysses.memory import MemoryOptions, apply_allocator_settings
from lightning_ulysses.parallel.run_spec import RunSpec, deep_merge, inference_config, read_sequence_parallel_size
from lightning_ulysses.planning import auto, preflight

# A child of Lightning's logger, so the start-up report prints wherever Lightning's own messages do.
_log = logging.getLogger("lightning.pytorch.ulysses")


class UlyssesDeepSpeedStrategy(SequenceParallelHooks, DeepSpeedStrategy):
    """DeepSpeed (ZeRO) with DeepSpeed-Ulysses sequence parallelism. Every argument in full, with what was measured:
    `docs/guide.md`, "The strategy's arguments".

    Args:
        sequence_parallel_size: ranks sharing one sequence; must divide the processes and the heads. `None`: devices
            per node; `1`: plain ZeRO. Also read from a DeepSpeed config block `"ulysses"`, removed from the config.
        ring_size: ranks of each SP group that form a ring (ring attention) while the rest split heads with Ulysses.
            `None`: the largest Ulysses degree the heads allow.
        sequence_padding: `"pad"`: lengths the SP size does not divide are padded at the end; `"error"`: refused.
        stage: ZeRO stage; 3 by default (parameters, gradients and optimizer state sharded over all ranks).
        config: a DeepSpeed config (dict or JSON path).
        config_overrides: merged recursively into the DeepSpeed config built from the other arguments.
        sequence_parallel_in_evaluation: `False`: validate/test/predict on whole sequences, the models' own attention.
        memory: the long-sequence memory features (`lightning_ulysses.memory.MemoryOptions` or its fields), all off
            by default; `"auto"` (`planning.auto.AutoMemory`): the fastest that fits, chosen once in `setup`, logged
            (`memory_choice`) and confirmed by the first steps (`memory_confirmation`).
        start_method: `None`: Lightning's script launch; `"fork"`: forked ranks, for notebooks (`notebook.py`).
        heartbeat_timeout: seconds after which a silent rank makes the others exit (status 75) naming it; `None`: off.
        sdpa_kernel_priority: SDPA kernels tried first, in order (`"fa4"`: FlashAttention-4's kernels where they
            serve a call exactly). `"auto"` (default): on Hopper GPUs FA4 first where installed, then cuDNN; `None`:
            torch's order.
        overlap_head_groups: head groups pipelined so that all-to-alls overlap attention; exact; 1 (default): none.
        check_batches: `"first"` (default), `"every"` or `"never"`: batches checked to be the same over the SP group,
            and evaluation steps whose logged values are checked to be the whole rows' (`logged_values.py`).
        exchange: the all-to-alls' transport: `"nccl"` (default; gloo on CPU), `"copy_engine"` (peer copies into
            symmetric memory, refused where it cannot run) or `"auto"`.
        zero3_leaf_layers: under ZeRO-3, gather each decoder layer's parameters whole (DeepSpeed leaf modules).
        quiet_third_party: hide the third-party messages nobody can act on (`console.py`), in every rank.
        **kwargs: every other `lightning.pytorch.strategies.DeepSpeedStrategy` argument.

    Checkpoints (`lightning_ulysses.integration.checkpoint`) are saved atomically, resume exactly and at any other
    SP × DP split of the same number of ranks, and export with `python -m lightning_ulysses checkpoint export`. A
    SIGTERM (SLURM's requeue signal too) saves `hpc_ckpt_<n>.ckpt` at the next step boundary on every rank and `fit`
    raises Lightning's `SIGTERMException`; a rank that raises makes the others exit at once naming it.
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
        memory = auto.coerce_memory(memory)  # bad arguments fail here, in the launching process
        if sdpa_kernel_priority != "auto":
            sdpa_kernel_priority = check_sdpa_kernel_priority(sdpa_kernel_priority)
        self.overlap_head_groups = check_overlap_head_groups(overlap_head_groups)
        self._requested_exchange = copy_engine.check_exchange(exchange)
        config, sequence_parallel_size = read_sequence_parallel_size(
            lightning_private.load_deepspeed_config(self, config), sequence_parallel_size, ring_size)
        check_sequence_padding(sequence_padding)
        # Signals, requeue and the rank watchdog (`faults.py`).
        self._faults = faults.RunFaults(faults.check_heartbeat_timeout(heartbeat_timeout))
        # Ours, not DDPStrategy's `_start_method` (which DeepSpeedStrategy leaves at "popen", the script launch).
        self.start_method = check_start_method(start_method)
        super().__init__(stage=stage, config=config, **kwargs)
        if config_overrides:
            self.config = deep_merge(self.config, config_overrides)
        # This run's groups, description, sharder and prepared module (`parallel_run.py`), set up per run.
        self._parallel = ParallelRun(sequence_parallel_size, ring_size, sequence_padding)
        self.sequence_parallel_in_evaluation = sequence_parallel_in_evaluation
        # `memory="auto"` and `sdpa_kernel_priority="auto"`, decided in `setup` (`_decide_auto`)
        self._auto = auto.AutoDecisions(memory, sdpa_kernel_priority)
        self.zero3_leaf_layers = zero3_leaf_layers
        self.exchange: Optional[str] = None  # "nccl" or "copy_engine" once agreed in `setup` (`_decide_exchange`)
        self._transport = None  # the all-to-all transport `_decide_exchange` agreed (None: the collective one)
        self._batch_check = SameBatchCheck(check_batches)
        self._logged_values = ShardLocalLogCheck(check_batches)  # evaluation's logged values, compared over SP
        # Dropout masks differ between the SP ranks: the steps draw from a stream of their own (`rng.py`).
        self._random_streams = SequenceParallelRNG()
        self._checkpoints = StrategyCheckpoints(self, self._random_streams, quiet=quiet_third_party)
        # Micro-batches whose gradients the engine holds without having stepped yet (`backward`): a checkpoint
        # saved inside an accumulation window records it, and a resume from it is refused (`checkpoint/resume.py`).
        self.micro_batches_accumulated = 0
        self._preflight_reported = False

    # (The run's groups and description, the loss, sampler, steps, signals and a rank's exception: `SequenceParallelHooks`.)

    # -- launch, environment and groups ------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        if not configure_launcher(self):  # fork, or no launch in a notebook (notebook.py); else Lightning's own
            super()._configure_launcher()  # (`SequenceParallelHooks`: marks the ranks it starts)

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
        layout = self._parallel.layout(self.world_size, self.num_processes)
        self._parallel.start(RunSpec.of_config(self.config, layout=layout, precision=str(self.precision_plugin.precision),
                                               device=self.root_device),
                             num_processes=self.num_processes, num_nodes=self.num_nodes, barrier=self.barrier)
        # After `reset_seed`, on every set-up (fit twice seeds it twice alike); a resume restores it later, at the
        # first batch or (at an epoch boundary) in `process_dataloader`, both after this.
        self._random_streams.reset(self.sequence_parallel_rank, self.sequence_parallel_world_size, self.root_device)
        self._faults.start_watchdog(self.cluster_environment, self.global_rank, self.world_size)

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

    def _prepare_modules(self) -> None:
        """The module pipeline (`preparation.py`, through `ParallelRun`): scan the models and settle the ring size
        from their heads, agree the exchange, decide what is "auto", build the runtime, check everything, then
        prepare everything."""
        found = self._parallel.scan(self.lightning_module)  # raises before any collective, on every rank alike
        self._decide_exchange()
        self._decide_auto(found)
        self._parallel.prepare(found, preparation.SequenceParallelRuntime(
            self.parallel_groups, self._parallel.sharder, self._parallel.batch_rows, self.loss_function, self.memory,
            self.overlap_head_groups, leaf_layers=self.zero3_leaf_layers and self.zero_stage_3,
            transport=self._transport))

    def _decide_exchange(self) -> None:
        """`exchange`, agreed over the Ulysses group (`copy_engine.agree_exchange`); the transport is handed to this
        run's models only (`SequenceParallelRuntime.transport`, on their bindings)."""
        groups, self._transport = self.parallel_groups, None
        host_ranks = range(self.node_rank * self.num_processes, (self.node_rank + 1) * self.num_processes)
        self.exchange, self._transport = copy_engine.agree_exchange(
            self._requested_exchange, groups.ulysses_group if groups.ulysses_size > 1 else None,
            isinstance(self.accelerator, CUDAAccelerator), host_ranks, self.parallel_devices, self.global_rank,
            self.root_device)

    def _decide_auto(self, found: preparation.ModuleScan) -> None:
        """`memory="auto"` and `sdpa_kernel_priority="auto"` (`auto.AutoDecisions`); the optimizer offload chosen is
        written into the DeepSpeed config through the run's description."""
        run = self._auto.decide(self.run_spec, found.memory_engine_models(),
                                on_cuda=isinstance(self.accelerator, CUDAAccelerator), local_ranks=self.num_processes,
                                reduce=self._reduces_over_ranks(),
                                accumulate=self.lightning_module.trainer.accumulate_grad_batches)
        if run is not None:
            self._parallel.spec = run
            self.config.update(run.written_into(self.config))  # in place: the dict Lightning and DeepSpeed read
            rank_zero_info(self.memory_choice.report())

    @override
    def teardown(self) -> None:
        self._parallel.end()  # the user's models leave the Trainer with their own attention and loss again
        self._checkpoints.end_resume()  # a resumed run that trained no batch
        # While the watchdog runs: a rank lost at the barrier is named, not waited for.
        self._parallel.release(self.world_size, self.barrier)
        self._faults.stop_watchdog()
        super().teardown()
        # The engine stays `self.model` until the next run replaces it: `trainer.save_checkpoint` after `fit` still
        # saves through it (it needs no hook).
        engine.release(self.model)
        self._faults.after_teardown(self.launcher, self.is_global_zero)  # a preemption: the job's exit, one line

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
        started, self._parallel.mpu = engine.initialize(self.parallel_groups, device_rank, **kwargs)
        return started

    # -- checkpoints (`checkpoint.resume.StrategyCheckpoints`; saving, loading: `SequenceParallelHooks`) -----------
    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._checkpoints.load_model_state_dict(checkpoint, strict):
            super().load_model_state_dict(checkpoint, strict)

    # -- steps (the step hooks themselves: `SequenceParallelHooks`) ----------------------------------------------
    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning's automatic optimization already divides each micro-batch's loss by `accumulate_grad_batches`
        # (`loops/optimization/automatic.py`) and gives DeepSpeed the same k as `gradient_accumulation_steps`;
        # `DeepSpeedEngine.backward` would divide by k again (`scale_wrt_gas`), making every update (and the norm
        # that gradient clipping compares) k times too small. DeepSpeed still counts the micro-steps, so its step
        # boundary stays where it was; its loss scaler (fp16) is applied either way. Manual optimization has k = 1.
        kwargs.setdefault("scale_wrt_gas", False)
        self._refuse_shard_local_loss(args, kwargs)  # a loss of this rank's shard alone is refused at SP > 1
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
