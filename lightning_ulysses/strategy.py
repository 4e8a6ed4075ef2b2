"""`UlyssesDeepSpeedStrategy`: Lightning glue only.

groups (layout.py) → DP-only sampler → sequence sharding (sharding.py) → Ulysses attention (attention/) →
SP-aware loss (loss.py) → DeepSpeed with an `mpu`, so ZeRO partitions and reduces over all DP×SP ranks.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities import imports as _fabric_imports
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ulysses import checkpoint as checkpoints
from lightning_ulysses import preflight
from lightning_ulysses.attention.backends import check_sdpa_kernel_priority, sdpa_priority
from lightning_ulysses.attention.core import UlyssesAttention, check_overlap_head_groups, resolve_ring_size
from lightning_ulysses.attention.hf import (
    find_hf_models,
    hf_head_counts,
    prepare_hf_model,
    validate_hf_model,
    watch_positions,
)
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.faults import RankWatchdog, is_peer_failure
from lightning_ulysses.layout import ParallelLayout, SequenceParallelGroups, check_ring_size, check_sequence_parallel_size
from lightning_ulysses.memory import MemoryOptions, apply_allocator_settings, apply_memory_options
from lightning_ulysses.metrics import SequenceParallel
from lightning_ulysses.moe import SequenceParallelRouterLoss, exact_router_loss, sharder_padding, validate_router_loss
from lightning_ulysses.loss import (
    LossFunctionHost,
    SequenceParallelCausalLMLoss,
    gradient_scale_for,
    swap_loss_function,
)
from lightning_ulysses.notebook import UlyssesForkLauncher
from lightning_ulysses.sharding import SequencePadding, SequenceSharder, batch_fingerprint

# A child of Lightning's logger, so the start-up report prints wherever Lightning's own messages do.
_log = logging.getLogger("lightning.pytorch.ulysses")

_ULYSSES_CONFIG_KEYS = {"enable", "sequence_parallel_world_size"}


def _split_ulysses_block(config: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[int]]:
    """Strip the `"ulysses"` block of a DeepSpeed-Ulysses style config; return (config, its SP size or None)."""
    config = dict(config)  # the caller's dict is left as it was
    block = config.pop("ulysses", None)
    if block is None:
        return config, None
    if not isinstance(block, Mapping) or set(block) - _ULYSSES_CONFIG_KEYS:
        raise ValueError(
            f'The DeepSpeed config\'s "ulysses" block must look like {{"enable": true, "sequence_parallel_world_size": 8}};'
            f" got {block!r}."
        )
    if not block.get("enable", True):
        return config, 1
    size = block.get("sequence_parallel_world_size")
    if size is None:
        raise ValueError('The DeepSpeed config\'s "ulysses" block enables Ulysses but sets no "sequence_parallel_world_size".')
    return config, size


def _deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if value is None:  # "not set": lets a recipe list a knob without forcing a value on DeepSpeed
            continue
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass
class _PendingResume:
    """What a loaded checkpoint still has to restore once training starts."""

    epoch_samples_consumed: int
    global_batch_size: Optional[int]
    rng_state: Optional[dict[str, Any]]


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
            applied to every Hugging Face causal LM and native GPT in the module; all off by default.
        start_method: how the ranks are started. `None` (the default): Lightning's script launch (re-runs the
            script, or ranks come from torchrun/SLURM). `"fork"`: fork the current process, for Jupyter notebooks
            (`strategy="ulysses_notebook"`); see `lightning_ulysses.notebook`.
        sdpa_kernel_priority: SDPA kernels to try first, in order, for every training/evaluation step and its
            backward, e.g. `("cudnn",)` on Hopper GPUs (names: cudnn, flash, efficient, math; the others follow in
            torch's order). `None` (default): torch's own order, which tries flash first; on an H200 cuDNN's causal
            kernels are ~1.65× faster (`benchmarks/results/2026-11-29-h200-long-sequence/`).
        overlap_head_groups: cut the attention heads into this many groups and pipeline them, so that one group's
            all-to-alls run while another group's attention computes (forward and backward); exact for any value.
            1 (default): no overlap. A count the heads do not allow (each group must give every SP rank whole
            query and KV heads) runs with the largest smaller one; with a ring (`ring_size > 1`) it is not used (the
            ring overlaps its own K/V exchanges). Measured on 2 × H200:
            `benchmarks/results/2026-11-29-h200x2-overlap/`.
        check_batches: whether the ranks of an SP group are compared to hold the same batch (one tiny all-gather
            of a fingerprint per checked batch; ranks fed different samples, e.g. by an `IterableDataset` sharded by
            global rank or a sampler of its own, train silently wrong otherwise): `"first"` (default) the first
            batches of every loop, `"every"` each batch (debugging), `"never"`.
        heartbeat_timeout: seconds after which a rank that stopped sending heartbeats (killed, crashed, frozen)
            makes every other rank exit with status 75 and a message naming it, instead of hanging until the
            collective timeout (`lightning_ulysses.faults`). `None` turns the watchdog off.
        **kwargs: every other `lightning.pytorch.strategies.DeepSpeedStrategy` argument.

    Checkpoints (`lightning_ulysses.checkpoint`) are saved atomically, resume exactly (RNG states and the position
    in the epoch's data included), resume at any other SP × DP split of the same number of ranks, and are
    exported with `python -m lightning_ulysses checkpoint export`. A SIGTERM (and, under SLURM with Lightning's
    auto-requeue on, its requeue signal SIGUSR1) saves `hpc_ckpt_<n>.ckpt` in the Trainer's `default_root_dir` at
    the next step boundary, on every rank together, and exits with status 0 (resume with `ckpt_path="hpc"`; SLURM
    requeues the job when auto-requeue is on). A rank that raises makes the others exit at once naming it.
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
        memory: Union[MemoryOptions, Mapping[str, Any], None] = None,
        start_method: Optional[Literal["fork"]] = None,
        heartbeat_timeout: Optional[float] = 120.0,
        sdpa_kernel_priority: Optional[Sequence[str]] = None,
        overlap_head_groups: int = 1,
        check_batches: Literal["first", "every", "never"] = "first",
        **kwargs: Any,
    ) -> None:
        memory = MemoryOptions.coerce(memory)  # bad options fail here, in the launching process
        sdpa_kernel_priority = check_sdpa_kernel_priority(sdpa_kernel_priority)
        check_overlap_head_groups(overlap_head_groups)
        config = self._load_config(config)
        if config is not None:
            config, configured_size = _split_ulysses_block(config)
            if sequence_parallel_size is None:
                sequence_parallel_size = configured_size
            elif configured_size is not None and configured_size != sequence_parallel_size:
                raise ValueError(
                    f"sequence_parallel_size={sequence_parallel_size} disagrees with the DeepSpeed config's"
                    f" ulysses.sequence_parallel_world_size={configured_size}: set only one of them, or make them equal."
                )
        if sequence_parallel_size is not None:
            check_sequence_parallel_size(sequence_parallel_size)
            if ring_size is not None:
                check_ring_size(ring_size, sequence_parallel_size)
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
            self.config = _deep_merge(self.config, config_overrides)
        self._requested_sequence_parallel_size = sequence_parallel_size
        self._requested_ring_size = ring_size
        self.sequence_padding = sequence_padding
        self._groups: Optional[SequenceParallelGroups] = None
        self._sharder: Optional[SequenceSharder] = None
        # The sharder publishes each batch's whole rows here; the attention layers read them instead of gathering.
        self._batch_rows = BatchRowsSlot()
        self._restore_callbacks: list[Callable[[], None]] = []
        self.sequence_parallel_in_evaluation = sequence_parallel_in_evaluation
        self.memory = memory
        self._unsharded_evaluation = False  # True while validate/test/predict runs with plain attention
        self._load_consolidated_weights = False  # see load_checkpoint
        # DeepSpeedStrategy does not forward DDPStrategy's start_method (it stays "popen", the script launch).
        self._start_method = start_method or "popen"
        self.heartbeat_timeout = heartbeat_timeout
        self.sdpa_kernel_priority = sdpa_kernel_priority
        self.overlap_head_groups = overlap_head_groups
        if check_batches not in ("first", "every", "never"):
            raise ValueError(f"check_batches must be 'first', 'every' or 'never', got {check_batches!r}")
        self.check_batches = check_batches
        self._batches_checked: dict[Any, int] = {}  # per loop stage: how many batches were compared over SP
        self._watchdog: Optional[RankWatchdog] = None
        self._hf_model_configs: dict[str, Any] = {}  # module path → the config save_pretrained will need
        self._resume: Optional[_PendingResume] = None
        self._data_epoch: Optional[int] = None  # the epoch the last training batch came from (see _resumable_loops)
        self._preflight_reported = False
        self._sigterm_pending = False  # a SIGTERM this rank received, not yet agreed on (see _agree_on_sigterm)

    # -- the parallel layout ------------------------------------------------------------------------------------
    @property
    def parallel_groups(self) -> SequenceParallelGroups:
        """The SP/DP groups of this rank; available once the strategy has set up distributed training."""
        if self._groups is None:
            raise RuntimeError(
                "The sequence-parallel groups are created when the Trainer sets up distributed training. Access them"
                " inside fit/validate/test/predict (e.g. in LightningModule.setup, configure_model or a step)."
            )
        return self._groups

    @property
    def sequence_parallel_group(self):
        return self.parallel_groups.sequence_parallel_group

    @property
    def sequence_parallel_rank(self) -> int:
        return self.parallel_groups.sequence_parallel_rank

    @property
    def sequence_parallel_world_size(self) -> int:
        return self.parallel_groups.sequence_parallel_world_size

    @property
    def data_parallel_group(self):
        return self.parallel_groups.data_parallel_group

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel_groups.data_parallel_rank

    @property
    def data_parallel_world_size(self) -> int:
        return self.parallel_groups.data_parallel_world_size

    @property
    def batches_are_sharded(self) -> bool:
        """Whether the step sees this rank's shard with shifted labels (False during evaluation with
        `sequence_parallel_in_evaluation=False`, where whole, unshifted batches pass through)."""
        return self._sharder is not None and not self._unsharded_evaluation

    @property
    def loss_function(self) -> SequenceParallelCausalLMLoss:
        """`loss_function(logits, labels)`: the whole-sequence token-mean loss with the right ZeRO gradient, for
        modules that compute their loss from logits. `labels`: the batch's `labels` (shifted by the strategy), or
        any labels as Hugging Face takes them (unshifted, e.g. `batch["input_ids"]`); see `SequenceParallelCausalLMLoss`."""
        groups = self.parallel_groups
        group = groups.sequence_parallel_group if groups.sequence_parallel_world_size > 1 else None
        return SequenceParallelCausalLMLoss(group, gradient_scale_for(self.config, groups.sequence_parallel_world_size),
                                            batch_rows=self._batch_rows, order=groups.shard_order)

    # -- launch, environment and groups ------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "fork":
            # Forked children run setup_environment → setup_distributed below, exactly like script ranks.
            self._launcher = UlyssesForkLauncher(self)
            return
        if _fabric_imports._IS_INTERACTIVE:
            if self.num_processes * self.num_nodes == 1:
                # One rank needs no launch: run in this process, so a single-GPU notebook works unchanged
                # (Lightning would refuse any script launcher in a notebook, even one that starts nothing).
                self._launcher = None
                return
            # Lightning's own refusal that follows suggests strategy='ddp_notebook', which has no sequence parallelism.
            raise RuntimeError(
                f"{type(self).__name__} with the script launch cannot start ranks from a notebook or an interactive"
                " session. Use Trainer(strategy='ulysses_notebook') or UlyssesDeepSpeedStrategy(..., start_method="
                "'fork'), which forks this process, or run the training as a script."
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        apply_allocator_settings(self.memory)  # before this rank initialises CUDA
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
        else:
            # DeepSpeedStrategy refuses non-CUDA accelerators; DeepSpeed itself runs on CPU with gloo.
            DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        assert self.parallel_devices is not None
        if isinstance(self.accelerator, CUDAAccelerator):
            _validate_device_index_selection(self.parallel_devices)  # CPU devices have no index to validate
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        self._setup_parallel_groups()
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        if self.heartbeat_timeout is None or self.world_size == 1 or self._watchdog is not None:
            return
        environment = self.cluster_environment
        watchdog = RankWatchdog(environment.main_address, environment.main_port, self.global_rank, self.world_size,
                                self.heartbeat_timeout)
        try:
            watchdog.start()
        except Exception as error:  # a launcher whose store we cannot reach: train anyway, without the watchdog
            rank_zero_warn(f"lightning_ulysses: the rank watchdog could not reach the rendezvous store at"
                           f" {environment.main_address}:{environment.main_port} ({error}); a killed rank will"
                           " leave the others waiting for the collective timeout.")
            return
        self._watchdog = watchdog

    def _setup_parallel_groups(self) -> None:
        size = self._requested_sequence_parallel_size or self.num_processes
        # Raises before any collective; the ring size is settled against the model's heads in _prepare_modules.
        layout = ParallelLayout(world_size=self.world_size, sequence_parallel_size=size,
                                ring_size=self._requested_ring_size or 1).with_ring_size(1)
        gradient_scale_for(self.config, size)  # refuses a reduction no loss scale makes exact, before any group
        if self._groups is None or self._groups.layout.with_ring_size(1) != layout:  # fit → validate reuses them
            self._warn_if_groups_span_nodes(size)
            self._groups = SequenceParallelGroups.build(layout)
            rank_zero_info(f"lightning_ulysses: {layout}, SP groups {layout.sequence_parallel_groups()}")
        self._use_ring_size(1)

    def _use_ring_size(self, ring_size: int) -> None:
        """Split the SP group into Ulysses × ring (sub-groups built once) and shard batches in its layout."""
        if ring_size != self._groups.ring_size and ring_size > 1:
            rank_zero_info(f"lightning_ulysses: {self._groups.layout.with_ring_size(ring_size)}")
        self._groups = self._groups.with_ring_size(ring_size)
        self._sharder = SequenceSharder(self._groups.sequence_parallel_world_size, self._groups.sequence_parallel_rank,
                                        self.sequence_padding, ring_size=ring_size, batch_rows=self._batch_rows)

    def _warn_if_groups_span_nodes(self, sequence_parallel_size: int) -> None:
        # Ranks are numbered node by node and SP groups are blocks of consecutive ranks, so a group stays inside a
        # node exactly when its size divides the devices per node (the default, SP = devices per node, always does).
        devices_per_node = self.num_processes
        if self.num_nodes > 1 and devices_per_node % sequence_parallel_size:
            rank_zero_warn(
                f"sequence_parallel_size={sequence_parallel_size} with {devices_per_node} devices per node: SP groups"
                " span nodes, so every attention all-to-all crosses the inter-node network (typically several times"
                " slower than the links inside a node). Use a sequence_parallel_size that divides"
                f" {devices_per_node} unless the sequence needs more devices than one node has."
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every rank of an SP group must see the same samples; only DP groups get different ones.
        groups = self.parallel_groups
        return {"num_replicas": groups.data_parallel_world_size, "rank": groups.data_parallel_rank}

    # -- model preparation --------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self._prepare_modules()
        super().setup(trainer)
        # Once per node (links, NUMA and host memory are per machine) and per strategy: fit → validate → test in
        # one process sets up again on the same machine.
        if self.local_rank == 0 and not self._preflight_reported:
            self._preflight_reported = True
            _log.info(preflight.format_report(preflight.check(self._planned_run()),
                                              title=f"lightning_ulysses preflight (node {self.node_rank})"))

    def _planned_run(self) -> preflight.PlannedRun:
        zero = self.config.get("zero_optimization", {})
        optimizer_offload = zero.get("offload_optimizer") or {}
        offloaded = lambda section: section.get("device") in ("cpu", "nvme")  # noqa: E731
        parameters = list(self.lightning_module.parameters())
        return preflight.PlannedRun(
            sequence_parallel_size=self.sequence_parallel_world_size, local_world_size=self.num_processes,
            world_size=self.world_size, local_rank=self.local_rank, num_nodes=self.num_nodes,
            num_parameters=sum(getattr(p, "ds_numel", p.numel()) for p in parameters),
            parameter_numels=tuple(getattr(p, "ds_numel", p.numel()) for p in parameters if p.requires_grad),
            zero_stage=zero.get("stage"),
            offload_optimizer=offloaded(optimizer_offload), offload_parameters=offloaded(zero.get("offload_param") or {}),
            offload_ratio=optimizer_offload.get("ratio"), offload_pin_memory=optimizer_offload.get("pin_memory", True),
            sub_group_size=zero.get("sub_group_size") if zero.get("stage") == 3 else None,
            precision=str(self.precision_plugin.precision),
            grad_accum_dtype=self.config.get("data_types", {}).get("grad_accum_dtype"),
        )

    @override
    def on_train_start(self) -> None:
        # Lightning registers its signal handlers after `setup`; replace its SIGTERM handler once they exist.
        self._make_sigterm_handler_collective_free(self.lightning_module.trainer)
        super().on_train_start()

    def _make_sigterm_handler_collective_free(self, trainer: "pl.Trainer") -> None:
        """Lightning's SIGTERM handler broadcasts from rank 0 *inside the signal handler*, i.e. wherever the main
        thread happens to be: with a scheduler's signal arriving mid-step, that broadcast pairs with another rank's
        all-to-all or reduce-scatter (a hang, or silently wrong data). Only record the signal privately:
        `_agree_on_sigterm` turns it into Lightning's flag on every rank at once. (Lightning's end-of-batch check
        reads each rank's own flag, so a flag set here directly would stop only the ranks the signal reached.)

        SLURM's auto-requeue signal (SIGUSR1 unless `SLURMEnvironment(requeue_signal=...)` says otherwise) is
        worse: Lightning's handler saves a whole checkpoint inside the handler, its collectives paired with
        whatever the other ranks are doing. It takes the same route: recorded, agreed, then saved by every rank
        at the same optimizer-step boundary, the job requeued and every rank exits (`_save_on_sigterm`); the
        requeued job resumes with `ckpt_path="hpc"`."""
        self._sigterm_pending = False
        if threading.current_thread() is not threading.main_thread():
            return
        connector = type(trainer._signal_connector)
        # Lightning's handlers that collect (broadcast, save) inside the handler; the others keep running.
        replaced = (connector._sigterm_notifier_fn, connector._slurm_sigusr_handler_fn)
        signals = [signal.SIGTERM]
        environment = self.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            signals.append(environment.requeue_signal)
        for signum in signals:
            previous = signal.getsignal(signum)
            handlers = getattr(previous, "signal_handlers", None)
            if signum != signal.SIGTERM and not any(getattr(h, "__func__", None) in replaced for h in handlers or []):
                continue  # the user's own requeue handler, which Lightning left in place: not ours to change
            signal.signal(signum, functools.partial(self._record_sigterm, handlers or [], replaced))

    def _record_sigterm(self, handlers: list, replaced: tuple, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        rank_zero_info(f"lightning_ulysses: {name} received; saving at the next optimizer-step boundary.")
        self._sigterm_pending = True
        # Lightning's own non-collective handlers (SLURM's SIGTERM "bypass") and the user's handlers keep running.
        for handler in handlers:
            if getattr(handler, "__func__", None) not in replaced and callable(handler):
                handler(signum, frame)

    def _prepare_modules(self) -> None:
        self._restore_modules()
        groups = self.parallel_groups
        size = groups.sequence_parallel_world_size
        module = self.lightning_module
        hf_models = find_hf_models(module)
        native = [m for m in module.modules() if isinstance(m, UlyssesAttention)]
        if size > 1 and not hf_models and not native:
            raise ValueError(
                f"sequence_parallel_size={size} but {type(module).__name__} holds no Hugging Face PreTrainedModel and"
                " no lightning_ulysses.UlyssesAttention, so nothing would exchange tokens between shards. Wrap your"
                " attention: UlyssesAttention('sdpa') (a built-in backend; flash_attention_2/3, flex_attention too) or"
                " UlyssesAttention(F.scaled_dot_product_attention) (your own local attention callable)."
            )
        if size > 1:
            # Identical on every rank (same model, same arguments), so the sub-groups are created in step.
            head_counts = [counts for counts in map(hf_head_counts, hf_models) if counts is not None]
            head_counts += [(m.num_heads, m.num_key_value_heads) for m in native if m.num_heads is not None]
            self._use_ring_size(resolve_ring_size(head_counts, size, self._requested_ring_size))
            groups = self.parallel_groups
        for model in hf_models:  # all checks first: a failure leaves no model half-prepared
            validate_hf_model(model, groups.ulysses_size, groups.ring_size)
            if size > 1:
                validate_router_loss(model)
        loss = self.loss_function
        names = {id(child): name for name, child in module.named_modules()}
        prepared = [prepare_hf_model(model, groups.ulysses_group, loss, ring_group=groups.ring_group,
                                     batch_rows=self._batch_rows, head_groups=self.overlap_head_groups)
                    for model in hf_models]
        # The configs as the user built them (preparation swaps in a private copy with Ulysses attention).
        self._hf_model_configs = {
            names[id(p.model)]: p.original_configs.get(id(p.model), p.model.config) for p in prepared
        }
        self._restore_callbacks = [p.restore for p in prepared]
        if loss.group is not None:  # MoE load-balancing losses of the whole sequence (moe.py)
            router_loss = SequenceParallelRouterLoss(loss.group, loss.gradient_scale,
                                                     sharder_padding(lambda: self._sharder))
            self._restore_callbacks += [exact_router_loss(model, router_loss) for model in hf_models]
        for bindable in module.modules():  # UlyssesAttention, SequenceParallel metrics, ...
            if callable(getattr(bindable, "bind_parallel_groups", None)):
                bindable.bind_parallel_groups(groups)
                self._restore_callbacks.append(functools.partial(bindable.bind_parallel_groups, None))
        for attention in native:
            attention.bind_batch_rows(self._batch_rows)
            attention.bind_head_groups(self.overlap_head_groups)
            self._restore_callbacks += [functools.partial(attention.bind_batch_rows, None),
                                        functools.partial(attention.bind_head_groups, None)]
        hosts = [host for host in module.modules() if isinstance(host, LossFunctionHost)]
        self._restore_callbacks += [swap_loss_function(host, loss) for host in hosts]
        if size > 1:  # native models number a shard from 0 without the batch's positions, as HF ones do
            self._restore_callbacks += [
                watch_positions(host, self._batch_rows, groups.ulysses_group, groups.ring_group).remove
                for host in hosts
            ]
        if self.memory.changes_models:
            from lightning_ulysses.models.gpt import GPT

            native_models = [m for m in module.modules() if isinstance(m, GPT)]
            for model in [*hf_models, *native_models]:
                self._restore_callbacks += apply_memory_options(model, self.memory)

    def _restore_modules(self) -> None:
        for restore in reversed(self._restore_callbacks):
            restore()
        self._restore_callbacks = []

    @override
    def teardown(self) -> None:
        # The user's models leave the Trainer with their own attention and loss again.
        self._restore_modules()
        self._batch_rows.rows = None  # the last batch's rows are not kept alive after the Trainer is done
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        super().teardown()

    # -- evaluation without sequence parallelism (opt-in) ----------------------------------------------------------
    # The parents' validation/test/predict start and end hooks are no-ops, so one pair serves all three loops.
    @override
    def on_validation_start(self) -> None:
        if not self.sequence_parallel_in_evaluation and not self._unsharded_evaluation:
            self._restore_modules()
            self._unsharded_evaluation = True
            # Every SP rank now evaluates the same whole rows: SP-aware metrics must still sync over DP only.
            for metric in self.lightning_module.modules():
                if isinstance(metric, SequenceParallel):
                    metric.bind_parallel_groups(self.parallel_groups, whole_rows=True)
                    self._restore_callbacks.append(functools.partial(metric.bind_parallel_groups, None))

    @override
    def on_validation_end(self) -> None:
        if self._unsharded_evaluation:
            self._unsharded_evaluation = False
            self._prepare_modules()  # back to sequence parallelism for the training that may follow

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    # -- DeepSpeed engine -----------------------------------------------------------------------------------------
    @contextmanager
    def _deepspeed_initialize_with_groups(self) -> Iterator[None]:
        """Route Lightning's two `deepspeed.initialize` call sites through our `mpu` and device rank.

        Lightning calls `deepspeed.initialize` without `mpu` (ZeRO would then reduce and partition as if every
        rank held different data) and with `device_rank=None` on CPU (DeepSpeed crashes comparing None >= 0).
        Wrapping the function for the duration of the call fixes both sites without copying Lightning's code.
        """
        import deepspeed
        from deepspeed.utils import groups as deepspeed_groups

        original = deepspeed.initialize
        groups = self.parallel_groups
        mpu = groups.deepspeed_mpu() if groups.sequence_parallel_world_size > 1 else None
        device_rank = self.root_device.index if self.root_device.index is not None else self.local_rank

        def initialize(*args: Any, **kwargs: Any):
            kwargs["args"] = argparse.Namespace(device_rank=device_rank)
            kwargs["mpu"] = mpu
            # DeepSpeed keeps the last engine's mpu in a module global and only overwrites it with a non-None one:
            # clear it so an SP-1 engine after an SP-2 engine in one process does not reduce over stale groups.
            deepspeed_groups.mpu = mpu
            return original(*args, **kwargs)

        deepspeed.initialize = initialize
        try:
            yield
        finally:
            deepspeed.initialize = original

    @override
    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any):
        with self._deepspeed_initialize_with_groups():
            return super()._setup_model_and_optimizer(*args, **kwargs)

    @override
    def _initialize_deepspeed_inference(self, model) -> None:
        with self._deepspeed_initialize_with_groups():
            super()._initialize_deepspeed_inference(model)

    # -- checkpoints --------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Atomic: every rank writes into `<path>.partial`; rank 0 renames it to `<path>` once all have finished."""
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero:
            checkpoints.prepare_staging(path)
        self.barrier("lightning_ulysses.checkpoint.staging")
        staging = checkpoints.staging_path(path)
        if "loops" in checkpoint:
            checkpoint = {**checkpoint, "loops": self._resumable_loops(checkpoint["loops"])}
        super().save_checkpoint(checkpoint, staging, storage_options)
        checkpoints.save_rng_state(staging, self.global_rank)
        if self.is_global_zero:
            checkpoints.save_hf_configs(staging, self._hf_model_configs)
        self.barrier("lightning_ulysses.checkpoint.written")
        if self.is_global_zero:
            checkpoints.commit(path, self._manifest())
        self.barrier("lightning_ulysses.checkpoint.committed")

    def _manifest(self) -> checkpoints.CheckpointManifest:
        groups = self.parallel_groups
        return checkpoints.CheckpointManifest(
            world_size=self.world_size,
            sequence_parallel_size=groups.sequence_parallel_world_size,
            data_parallel_size=groups.data_parallel_world_size,
            zero_stage=self.config["zero_optimization"]["stage"],
            epoch_samples_consumed=self._epoch_samples_consumed(),
            global_batch_size=self._global_batch_size(),
            hf_models=tuple(self._hf_model_configs),
        )

    def _global_batch_size(self) -> Optional[int]:
        batch_size = getattr(self.lightning_module.trainer.train_dataloader, "batch_size", None)
        return None if batch_size is None else batch_size * self.parallel_groups.data_parallel_world_size

    def _epoch_position(self) -> tuple[int, bool]:
        """Batches of the current epoch trained on so far, and whether that epoch's data is used up."""
        trainer = self.lightning_module.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress
        done = progress.current.processed
        return done, progress.is_last_batch or done >= trainer.num_training_batches

    def _epoch_samples_consumed(self) -> int:
        """Samples of the current epoch trained on so far, over all DP ranks (0 between epochs)."""
        done, used_up = self._epoch_position()
        if used_up or not done:
            return 0
        global_batch = self._global_batch_size()
        if global_batch is None:  # a custom batch sampler: positions cannot be counted in samples
            return -1
        return done * global_batch

    def _resumable_loops(self, loops: dict[str, Any]) -> dict[str, Any]:
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
        epoch = self._data_epoch
        if fit is None or epoch is None:  # nothing trained since this process started (or loaded) the run
            return loops
        done, used_up = self._epoch_position()
        counted = fit["epoch_progress"]["current"]["processed"] > epoch  # Lightning has counted the data's epoch
        if used_up and counted:
            epochs = dict.fromkeys(("ready", "started", "processed", "completed"), epoch + 1)
            batches = {**fit["epoch_loop.batch_progress"], "is_last_batch": False,
                       "current": dict.fromkeys(("ready", "started", "processed", "completed"), 0)}
        elif done and not used_up:
            epochs = {"ready": epoch + 1, "started": epoch + 1, "processed": epoch, "completed": epoch}
            batches = fit["epoch_loop.batch_progress"]
        else:
            return loops
        fit = {**fit, "epoch_progress": {"total": dict(epochs), "current": dict(epochs)},
               "epoch_loop.batch_progress": batches}
        return {**loops, "fit_loop": fit}

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        manifest = None
        if os.path.isdir(checkpoint_path) or not os.path.exists(checkpoint_path):
            path = checkpoints.resolve_checkpoint(Path(checkpoint_path))  # refuses interrupted saves
            manifest = checkpoints.read_manifest(path)
            if manifest is not None and manifest.world_size != self.world_size:
                raise ValueError(
                    f"{path} was written by {manifest.world_size} ranks (SP {manifest.sequence_parallel_size} × DP"
                    f" {manifest.data_parallel_size}) and this run has {self.world_size}: ZeRO shards are cut per rank."
                    f" Resume with {manifest.world_size} ranks (any SP × DP split works), or export the weights with"
                    f" `python -m lightning_ulysses checkpoint export {path} <folder>` and start a new run from them."
                )
            checkpoint_path = str(path)
        if fitting and manifest is not None:
            same_layout = manifest.sequence_parallel_size == self.sequence_parallel_world_size
            self._resume = _PendingResume(
                epoch_samples_consumed=manifest.epoch_samples_consumed,
                global_batch_size=manifest.global_batch_size,
                # Each rank's generators continue where they were; at another split ranks play other roles.
                rng_state=checkpoints.load_rng_state(Path(checkpoint_path), self.global_rank) if same_layout else None,
            )
        if fitting or not self.zero_stage_3 or self.load_full_weights or not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        # validate/test/predict(ckpt_path=<ZeRO-3 checkpoint>): DeepSpeed 0.19 cannot load a ZeRO-3 checkpoint
        # into an engine without optimizer (it calls `_restore_from_bit16_weights` on `DeepSpeedZeRoOffload`).
        # Consolidate the fp32 weights from the shards instead and let Lightning's full-weights path copy them into
        # the partitioned parameters, module by module.
        path = Path(checkpoint_path)
        # Lightning's own entries (epoch, callbacks, ...) are saved as DeepSpeed client state in every model-state file.
        states = path / checkpoints.deepspeed_tag(path) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        checkpoint = torch.load(states, map_location="cpu", weights_only=False)
        # Only global rank 0 reads the weights (`_restore_zero_state` copies them in from rank 0 alone): one full
        # fp32 copy of the model in host memory, not one per rank.
        checkpoint["state_dict"] = checkpoints.consolidated_state_dict(path) if self.is_global_zero else {}
        self._load_consolidated_weights = True
        return checkpoint

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """After a resume in the middle of an epoch, skip the samples that epoch already trained on; at an epoch
        boundary, restore the random generators here."""
        resume = self._resume
        trainer = self.lightning_module.trainer
        if resume is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if resume.epoch_samples_consumed == 0:
            # Between an epoch's last step and the next one, the uninterrupted run drew from the global generator
            # for the new epoch's data loader iterator (its base seed); Lightning creates that iterator right after
            # this call, so the generators continue from here, not from the first batch.
            if resume.rng_state is not None:
                checkpoints.restore_rng_state(resume.rng_state)
                resume.rng_state = None
            return dataloader
        if resume.epoch_samples_consumed < 0 or not isinstance(dataloader, DataLoader) or dataloader.sampler is None:
            rank_zero_warn("The checkpoint's position inside its epoch cannot be restored for this dataloader (a"
                           " custom batch sampler or an iterable dataset): the epoch's data restarts from its beginning.")
            return dataloader
        data_parallel_size = self.parallel_groups.data_parallel_world_size
        sampler = checkpoints.ResumableSampler(dataloader.sampler, data_parallel_size)
        global_batch = None if dataloader.batch_size is None else dataloader.batch_size * data_parallel_size
        # Raises before any collective (every rank has the same manifest and loader) if the position cannot continue.
        sampler.skip_once(resume.epoch_samples_consumed, resume.global_batch_size, global_batch)
        resume.epoch_samples_consumed = 0
        return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Mid-epoch, restored here, not at load: the dataloader and anything between load and the first step would
        # otherwise consume random numbers the uninterrupted run did not (at an epoch boundary: process_dataloader).
        if self._resume is not None:
            if self._resume.rng_state is not None:
                checkpoints.restore_rng_state(self._resume.rng_state)
            self._resume = None
        # Lightning set the sampler's epoch from this counter when the epoch began; it stays until the epoch loop
        # ends (a checkpoint needs it after that, see `_resumable_loops`).
        self._data_epoch = self.lightning_module.trainer.fit_loop.epoch_progress.current.processed
        self._agree_on_sigterm()
        super().on_train_batch_start(batch, batch_idx)

    def _agree_on_sigterm(self) -> None:
        """Whether any rank got a SIGTERM, agreed by all ranks at the same batch (one all-reduce), and handed to
        Lightning's end-of-batch check on every rank together only at an optimizer-step boundary: a checkpoint
        holds no gradients accumulated inside a window, so saving there would lose them on resume."""
        pending = self._sigterm_pending
        if self.world_size > 1:
            flag = torch.tensor([int(pending)], device=self.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            pending = bool(flag.item())
        self._sigterm_pending = pending
        trainer = self.lightning_module.trainer
        if pending and not trainer.fit_loop._should_accumulate():
            trainer._signal_connector.received_sigterm = True

    # The SDPA kernel priority holds for every step and its backward: a recompute in backward must pick the kernels
    # its forward picked (keep_attention_outputs replays them).
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_priority(self.sdpa_kernel_priority):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        # Lightning's automatic optimization already divides each micro-batch's loss by `accumulate_grad_batches`
        # (`loops/optimization/automatic.py`) and gives DeepSpeed the same k as `gradient_accumulation_steps`;
        # `DeepSpeedEngine.backward` would divide by k again (`scale_wrt_gas`), making every update (and the norm
        # that gradient clipping compares) k times too small. DeepSpeed still counts the micro-steps, so its step
        # boundary stays where it was; its loss scaler (fp16) is applied either way. Manual optimization has k = 1.
        kwargs.setdefault("scale_wrt_gas", False)
        with sdpa_priority(self.sdpa_kernel_priority):
            return super().backward(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_priority(self.sdpa_kernel_priority):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_priority(self.sdpa_kernel_priority):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with sdpa_priority(self.sdpa_kernel_priority):
            return super().predict_step(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning raises SIGTERMException on every rank at the same step boundary (`_agree_on_sigterm` sets every
        # rank's flag in the same batch), so all ranks are here together and can save.
        if isinstance(exception, SIGTERMException) and self._groups is not None:
            self._save_on_sigterm()
        elif self._watchdog is not None and is_peer_failure(exception):
            # gloo/NCCL only say "connection closed by peer": let the watchdog name the rank (it exits if it can).
            self._watchdog.wait_for_lost_peer()
        elif self._watchdog is not None and isinstance(exception, Exception):
            # This rank leaves while the others may wait for it inside a collective (an OOM on one DP group, a
            # save failing on rank 0 only): tell them, so they exit at once naming it (`faults.RankWatchdog`).
            self._watchdog.report_failure(exception)
        super().on_exception(exception)

    def _save_on_sigterm(self) -> None:
        trainer = self.lightning_module.trainer
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        rank_zero_info(f"lightning_ulysses: saved {path} on a scheduler's signal. Resume with trainer.fit(...,"
                       " ckpt_path='hpc').")
        environment = self.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and self.is_global_zero:
            job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
            job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job_id else os.environ["SLURM_JOB_ID"]
            try:
                subprocess.call(["scontrol", "requeue", job_id])
            except FileNotFoundError:  # saved anyway; the job just is not requeued
                rank_zero_warn(f"lightning_ulysses: `scontrol` not found; SLURM job {job_id} was not requeued.")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._load_consolidated_weights:
            self._load_consolidated_weights = False
            self.model_to_device()
            self._restore_zero_state(checkpoint, strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict)

    # -- data ---------------------------------------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device=None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if not self.batches_are_sharded:
            return batch
        self._check_same_batch_in_group(batch)
        return self._sharder(batch)

    _FIRST_BATCHES_CHECKED = 2

    def _check_same_batch_in_group(self, batch: Any) -> None:
        """Raise, on every rank of the SP group alike, if its ranks were handed different batches."""
        groups = self.parallel_groups
        if groups.sequence_parallel_world_size == 1 or self.check_batches == "never":
            return
        stage = self.lightning_module.trainer.state.stage
        checked = self._batches_checked.get(stage, 0)
        if self.check_batches == "first" and checked >= self._FIRST_BATCHES_CHECKED:
            return
        self._batches_checked[stage] = checked + 1
        fingerprint = batch_fingerprint(batch).to(self.root_device)
        gathered = [torch.empty_like(fingerprint) for _ in range(groups.sequence_parallel_world_size)]
        torch.distributed.all_gather(gathered, fingerprint, group=groups.sequence_parallel_group)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            return
        ranks = next(g for g in groups.layout.sequence_parallel_groups() if self.global_rank in g)
        raise ValueError(
            f"The ranks {ranks} of one sequence-parallel group were given different batches (stage {stage}, batch"
            f" {checked}). Every rank of an SP group must load the same samples (they share each"
            " sequence): use the strategy's distributed sampler (Lightning adds it; a sampler of your own should take"
            " num_replicas=strategy.data_parallel_world_size, rank=strategy.data_parallel_rank), and shard an"
            " IterableDataset by strategy.data_parallel_rank, not by global rank."
        )

    # -- registry -----------------------------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        # Not calling super(): it would re-register the "deepspeed*" names, which the registry refuses.
        strategy_registry.register(
            "ulysses", cls, description="DeepSpeed-Ulysses sequence parallelism, ZeRO-3, SP = devices per node"
        )
        for stage in (1, 2, 3):
            strategy_registry.register(
                f"ulysses_stage_{stage}", cls, description=f"DeepSpeed-Ulysses with ZeRO stage {stage}", stage=stage
            )
        strategy_registry.register(
            "ulysses_notebook",
            cls,
            description="DeepSpeed-Ulysses with ZeRO-3, ranks forked from the current process (Jupyter notebooks)",
            start_method="fork",
        )
        strategy_registry.register(
            "ulysses_stage_3_offload",
            cls,
            description="DeepSpeed-Ulysses with ZeRO-3, optimizer and parameters offloaded to CPU",
            stage=3,
            offload_optimizer=True,
            offload_parameters=True,
        )
