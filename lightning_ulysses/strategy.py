"""`UlyssesDeepSpeedStrategy`: Lightning glue only.

groups (layout.py) → DP-only sampler → sequence sharding (sharding.py) → Ulysses attention (attention/) →
SP-aware loss (loss.py) → DeepSpeed with an `mpu`, so ZeRO partitions and reduces over all DP×SP ranks.
"""

from __future__ import annotations

import argparse
import functools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities import imports as _fabric_imports
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_ulysses.attention.core import UlyssesAttention
from lightning_ulysses.attention.hf import find_hf_models, prepare_hf_model, validate_hf_model
from lightning_ulysses.layout import ParallelLayout, SequenceParallelGroups, check_sequence_parallel_size
from lightning_ulysses.memory import MemoryOptions, apply_allocator_settings, apply_memory_options
from lightning_ulysses.loss import (
    LossFunctionHost,
    SequenceParallelCausalLMLoss,
    gradient_scale_for,
    swap_loss_function,
)
from lightning_ulysses.notebook import UlyssesForkLauncher
from lightning_ulysses.sharding import SequencePadding, SequenceSharder

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


class UlyssesDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed (ZeRO) with DeepSpeed-Ulysses sequence parallelism.

    Args:
        sequence_parallel_size: ranks that share one sequence (each holds `seq / sequence_parallel_size`
            tokens). Must divide the number of processes and the model's head count. `None` (the default):
            the number of devices per node, so every SP group is one node and DP runs across nodes. `1`: plain
            ZeRO. May also come from a DeepSpeed config block `"ulysses": {"enable": true,
            "sequence_parallel_world_size": N}`, which is removed before DeepSpeed sees the config.
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
        **kwargs: every other `lightning.pytorch.strategies.DeepSpeedStrategy` argument.
    """

    strategy_name = "ulysses"

    def __init__(
        self,
        sequence_parallel_size: Optional[int] = None,
        *,
        sequence_padding: SequencePadding = "pad",
        stage: int = 3,
        config: Optional[Union[str, dict[str, Any]]] = None,
        config_overrides: Optional[Mapping[str, Any]] = None,
        sequence_parallel_in_evaluation: bool = True,
        memory: Union[MemoryOptions, Mapping[str, Any], None] = None,
        start_method: Optional[Literal["fork"]] = None,
        **kwargs: Any,
    ) -> None:
        memory = MemoryOptions.coerce(memory)  # bad options fail here, in the launching process
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
        if sequence_padding not in ("pad", "error"):
            raise ValueError(f"sequence_padding must be 'pad' or 'error', got {sequence_padding!r}")
        if start_method not in (None, "fork"):
            raise ValueError(
                f"start_method must be None (script launch) or 'fork' (notebooks), got {start_method!r}."
            )
        super().__init__(stage=stage, config=config, **kwargs)
        if config_overrides:
            self.config = _deep_merge(self.config, config_overrides)
        self._requested_sequence_parallel_size = sequence_parallel_size
        self.sequence_padding = sequence_padding
        self._groups: Optional[SequenceParallelGroups] = None
        self._sharder: Optional[SequenceSharder] = None
        self._restore_callbacks: list[Callable[[], None]] = []
        self.sequence_parallel_in_evaluation = sequence_parallel_in_evaluation
        self.memory = memory
        self._unsharded_evaluation = False  # True while validate/test/predict runs with plain attention
        self._load_consolidated_weights = False  # see load_checkpoint
        # DeepSpeedStrategy does not forward DDPStrategy's start_method (it stays "popen", the script launch).
        self._start_method = start_method or "popen"

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
        modules that compute their loss from logits (labels as this strategy delivers them: shifted, sharded)."""
        groups = self.parallel_groups
        group = groups.sequence_parallel_group if groups.sequence_parallel_world_size > 1 else None
        return SequenceParallelCausalLMLoss(group, gradient_scale_for(self.config, groups.sequence_parallel_world_size))

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

    def _setup_parallel_groups(self) -> None:
        size = self._requested_sequence_parallel_size or self.num_processes
        layout = ParallelLayout(world_size=self.world_size, sequence_parallel_size=size)  # raises before any collective
        if self._groups is None or self._groups.layout != layout:  # fit → validate reuses the groups
            self._groups = SequenceParallelGroups.build(layout)
            rank_zero_info(f"lightning_ulysses: {layout}, SP groups {layout.sequence_parallel_groups()}")
        self._sharder = SequenceSharder(size, self._groups.sequence_parallel_rank, self.sequence_padding)

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

    def _prepare_modules(self) -> None:
        self._restore_modules()
        groups = self.parallel_groups
        size = groups.sequence_parallel_world_size
        group = groups.sequence_parallel_group if size > 1 else None
        module = self.lightning_module
        hf_models = find_hf_models(module)
        native = [m for m in module.modules() if isinstance(m, UlyssesAttention)]
        if size > 1 and not hf_models and not native:
            raise ValueError(
                f"sequence_parallel_size={size} but {type(module).__name__} holds no Hugging Face PreTrainedModel and"
                " no lightning_ulysses.UlyssesAttention, so nothing would exchange tokens between shards. Wrap your"
                " attention function: UlyssesAttention(F.scaled_dot_product_attention)."
            )
        for model in hf_models:  # all checks first: a failure leaves no model half-prepared
            validate_hf_model(model, size)
        loss = self.loss_function
        self._restore_callbacks = [prepare_hf_model(model, group, loss).restore for model in hf_models]
        for bindable in module.modules():  # UlyssesAttention, SequenceParallel metrics, ...
            if callable(getattr(bindable, "bind_parallel_groups", None)):
                bindable.bind_parallel_groups(groups)
                self._restore_callbacks.append(functools.partial(bindable.bind_parallel_groups, None))
        self._restore_callbacks += [
            swap_loss_function(host, loss) for host in module.modules() if isinstance(host, LossFunctionHost)
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
        super().teardown()

    # -- evaluation without sequence parallelism (opt-in) ----------------------------------------------------------
    # The parents' validation/test/predict start and end hooks are no-ops, so one pair serves all three loops.
    @override
    def on_validation_start(self) -> None:
        if not self.sequence_parallel_in_evaluation and not self._unsharded_evaluation:
            self._restore_modules()
            self._unsharded_evaluation = True

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
    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        from lightning.pytorch.trainer.states import TrainerFn

        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting or not self.zero_stage_3 or self.load_full_weights or not os.path.isdir(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        # validate/test/predict(ckpt_path=<ZeRO-3 checkpoint>): DeepSpeed 0.19 cannot load a ZeRO-3 checkpoint
        # into an engine without optimizer (it calls `_restore_from_bit16_weights` on `DeepSpeedZeRoOffload`).
        # Consolidate the fp32 weights from the shards instead and let Lightning's full-weights path copy them into
        # the partitioned parameters, module by module.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tag = (Path(checkpoint_path) / "latest").read_text().strip()
        # Lightning's own entries (epoch, callbacks, ...) are saved as DeepSpeed client state in every model-state file.
        states = Path(checkpoint_path) / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        checkpoint = torch.load(states, map_location="cpu", weights_only=False)
        # Only global rank 0 reads the weights (`_restore_zero_state` copies them in from rank 0 alone): one full
        # fp32 copy of the model in host memory, not one per rank.
        checkpoint["state_dict"] = (
            get_fp32_state_dict_from_zero_checkpoint(checkpoint_path, tag=tag) if self.is_global_zero else {}
        )
        self._load_consolidated_weights = True
        return checkpoint

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
        return self._sharder(batch) if self.batches_are_sharded else batch

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
