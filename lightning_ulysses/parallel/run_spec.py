"""One description of the run: what `UlyssesDeepSpeedStrategy` trains with, read once from its arguments and the
DeepSpeed config, validated in one place, asked by name.

`RunSpec` is decided before the model exists, as a set of parallel dimensions is: the SP × DP layout
(`layout.ParallelLayout`), the ZeRO stage and the options of it that this package depends on (optimizer and parameter
offload, the offload ratio and its sub-groups, reduce-scatter), the precision, the gradient accumulation dtype and the
device. Every reader — the loss's gradient scale, the start-up preflight, `memory="auto"` and the plan, the
checkpoint manifest, the recipes' optimizer — asks it (`zero_stage`, `offloads_optimizer`, `compute_bytes`, ...)
instead of reading the DeepSpeed config; this module is the only one that knows the config's layout:

- the DeepSpeed-Ulysses dialect: the `"ulysses"` block of the configs published with DeepSpeed-Ulysses
  (`{"enable": true, "sequence_parallel_world_size": 8}`) is read for the SP size and removed before DeepSpeed
  sees the config (DeepSpeed itself does not know the key);
- `config_overrides`, merged into the config Lightning built from the strategy's arguments, recursively, so a recipe
  can set one nested knob without restating its section (a `None` value means "not set");
- the ZeRO section, read (`RunSpec.of_config`) and written: the optimizer offload and sub-group size that
  `memory="auto"` decides (`RunSpec.with_memory_choice`, then `written_into`), and the inference engine's config
  (`inference_config`).

The same description serves the FSDP2 backend (`UlyssesFSDPStrategy`, `backend="fsdp2"`): `RunSpec.of_fsdp_arguments`
reads that strategy's arguments, refusing — before any process group exists, on every rank alike — what the backend
does not support (DeepSpeed's options, a share of the optimizer on the host, precisions other than 32-true and
bf16-mixed) with a message naming the fix. FSDP2 shards parameters, gradients and optimizer state over all DP × SP
ranks as ZeRO-3 does, so it reads as stage 3 to every reader that asks `zero3`.

Two facts depend on the model and are settled in the strategy's `setup`, after the run is described: the ring size
(from the heads' counts) and `memory="auto"`'s optimizer offload. Each gives a new `RunSpec` (`with_ring_size`,
`with_memory_choice`); nothing changes one in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Union

import torch

from lightning_ulysses.parallel.layout import ParallelLayout, check_ring_size, check_sequence_parallel_size

_ZERO = "zero_optimization"
_ULYSSES_CONFIG_KEYS = {"enable", "sequence_parallel_world_size"}
OFFLOAD_DEVICES = ("cpu", "nvme")  # where DeepSpeed can put the optimizer or the parameters ("none": nowhere)
# `UlyssesDeepSpeedStrategy`'s `sub_group_size` argument (Lightning's default, one sub-group for any model): what
# `memory="auto"` assumes a config without `sub_group_size` keeps (DeepSpeed's own default is 1e9).
LIGHTNING_SUB_GROUP_SIZE = 10**12
BACKENDS = ("deepspeed", "fsdp2")
FSDP2_PRECISIONS = ("32-true", "bf16-mixed")  # FSDP2's MixedPrecisionPolicy gives bf16-mixed (`fsdp_param_dtype`)
# The strategy arguments `UlyssesFSDPStrategy` takes (its own, and `ModelParallelStrategy`'s it keeps).
FSDP2_ARGUMENTS = ("sequence_parallel_size", "ring_size", "sequence_padding", "sequence_parallel_in_evaluation",
                   "memory", "sdpa_kernel_priority", "overlap_head_groups", "check_batches", "per_rank_values",
                   "reshard_after_forward", "process_group_backend", "timeout", "heartbeat_timeout", "quiet_third_party")
# What the DeepSpeed strategy takes and FSDP2 has no counterpart for (refused by name, with the fix).
_DEEPSPEED_ONLY_HINTS = {
    "stage": "FSDP2 always shards parameters, gradients and optimizer state over all ranks (as ZeRO-3)",
    "tensor_parallel_size": "tensor parallelism is not combined with sequence parallelism here",
    "data_parallel_size": "the data-parallel size is the number of processes / sequence_parallel_size",
    "exchange": "FSDP2 runs the all-to-alls over the collective backend only",
    "zero3_leaf_layers": "FSDP2 gathers each decoder layer whole already (one fully_shard unit per layer)",
    "start_method": "launch FSDP2 runs as a script (torchrun or Lightning's launcher)",
}
# `ModelParallelStrategy`'s arguments the FSDP2 strategy fixes (refused by name, with why).
_FIXED_FOR_FSDP2 = {
    "save_distributed_checkpoint": "checkpoints are always torch Distributed Checkpoint folders, one shard per rank,"
                                   " resumable at any SP x DP split; `python -m lightning_ulysses checkpoint export`"
                                   " writes the whole weights",
}


@dataclass(frozen=True)
class RunSpec:
    """The run, as the strategy's arguments and DeepSpeed config describe it (see the module docstring).

    Fields are what the config says (`None`: not set, DeepSpeed's default applies); the properties answer the
    questions readers ask. Built by `of_config` (the strategy, at set-up) or `of_strategy_arguments` (a recipe, before
    any strategy exists); constructed directly by the planner's command lines and tests."""

    layout: ParallelLayout = field(default_factory=lambda: ParallelLayout(world_size=1, sequence_parallel_size=1))
    zero_stage: int = 3
    reduce_scatter: bool = True  # zero_optimization.reduce_scatter (DeepSpeed's default: on)
    optimizer_offload_device: Optional[str] = None  # zero_optimization.offload_optimizer.device: "cpu", "nvme" or None
    optimizer_offload_ratio: Optional[float] = None  # offload_optimizer.ratio (ZeRO-3's partial offload)
    optimizer_offload_pin_memory: bool = True  # offload_optimizer.pin_memory (DeepSpeed's default: true)
    parameter_offload_device: Optional[str] = None  # zero_optimization.offload_param.device
    sub_group_size: Optional[int] = None  # zero_optimization.sub_group_size (None: DeepSpeed's 1e9)
    grad_accum_dtype: Optional[str] = None  # data_types.grad_accum_dtype
    precision: str = "32-true"  # Lightning's precision plugin's
    device: Union[torch.device, str] = "cpu"  # this rank's root device (its type is what readers ask)
    backend: str = "deepspeed"  # what shards the parameters: DeepSpeed's ZeRO or torch's FSDP2 (`fully_shard`)
    reshard_after_forward: bool = True  # FSDP2: parameters freed after each unit's forward (gathered again in backward)
    memory_features: tuple[str, ...] = ()  # the memory features that change the models (`MemoryOptions`), or "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        if self.fsdp2:
            self._check_fsdp2()
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero_stage!r}: set stage=0..3 in the"
                             " strategy's arguments or zero_optimization.stage in the DeepSpeed config.")
        if self.optimizer_offload_ratio is not None and not 0.0 <= self.optimizer_offload_ratio <= 1.0:
            raise ValueError(f"offload_optimizer.ratio is the share of the optimizer on the host, in [0, 1]; got"
                             f" {self.optimizer_offload_ratio}. Set zero_optimization.offload_optimizer.ratio to a"
                             " fraction (1: all of it).")
        self._check_gradient_reduction()

    def _check_gradient_reduction(self) -> None:
        """ZeRO-3 with `reduce_scatter: false` follows no single rule: a bucket within `reduce_bucket_size` takes the
        contiguous path, which divides by DP; a parameter larger than the bucket, or `contiguous_gradients: false`,
        takes the reduce-scatter path, which divides by DP×SP (`stage3.py` `__reduce_and_partition_ipg_grads`). One
        factor on the loss (`loss_gradient_scale`) cannot be right for both, so at SP > 1 that combination is refused
        here, identically on every rank, before any group exists."""
        sp = self.layout.sequence_parallel_size
        if self.zero_stage == 3 and sp > 1 and not self.reduce_scatter:
            raise ValueError(
                f"ZeRO-3 with reduce_scatter=False cannot train exactly at sequence_parallel_size={sp}:"
                " DeepSpeed then divides the gradients of buckets within reduce_bucket_size by the DP size and those of"
                " larger parameters (or all of them with contiguous_gradients=False) by DP × SP, and no single loss"
                " scale corrects both. Leave reduce_scatter on (the default; remove reduce_scatter=False from the"
                ' strategy arguments or "reduce_scatter": false from the DeepSpeed config\'s zero_optimization).'
            )

    def _check_fsdp2(self) -> None:
        """What FSDP2 cannot run, refused with the fix (identically on every rank, before any group)."""
        if FSDP2_REFUSED_OFFLOAD in self.memory_features:
            raise ValueError(
                "memory={'auto': True, 'offload_optimizer': ...} moves a share of the optimizer to the host, which the"
                " FSDP2 strategy (strategy='ulysses_fsdp') cannot do: FSDP2's only offload, CPUOffloadPolicy, moves all"
                " parameters, gradients and optimizer states to the host together (no share) and steps torch's AdamW"
                " there, a different and far slower step than DeepSpeed's partial offload with its CPU Adam. Leave"
                " offload_optimizer out (or 0.0: memory='auto' on FSDP2 keeps the optimizer on the device), or use"
                " strategy='ulysses' (UlyssesDeepSpeedStrategy) for the optimizer on the host.")
        if self.precision not in FSDP2_PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not supported by the FSDP2 strategy (strategy='ulysses_fsdp'):"
                f" use one of {FSDP2_PRECISIONS} (bf16-mixed runs through FSDP2's MixedPrecisionPolicy: bf16"
                " compute, fp32 parameters and gradient reduction), or strategy='ulysses' (DeepSpeed).")
        if self.zero_stage != 3 or self.optimizer_offload_device or self.parameter_offload_device:
            raise ValueError("FSDP2 shards as ZeRO-3 and offloads nothing here: a RunSpec of backend 'fsdp2' has"
                             " zero_stage=3 and no offload.")

    # -- reading ----------------------------------------------------------------------------------------------------
    @classmethod
    def of_config(cls, config: Optional[Mapping[str, Any]], *, layout: Optional[ParallelLayout] = None,
                  precision: str = "32-true", device: Union[torch.device, str] = "cpu") -> "RunSpec":
        """The run a DeepSpeed config describes, on `layout`, in `precision`, on `device`. Raises `ValueError` (naming
        the fix) for a combination that cannot train exactly."""
        config = config or {}
        zero = config.get(_ZERO) or {}
        optimizer = zero.get("offload_optimizer") or {}
        parameters = zero.get("offload_param") or {}
        ratio = optimizer.get("ratio")
        sub_group_size = zero.get("sub_group_size")
        return cls(
            layout=layout if layout is not None else ParallelLayout(world_size=1, sequence_parallel_size=1),
            zero_stage=int(zero.get("stage", 0)), reduce_scatter=bool(zero.get("reduce_scatter", True)),
            optimizer_offload_device=_offload_device(optimizer),
            optimizer_offload_ratio=None if ratio is None else float(ratio),
            optimizer_offload_pin_memory=bool(optimizer.get("pin_memory", True)),
            parameter_offload_device=_offload_device(parameters),
            sub_group_size=None if sub_group_size is None else int(float(sub_group_size)),
            grad_accum_dtype=(config.get("data_types") or {}).get("grad_accum_dtype"),
            precision=str(precision), device=device)

    @classmethod
    def of_strategy_arguments(cls, arguments: Mapping[str, Any], **facts: Any) -> "RunSpec":
        """The run `UlyssesDeepSpeedStrategy(**arguments)` would describe, without building the strategy (a recipe
        plans before any process starts): `config` if given, else the ZeRO section its ZeRO arguments make (stage 3,
        `offload_optimizer`/`offload_parameters` on the CPU, `sub_group_size`, `pin_memory`, `reduce_scatter`, with
        Lightning's defaults), then `config_overrides` merged in. `facts`: `layout`, `precision`, `device`."""
        config = arguments.get("config")
        if isinstance(config, str):
            with open(config) as file:
                config = json.load(file)
        if config is None:
            sub_group_size = int(float(arguments.get("sub_group_size", LIGHTNING_SUB_GROUP_SIZE)))
            zero: dict[str, Any] = {"stage": int(arguments.get("stage", 3)), "sub_group_size": sub_group_size,
                                    "reduce_scatter": bool(arguments.get("reduce_scatter", True))}
            pin_memory = bool(arguments.get("pin_memory", False))  # Lightning's default
            if arguments.get("offload_optimizer", False):
                zero["offload_optimizer"] = {"device": arguments.get("offload_optimizer_device", "cpu"),
                                             "pin_memory": pin_memory}
            if arguments.get("offload_parameters", False):
                zero["offload_param"] = {"device": arguments.get("offload_params_device", "cpu"),
                                         "pin_memory": pin_memory}
            config = {_ZERO: zero}
        config, _ = split_ulysses_block(config)
        return cls.of_config(deep_merge(config, arguments.get("config_overrides") or {}), **facts)

    @classmethod
    def of_fsdp_arguments(cls, arguments: Mapping[str, Any], **facts: Any) -> "RunSpec":
        """The run `UlyssesFSDPStrategy(**arguments)` describes (`facts`: `layout`, `precision`, `device`), refusing
        the arguments FSDP2 has no counterpart for — DeepSpeed's (its ZeRO, config and offload options; the rest of
        `UlyssesDeepSpeedStrategy`'s), `ModelParallelStrategy`'s tensor-parallel sizes — and, in `arguments["memory"]` (what
        `memory_features_of` reads), a share of the optimizer on the host, each with the fix. Unknown names: `TypeError`."""
        unknown = [name for name in arguments if name not in FSDP2_ARGUMENTS]
        fixed = [f"{name} ({_FIXED_FOR_FSDP2[name]})" for name in unknown if name in _FIXED_FOR_FSDP2]
        if fixed:
            raise ValueError(f"The FSDP2 strategy (strategy='ulysses_fsdp') fixes {'; '.join(fixed)}: remove it.")
        if unknown:
            hints = [f"{name} ({_DEEPSPEED_ONLY_HINTS[name]})" for name in unknown if name in _DEEPSPEED_ONLY_HINTS]
            deepspeed = [name for name in unknown if name in _DEEPSPEED_ARGUMENTS or name in _DEEPSPEED_ONLY_HINTS]
            if deepspeed:
                raise ValueError(
                    f"{deepspeed} {'is a' if len(deepspeed) == 1 else 'are'} DeepSpeed strategy option(s) that the"
                    " FSDP2 strategy (strategy='ulysses_fsdp') does not take" + (f": {'; '.join(hints)}" if hints else "")
                    + ". Remove them, or use strategy='ulysses' (UlyssesDeepSpeedStrategy) to train with DeepSpeed.")
            raise TypeError(f"UlyssesFSDPStrategy got unexpected argument(s) {unknown}; it takes {list(FSDP2_ARGUMENTS)}.")
        return cls(backend="fsdp2", zero_stage=3,
                   reshard_after_forward=bool(arguments.get("reshard_after_forward", True)),
                   memory_features=memory_features_of(arguments.get("memory")), **facts)

    def with_layout(self, layout: ParallelLayout, **facts: Any) -> "RunSpec":
        """This run on `layout` (and with the given `precision`/`device`), checked again."""
        return replace(self, layout=layout, **facts)

    # -- what readers ask -------------------------------------------------------------------------------------------
    @property
    def fsdp2(self) -> bool:
        """Parameters sharded by torch's FSDP2 (`fully_shard`) over all ranks, not by DeepSpeed."""
        return self.backend == "fsdp2"

    @property
    def fsdp_param_dtype(self) -> Optional[torch.dtype]:
        """FSDP2's `MixedPrecisionPolicy.param_dtype`: bf16 under bf16-mixed (gradients reduced in fp32), None
        (the parameters' own dtype) otherwise."""
        return torch.bfloat16 if self.fsdp2 and self.precision == "bf16-mixed" else None

    @property
    def zero3(self) -> bool:
        return self.zero_stage == 3

    @property
    def offloads_optimizer(self) -> bool:
        """The optimizer steps on the host (DeepSpeed's CPU Adam), for all or part of the parameters."""
        return self.optimizer_offload_device in OFFLOAD_DEVICES

    @property
    def offloads_parameters(self) -> bool:
        return self.parameter_offload_device in OFFLOAD_DEVICES

    @property
    def optimizer_share_on_host(self) -> float:
        """The share of the optimizer (by sub-group count) DeepSpeed keeps on the host: 0 without offload; the ratio
        under ZeRO-3 (the only stage that splits); all of it otherwise."""
        if not self.offloads_optimizer:
            return 0.0
        if self.zero3 and self.optimizer_offload_ratio is not None:
            return self.optimizer_offload_ratio
        return 1.0

    @property
    def compute_bytes(self) -> int:
        """Bytes per element the model computes in: 2 in 16-bit precisions (bf16 or fp16, mixed or true), else 4."""
        return 2 if self.precision.startswith(("bf16", "16")) else 4

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def sequence_parallel_size(self) -> int:
        return self.layout.sequence_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def loss_gradient_scale(self) -> float:
        """Factor that makes DeepSpeed's gradient reduction return the mean over DP of full-sequence gradients
        (`loss.SequenceParallelCausalLMLoss` multiplies each SP rank's share by it, in backward only).

        Measured with SGD on DeepSpeed 0.19 (tests/distributed/test_parity.py fails if it changes): ZeRO 0/1/2 sum
        the gradients over DP×SP and divide by DP on every path (buckets of any size, `contiguous_gradients` on or off,
        `reduce_scatter` on or off: `runtime/engine.py` `_reduce_non_expert_gradients`, `stage_1_and_2.py`
        `average_tensor`/`allreduce_bucket`), which is already right. ZeRO-3's reduce-scatter divides by DP×SP
        (`runtime/comm/coalesced_collectives.py`), so each SP rank's share must be scaled up by SP to compensate
        (ZeRO-3 without reduce-scatter at SP > 1 is refused on construction). FSDP2's reduce-scatter averages over
        all the ranks it shards over (every rank: torch 2.13, measured on gloo), i.e. divides by DP×SP as ZeRO-3."""
        return float(self.sequence_parallel_size) if self.zero3 else 1.0

    # -- decisions made later, and writing them -----------------------------------------------------------------------
    def with_ring_size(self, ring_size: int) -> "RunSpec":
        return replace(self, layout=self.layout.with_ring_size(ring_size))

    def with_memory_choice(self, optimizer_share: float, sub_group_size: int) -> "RunSpec":
        """This run with `memory="auto"`'s choice: ZeRO-3 on CUDA takes its sub-group size; a share of the optimizer
        on the host is offloaded to the CPU (pinned), unless the config already offloads it (kept as configured).
        FSDP2 has no sub-groups and no share on the host (`memory="auto"` never chooses one there): unchanged."""
        if self.fsdp2:
            if optimizer_share:
                raise ValueError(f"FSDP2 keeps the optimizer on the device; memory='auto' chose {optimizer_share:.0%}"
                                 " of it on the host.")
            return self
        changes: dict[str, Any] = {}
        if self.on_cuda and self.zero3:
            changes["sub_group_size"] = sub_group_size
        if optimizer_share and not self.offloads_optimizer:
            changes.update(optimizer_offload_device="cpu", optimizer_offload_pin_memory=True,
                           optimizer_offload_ratio=optimizer_share)
        return replace(self, **changes)

    def written_into(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`config` (a copy) with this run's optimizer offload and sub-group size in its ZeRO section: what DeepSpeed
        must start with after `with_memory_choice`. Fields not set here are left as `config` has them."""
        config = dict(config)
        zero = dict(config.get(_ZERO) or {})
        if self.sub_group_size is not None:
            zero["sub_group_size"] = self.sub_group_size
        if self.offloads_optimizer:
            offload = {**(zero.get("offload_optimizer") or {}), "device": self.optimizer_offload_device,
                       "pin_memory": self.optimizer_offload_pin_memory}
            if self.optimizer_offload_ratio is not None:
                offload["ratio"] = self.optimizer_offload_ratio
            zero["offload_optimizer"] = offload
        config[_ZERO] = zero
        return config


def memory_features_of(memory: Any) -> tuple[str, ...]:
    """The memory features that change the models in a strategy's `memory` argument (a `MemoryOptions`, a mapping of
    its fields, "auto", an `AutoMemory`), by name; () for none; `checkpoint_interval` where it is above 1; "auto"
    followed by `FSDP2_REFUSED_OFFLOAD` where an auto request pins a share of the optimizer on the host. Read from
    names only (this layer sits below `memory/` and `planning/`): the allocator setting `expandable_segments` changes
    no model and is not one."""
    if memory is None:
        return ()
    if isinstance(memory, str) or type(memory).__name__ == "AutoMemory" or (
            isinstance(memory, Mapping) and memory.get("auto")):
        fields = {} if isinstance(memory, str) else memory if isinstance(memory, Mapping) else vars(memory)
        return ("auto",) + ((FSDP2_REFUSED_OFFLOAD,) if (fields.get("offload_optimizer") or 0) > 0 else ())
    fields = memory if isinstance(memory, Mapping) else vars(memory)
    return (tuple(name for name in _MODEL_MEMORY_FEATURES if fields.get(name))
            + (("checkpoint_interval",) if (fields.get("checkpoint_interval") or 1) > 1 else ()))


_MODEL_MEMORY_FEATURES = ("tiled_mlp", "tiled_logits_loss", "activation_checkpointing", "offload_activations",
                          "keep_attention_outputs", "low_memory_norms", "fused_elementwise", "checkpoint_layers",
                          "keep_matmul_outputs", "keep_token_mixer_outputs")
# FSDP2 runs every memory feature above exactly (tests/distributed/test_fsdp.py), `checkpoint_interval` > 1 too (a
# stretch's recompute gathers the FSDP2 units it runs: `memory/checkpointing.py`), partial layer checkpointing and
# kept products too (the recompute replays the `mm` / `addmm` the gathered parameters ran in the forward), and
# `memory="auto"` plans its memory (`planning/planner.py`) with all of them; it refuses a share of the optimizer on the
# host (`RunSpec._check_fsdp2` says why).
FSDP2_REFUSED_OFFLOAD = "offload_optimizer"
# `UlyssesDeepSpeedStrategy`'s own arguments and Lightning's `DeepSpeedStrategy`'s that FSDP2 does not take.
_DEEPSPEED_ARGUMENTS = frozenset((
    "stage", "config", "config_overrides", "exchange", "zero3_leaf_layers", "start_method",
    "zero_optimization", "allgather_partitions", "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size",
    "zero_allow_untested_optimizer", "logging_batch_size_per_gpu", "offload_optimizer", "offload_parameters",
    "offload_params_device", "nvme_path", "params_buffer_count", "params_buffer_size", "max_in_cpu", "offload_optimizer_device",
    "optimizer_buffer_count", "block_size", "queue_depth", "single_submit", "overlap_events", "thread_count",
    "pin_memory", "sub_group_size", "contiguous_gradients", "overlap_comm", "remote_device", "cpu_checkpointing",
    "partition_activations", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "logging_level",
    "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale", "load_full_weights",
    "exclude_frozen_parameters"))


def _offload_device(section: Mapping[str, Any]) -> Optional[str]:
    device = section.get("device")
    return None if device in (None, "none") else str(device)


def inference_config(config: Mapping[str, Any], zero_stage_3: bool) -> dict[str, Any]:
    """The config of an engine without optimizer, exactly as Lightning's `_initialize_deepspeed_inference` builds
    it (lightning 2.6): precision, and the ZeRO section under ZeRO-3 (parameters stay partitioned)."""
    inference = {"train_micro_batch_size_per_gpu": 1}  # Lightning: "required for DeepSpeed throughput timers"
    if "fp16" in config:
        inference["fp16"] = config["fp16"]
    if "bf16" in config:
        inference["bf16"] = config["bf16"]
    if zero_stage_3:
        inference["zero_allow_untested_optimizer"] = config["zero_allow_untested_optimizer"]
        inference[_ZERO] = config[_ZERO]
    return inference


# -- the DeepSpeed-Ulysses dialect and config_overrides ----------------------------------------------------------------
def split_ulysses_block(config: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[int]]:
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


def read_sequence_parallel_size(
    config: Optional[Mapping[str, Any]], sequence_parallel_size: Optional[int], ring_size: Optional[int] = None,
) -> tuple[Optional[dict[str, Any]], Optional[int]]:
    """The config without its `"ulysses"` block and the SP size: the argument's, else the block's (they must agree
    when both are given). The sizes are checked here, before any process group exists (`ring_size` against the SP
    size when both are known; the world size is checked by `ParallelLayout` once it is)."""
    if config is not None:
        config, configured_size = split_ulysses_block(config)
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
    return config, sequence_parallel_size


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if value is None:  # "not set": lets a recipe list a knob without forcing a value on DeepSpeed
            continue
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
