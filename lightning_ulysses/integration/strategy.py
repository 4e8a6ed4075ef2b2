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
from typing_extensions import override

from lightning_ulysses.attention import copy_engine
from lightning_ulysses.batch.check import CheckBatches
from lightning_ulysses.batch.sharding import SequencePadding
from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.integration import console, engine, pretrained
from lightning_ulysses.integration.callbacks import correct_progress_bar
from lightning_ulysses.integration.notebook import check_start_method, configure_launcher
from lightning_ulysses.integration.logged_values import PerRankValues
from lightning_ulysses.integration.runtime import UlyssesRuntime
from lightning_ulysses.integration.sequence_parallel_hooks import SequenceParallelHooks
from lightning_ulysses.memory import MemoryOptions
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
        check_batches: `"first"` (default: the first 2 of every loop), `"every"` or `"never"`: batches checked to be
            the same over the SP group, and steps whose training loss and logged tensors are checked to be the same
            on every rank of it (the whole rows' values, not one shard's: `logged_values.py`).
        per_rank_values: logged names (`fnmatch` patterns, e.g. `"time/*"`) whose tensors are meant per rank and
            are not compared over the SP group (the loss always is).
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
        per_rank_values: Optional[PerRankValues] = None,
        exchange: copy_engine.Exchange = "nccl",
        zero3_leaf_layers: bool = True,
        quiet_third_party: bool = True,
        **kwargs: Any,
    ) -> None:
        self.start_method = check_start_method(start_method)  # ours, not DDPStrategy's `_start_method` ("popen")
        self._requested_exchange = copy_engine.check_exchange(exchange)
        config, sequence_parallel_size = read_sequence_parallel_size(
            lightning_private.load_deepspeed_config(self, config), sequence_parallel_size, ring_size)
        # Everything both strategies are made of (`runtime.py`), every argument checked, before DeepSpeed is imported.
        self.runtime = UlyssesRuntime(
            self, sequence_parallel_size=sequence_parallel_size, ring_size=ring_size, sequence_padding=sequence_padding,
            memory=memory, sdpa_kernel_priority=sdpa_kernel_priority, overlap_head_groups=overlap_head_groups,
            check_batches=check_batches, per_rank_values=per_rank_values, heartbeat_timeout=heartbeat_timeout,
            sequence_parallel_in_evaluation=sequence_parallel_in_evaluation, quiet_third_party=quiet_third_party)
        super().__init__(stage=stage, config=config, **kwargs)
        if config_overrides:
            self.config = deep_merge(self.config, config_overrides)
        self.zero3_leaf_layers = zero3_leaf_layers
        self.exchange: Optional[str] = None  # "nccl" or "copy_engine" once agreed in `setup` (`_agree_transport`)
        self._preflight_reported = False

    # (The run's groups and description, the loss, sampler, steps, signals and a rank's exception: `SequenceParallelHooks`.)

    # -- launch, environment and groups ------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        if not configure_launcher(self):  # fork, or no launch in a notebook (notebook.py); else Lightning's own
            # (`SequenceParallelHooks`: marks the ranks it starts)
            lightning_private.configure_launcher_above(UlyssesDeepSpeedStrategy, self)

    @override
    def setup_environment(self) -> None:
        self._enter_process_state()
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
        layout = self.runtime.parallel.layout(self.world_size, self.num_processes)
        self.runtime.parallel.start(RunSpec.of_config(self.config, layout=layout, precision=str(self.precision_plugin.precision),
                                               device=self.root_device),
                             num_processes=self.num_processes, num_nodes=self.num_nodes, barrier=self.barrier)
        # After `reset_seed`, on every set-up (fit twice seeds it twice alike); a resume restores it later, at the
        # first batch or (at an epoch boundary) in `process_dataloader`, both after this.
        self.runtime.random_streams.reset(self.sequence_parallel_rank, self.sequence_parallel_world_size, self.root_device)
        self.runtime.faults.start_watchdog(self.cluster_environment, self.global_rank, self.world_size)

    # -- model preparation --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        # Under ZeRO-3, `from_pretrained` in `configure_model` loads straight into the partitions (`pretrained.py`).
        with super().model_sharded_context(), pretrained.zero3_loading(self.config if self.zero_stage_3 else None):
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self.runtime.micro_batches_accumulated = 0  # a new engine holds no gradients
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
    def _agree_transport(self) -> Optional[Any]:
        """`exchange`, agreed over the Ulysses group (`copy_engine.agree_exchange`); the transport is handed to this
        run's models only (`SequenceParallelRuntime.transport`, on their bindings)."""
        groups = self.parallel_groups
        host_ranks = range(self.node_rank * self.num_processes, (self.node_rank + 1) * self.num_processes)
        self.exchange, transport = copy_engine.agree_exchange(
            self._requested_exchange, groups.ulysses_group if groups.ulysses_size > 1 else None,
            isinstance(self.accelerator, CUDAAccelerator), host_ranks, self.parallel_devices, self.global_rank,
            self.root_device)
        return transport

    @override
    def _adopt_run(self, run: RunSpec) -> None:
        # The optimizer offload `memory="auto"` chose, in place: the dict Lightning and DeepSpeed read.
        self.config.update(run.written_into(self.config))

    @override
    def _runtime_options(self) -> dict[str, Any]:
        return {"leaf_layers": self.zero3_leaf_layers and self.zero_stage_3}

    @override
    def _release_backend(self) -> None:
        # The engine stays `self.model` until the next run replaces it: `trainer.save_checkpoint` after `fit` still
        # saves through it (it needs no hook).
        engine.release(self.model)

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
        started, self.runtime.parallel.mpu = engine.initialize(self.parallel_groups, device_rank, **kwargs)
        return started

    # -- checkpoints (`checkpoint.resume.StrategyCheckpoints`; saving, loading: `SequenceParallelHooks`) -----------
    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.runtime.checkpoints.load_model_state_dict(checkpoint, strict):
            super().load_model_state_dict(checkpoint, strict)

    # -- steps (the step hooks themselves: `SequenceParallelHooks`) ----------------------------------------------
    @override
    def _start_backward(self, ends_window: Optional[bool], kwargs: dict) -> dict:
        # Lightning's automatic optimization already divides each micro-batch's loss by `accumulate_grad_batches`
        # (`loops/optimization/automatic.py`) and gives DeepSpeed the same k as `gradient_accumulation_steps`;
        # `DeepSpeedEngine.backward` would divide by k again (`scale_wrt_gas`), making every update (and the norm
        # that gradient clipping compares) k times too small. DeepSpeed still counts the micro-steps, so its step
        # boundary stays where it was; its loss scaler (fp16) is applied either way. Manual optimization has k = 1.
        if ends_window is not None:
            # ZeRO reduces (and DeepSpeed's `step` applies) at the window's end and only there. DeepSpeed's own
            # counter of micro-steps would not know about epochs, `limit_train_batches` or an iterable dataset's end.
            self.model.set_gradient_accumulation_boundary(ends_window)
        return {"scale_wrt_gas": False, **kwargs}

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning's loop owns the accumulation windows, as for DDP — they restart at every epoch, the
        epoch's last (partial) window steps too, and only a window's last micro-batch reaches `optimizer_step`
        (`engine.step()`). Lightning's `DeepSpeedStrategy` says True and lets DeepSpeed count micro-steps over the
        whole run instead: whenever an epoch's batches are not a multiple of `accumulate_grad_batches`, the two step at
        different micro-batches and a partial window's gradients leak into the next epoch's first step (1.5× the
        update measured). The engine learns where each window ends in `backward`."""
        return False

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: Lightning enters this around a window's inner micro-batches (now that it owns the windows)
        and would call the engine's `no_sync`, which ZeRO-2/3 refuse; the boundary set before each backward (`_start_backward`) already keeps
        ZeRO from reducing before the window's last micro-batch."""
        yield None

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
