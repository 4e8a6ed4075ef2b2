"""`memory="auto"`: the configuration with the shortest predicted step time that fits, chosen by the planner.

```python
UlyssesDeepSpeedStrategy(memory="auto")                                    # the recipes fill in the length
UlyssesDeepSpeedStrategy(memory={"auto": True, "seq_len": 131072})         # every feature chosen
UlyssesDeepSpeedStrategy(memory={"auto": True, "seq_len": 131072, "tiled_mlp": False})   # one field pinned
UlyssesDeepSpeedStrategy(memory=AutoMemory(seq_len=131072, offload_optimizer=0.0))       # the same, typed
```

`choose` enumerates the memory features (tiled logits + loss, low-memory norms, tiled MLP, layer checkpointing
with its interval, kept attention outputs and host offload of the kept tensors) and, for each, the smallest share
of the optimizer on the host (DeepSpeed's `offload_optimizer.ratio`, in 5% steps over 40 sub-groups) whose plan
(`planner.plan_memory`) fits the free memory less a margin; of those it takes the one with the shortest predicted
step (`step_time.predict_step_time`), fewer features on a tie. Fields set in the request are kept as set. So with
plenty of memory nothing is switched on, and as memory gets tighter the features come in by what they cost per byte
saved: first the free ones (tiled logits + loss, then low-memory norms), then those that recompute (tiled MLP,
layer checkpointing with kept attention outputs), then host transfers (offloaded layer inputs), sparser checkpoints,
and the optimizer on the host last (CPU Adam is the slowest per byte saved).

The decision is made once per run in the strategy's `setup`, after the model is built (its shape comes from its
config, also under ZeRO-3, where the parameters are already partitioned) and before the memory features are applied
and DeepSpeed starts: every rank measures its free memory, one all-reduce takes the minimum over all ranks, and every
rank then computes the same choice from the same numbers (a refusal, too, is raised on every rank alike). The first
training steps confirm it (`StepProbe`): their measured step time and device peak are logged against the prediction.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lightning_ulysses.attention.backends import FA4, fa4_installed
from lightning_ulysses.adapters.native_model import NativeCausalLM
from lightning_ulysses.memory import MemoryOptions, features_refused_by, fused_elementwise_applies
from lightning_ulysses.parallel.run_spec import LIGHTNING_SUB_GROUP_SIZE, RunSpec
from lightning_ulysses.planning.planner import (GIB, MemoryPlan, ModelShape, TrainingSetup, _saved_bytes_by_layer,
                                                plan_memory)
from lightning_ulysses.planning.selective import describe as describe_layers, layer_costs, uncheckpoint_order, which
from lightning_ulysses.planning.step_time import (H200, KNOWN_DEVICES, DeviceSpeeds, StepTime,
                                                  layer_recompute_seconds, predict_step_time, speeds_for)

_log = logging.getLogger("lightning.pytorch.ulysses")

# The features `choose` decides, in the order the report lists them.
FEATURES = ("tiled_logits_loss", "low_memory_norms", "tiled_mlp", "activation_checkpointing",
            "keep_attention_outputs", "keep_matmul_outputs", "keep_token_mixer_outputs", "offload_activations",
            "checkpoint_interval")
INTERVALS = (1, 2, 4, 8)
RATIO_STEPS = 20  # optimizer shares on the host: 0, 5%, ..., 100%
SUB_GROUPS = 40  # sub-groups the optimizer is cut into when part of it is offloaded (DeepSpeed splits by count)


@dataclass(frozen=True)
class AutoMemory:
    """What `memory="auto"` decides from, and the fields a user pins (None: chosen).

    `free_memory`: None measures it (CUDA: the device's free memory and the node's available host memory over its
    ranks; CPU: the available host memory over the node's ranks, which is then the device memory as well); a pair
    `(device_bytes, host_bytes)` or a callable `device -> (device_bytes, host_bytes)` replaces the measurement
    (tests, or a budget smaller than the machine). The margins are fractions of it left unused. On the device
    (one H200, the default expandable segments; benchmarks/results/2026-12-02-h200-auto-vs-hand/ and the other
    2026-12-02 results): the allocated peak never exceeded the plan by more than 0.25% (8B 8K; elsewhere it is
    1-8% under), the allocator reserves ~1-1.4 GiB over the allocated peak where memory is tight, and a run that
    did outgrow the device allocated 99.6% of the free memory before failing: 2% of an H200's free memory (2.8 GiB)
    covers that. 3% refused the fastest 8B 4K configuration, which ran 1.14x faster with 4.7 GiB to spare (reserved
    peak 134.0 of 138.7 GiB free). On a small GPU that ~1.4 GiB is a larger share: raise `device_margin` there. The
    host margin guards against the OOM killer (the host planner is within 1%, but other processes share the host).
    """

    seq_len: Optional[int] = None
    micro_batch: int = 1
    device_margin: float = 0.02
    host_margin: float = 0.10
    free_memory: Any = None
    tiled_mlp: Optional[bool] = None
    tiled_logits_loss: Optional[bool] = None
    activation_checkpointing: Optional[bool] = None
    offload_activations: Optional[bool] = None
    checkpoint_interval: Optional[int] = None
    keep_attention_outputs: Optional[bool] = None
    keep_matmul_outputs: Optional[bool] = None
    keep_token_mixer_outputs: Optional[bool] = None
    # None: chosen (every layer, or as many left un-checkpointed as fit: `_partial_candidates`); set: kept as set
    checkpoint_layers: Any = None
    low_memory_norms: Optional[bool] = None
    offload_optimizer: Optional[float] = None
    sub_group_size: Optional[int] = None
    mlp_tile_tokens: int = 8192
    logits_tile_tokens: int = 4096
    # On by default: the planner counts allocated bytes, and at long lengths the caching allocator's fragmentation
    # is what breaks the fit (8B shape at 128K on the H200: out of memory at 130.6 GiB allocated, 6.4 GiB reserved
    # but unallocated, against a predicted 133.6 GiB peak; benchmarks/results/2026-12-02-h200-memory-auto/).
    expandable_segments: bool = True
    # None: on where the layout allows it (CUDA with Triton, and a model whose norms or gated MLPs it recognises):
    # it keeps less for backward (the planner counts it) and its measured gain is in the step-time model.
    fused_elementwise: Optional[bool] = None
    fused_backend: str = "inductor"
    # Training steps timed after the first (warm-up) one to confirm the prediction: their step time and device peak
    # are logged against the predicted ones, with a warning where the peak exceeds the plan (`StepProbe`); 0: off.
    confirm_steps: int = 3

    def __post_init__(self) -> None:
        if self.seq_len is not None and int(self.seq_len) < 1:
            raise ValueError(f"memory auto: seq_len must be a positive number of tokens, got {self.seq_len}")
        if not (0 <= self.device_margin < 1 and 0 <= self.host_margin < 1):
            raise ValueError("memory auto: device_margin and host_margin are fractions in [0, 1)")
        if self.offload_optimizer is not None and not 0 <= self.offload_optimizer <= 1:
            raise ValueError(f"memory auto: offload_optimizer is a fraction in [0, 1], got {self.offload_optimizer}")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 1:
            raise ValueError(f"memory auto: checkpoint_interval must be >= 1, got {self.checkpoint_interval}")
        if int(self.confirm_steps) < 0:
            raise ValueError(f"memory auto: confirm_steps is a number of steps (0: off), got {self.confirm_steps}")

    def pinned(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (*FEATURES, "checkpoint_layers", "offload_optimizer",
                                                       "sub_group_size") if getattr(self, name) is not None}

    def free_bytes(self, device, local_ranks: int = 1) -> tuple[float, float]:
        source = self.free_memory
        if source is None:
            return measure_free_memory(device, local_ranks)
        device_bytes, host_bytes = source(device) if callable(source) else source
        return float(device_bytes), float(host_bytes)


def coerce_memory(memory: Union[str, MemoryOptions, AutoMemory, Mapping[str, Any], None]) -> Union[MemoryOptions,
                                                                                                   AutoMemory]:
    """The strategy's `memory=` argument: `"auto"`, an `AutoMemory`, a mapping with `auto: true` (its other keys are
    `AutoMemory` fields), or what `MemoryOptions.coerce` takes."""
    if isinstance(memory, AutoMemory):
        return memory
    if memory == "auto":
        return AutoMemory()
    if isinstance(memory, Mapping) and "auto" in memory:
        rest = {key: value for key, value in memory.items() if key != "auto"}
        if not memory["auto"]:
            return MemoryOptions.coerce(rest)
        known = {f.name for f in dataclasses.fields(AutoMemory)}
        unknown = set(rest) - known
        if unknown:
            raise ValueError(f"Unknown memory auto field(s) {sorted(unknown)}; valid: {sorted(known)}")
        if isinstance(rest.get("free_memory"), Sequence):  # a list from Hydra/JSON
            rest["free_memory"] = tuple(rest["free_memory"])
        return AutoMemory(**rest)
    if isinstance(memory, str):
        raise ValueError(f"memory must be 'auto', MemoryOptions or a mapping of its fields, got {memory!r}")
    return MemoryOptions.coerce(memory)


def measure_free_memory(device, local_ranks: int = 1) -> tuple[float, float]:
    """(device bytes, host bytes) this rank can use: what is free plus what this process holds already, which the
    planner counts (the model built in `configure_model`, ZeRO-3's partitions; the process's resident memory).
    On CPU both are the host's available memory over the node's ranks."""
    import torch

    host = _available_host_bytes() / max(1, local_ranks)
    if getattr(device, "type", "cpu") == "cuda":
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
        return float(free), host + _resident_bytes()
    return host, host


def _proc_bytes(path: str, field: str) -> float | None:
    """A `<field>: <n> kB` line of a /proc file in bytes; None where there is no such file or line."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _resident_bytes() -> float:
    return _proc_bytes("/proc/self/status", "VmRSS") or 0.0


def _available_host_bytes() -> float:
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    import os

    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


# What `sdpa_kernel_priority="auto"` may pick, from the least to the most demanding: every rank takes the least any
# rank can run (`decide` agrees on it with one all-reduce).
_AUTO_PRIORITIES: tuple[Optional[tuple[str, ...]], ...] = (None, ("cudnn",), (FA4, "cudnn"))


def auto_sdpa_kernel(device) -> Optional[tuple[str, ...]]:
    """`sdpa_kernel_priority="auto"`: on Hopper, FlashAttention-4's CuTe kernels first where installed, then cuDNN
    (measured on the H200, causal GQA forward + backward at 128K: FA4 515 TFLOP/s, cuDNN 455, flash 276:
    `benchmarks/results/2026-12-04-h200-attention-kernels/`); torch's own order on other GPUs (not measured) and on
    CPU (where the priority is ignored)."""
    import torch

    if getattr(device, "type", "cpu") != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    if torch.cuda.get_device_capability(device)[0] != 9:
        return None
    return (FA4, "cudnn") if fa4_installed() else ("cudnn",)


def device_speeds(device) -> DeviceSpeeds:
    """The step-time model's constants for `device`: the measured card's own (`step_time.KNOWN_DEVICES`: the H200,
    the H100), else the nearest measured card's, said in one log line; on a CPU device the H200's (its predictions
    there are not timings of the CPU: `Confirmation.report`)."""
    if getattr(device, "type", "cpu") != "cuda":
        return H200
    props = torch.cuda.get_device_properties(device)
    speeds, note = speeds_for(torch.cuda.get_device_name(device), (props.major, props.minor), props.total_memory,
                              props.multi_processor_count)
    if note:
        _log.info(note)
    return speeds


def _configured_offload(run: RunSpec) -> Optional[tuple[float, int]]:
    """A DeepSpeed config that already offloads the optimizer: its (share on the host, sub-group size), kept."""
    if not run.offloads_optimizer:
        return None
    return run.optimizer_share_on_host, run.sub_group_size or LIGHTNING_SUB_GROUP_SIZE


@dataclass(frozen=True)
class Budget:
    device: float
    host: float
    shared: bool  # the device memory is the host memory (CPU)

    def fits(self, plan: MemoryPlan) -> bool:
        if self.shared:
            return plan.gpu_total + plan.host_total <= self.device
        return plan.gpu_total <= self.device and plan.host_total <= self.host


@dataclass
class Candidate:
    setup: TrainingSetup
    plan: MemoryPlan
    time: StepTime

    @property
    def key(self) -> tuple:
        m = self.setup.memory
        return self.time.total, sum(bool(getattr(m, name)) for name in FEATURES if name != "checkpoint_interval")


@dataclass
class AutoChoice:
    """The decision: the options to apply, DeepSpeed's optimizer offload, the SDPA kernel, and why."""

    shape: ModelShape
    run: RunSpec
    kernel: Optional[str]  # the SDPA kernel attention runs with (None: torch's order, flash on Hopper)
    budget: Budget
    best: Candidate
    reasons: dict[str, str]
    runner_up: Optional[Candidate]
    free: tuple[float, float]
    speeds: DeviceSpeeds = H200  # the step-time model's constants the times were predicted with

    @property
    def memory(self) -> MemoryOptions:
        return self.best.setup.memory

    @property
    def offload_optimizer(self) -> float:
        return self.best.setup.offload_optimizer

    @property
    def sub_group_size(self) -> int:
        return self.best.setup.sub_group_size

    def as_dict(self) -> dict[str, Any]:
        return {"memory": dataclasses.asdict(self.memory), "offload_optimizer": self.offload_optimizer,
                "sub_group_size": self.sub_group_size, "kernel": self.kernel,
                "predicted_step_s": self.best.time.total, "predicted_device_bytes": self.best.plan.gpu_total,
                "predicted_host_bytes": self.best.plan.host_total, "speeds": self.speeds.name,
                "predicted_terms_s": dict(self.best.time.terms), **self.recompute_plan()}

    def recompute_plan(self) -> dict[str, Any]:
        """Which decoder layers are checkpointed, and what their recompute replays instead of running again."""
        m = self.memory
        layers = which(self.shape.num_layers, m.checkpoint_layers) if m.activation_checkpointing else ()
        return {"checkpointed_layers": [index for index, on in enumerate(layers) if on],
                "kept_in_recompute": [name for name in ("keep_attention_outputs", "keep_matmul_outputs",
                                                        "keep_token_mixer_outputs") if getattr(m, name)]}

    def report(self) -> str:
        s, best = self.best.setup, self.best
        lines = [f'lightning_ulysses memory="auto" (decided once, the same on every rank): {self.shape.name}, seq'
                 f" {s.seq_len} × micro-batch {s.micro_batch}, sp {s.sequence_parallel_size} × dp"
                 f" {s.data_parallel_size}, {_sharding(s)}, {8 * s.compute_bytes}-bit compute",
                 f"  free per rank (least over ranks): device {self.free[0] / GIB:.1f} GiB, host {self.free[1] / GIB:.1f}"
                 f" GiB; usable after the margins: device {self.budget.device / GIB:.1f} GiB"
                 + ("" if self.budget.shared else f", host {self.budget.host / GIB:.1f} GiB")]
        for name, reason in self.reasons.items():
            value = getattr(s.memory, name) if hasattr(s.memory, name) else getattr(s, name)
            shown = (f"{value:.0%}" if name == "offload_optimizer" else "all" if name == "checkpoint_layers"
                     and value is None else "some" if name == "checkpoint_layers" else str(value))
            lines.append(f"  {name:<26}{shown:<8}{reason}")
        lines.append(f"  {'sdpa kernel':<26}{self.kernel or 'torch':<8}"
                     + {"cudnn": "cuDNN first (Hopper, measured fastest)",
                        FA4: "FlashAttention-4 first, then cuDNN (Hopper, measured fastest)"}.get(
                         self.kernel, "torch's own order"))
        tokens = s.seq_len * s.micro_batch
        lines.append(f"  predicted: device peak {best.plan.gpu_total / GIB:.2f} GiB, host peak"
                     f" {best.plan.host_total / GIB:.2f} GiB, step {best.time.total:.3f} s"
                     f" ({tokens * s.data_parallel_size / best.time.total:,.0f} tokens/s)")
        lines.append(f"  step time by term ({self.speeds.name}'s speeds): {best.time.summary()}")
        if self.runner_up is not None:
            lines.append(f"  runner-up: {_describe(self.runner_up.setup)}, step {self.runner_up.time.total:.3f} s"
                         f" ({self.runner_up.time.total / best.time.total - 1:+.1%})")
        return "\n".join(lines)


def _sharding(setup: TrainingSetup) -> str:
    return "FSDP2" if setup.backend == "fsdp2" else f"ZeRO-{setup.zero_stage}"


def _describe(setup: TrainingSetup) -> str:
    m = setup.memory
    names = [name for name in FEATURES if name != "checkpoint_interval" and getattr(m, name)]
    if m.checkpoint_layers is not None:
        names.append(f"checkpoint_layers={m.checkpoint_layers}")
    if m.checkpoint_interval > 1:
        names.append(f"checkpoint_interval={m.checkpoint_interval}")
    if setup.offload_optimizer:
        names.append(f"optimizer {setup.offload_optimizer:.0%} on the host")
    return ", ".join(names) or "no features"


def _option_sets(request: AutoMemory, run: RunSpec, fused_elementwise: bool,
                 refused: frozenset = frozenset()) -> list[MemoryOptions]:
    """Every valid combination of the features not pinned (pinned ones as set; those the model refuses, off),
    fewest features first."""
    def values(name: str, free: tuple) -> tuple:
        pinned = getattr(request, name)
        return (pinned,) if pinned is not None else (False,) if name in refused else free

    host = (False, True) if run.on_cuda else (False,)
    # Not an axis: where allowed it is faster and keeps less for backward (planner, measured), so it is simply on.
    fused = request.fused_elementwise if request.fused_elementwise is not None else fused_elementwise
    axes = {"tiled_logits_loss": values("tiled_logits_loss", (False, True)),
            "low_memory_norms": values("low_memory_norms", (False, True)),
            "tiled_mlp": values("tiled_mlp", (False, True)),
            "activation_checkpointing": values("activation_checkpointing", (False, True)),
            "keep_attention_outputs": values("keep_attention_outputs", (False, True)),
            "keep_matmul_outputs": values("keep_matmul_outputs", (False, True)),
            "keep_token_mixer_outputs": values("keep_token_mixer_outputs", (False, True)),
            "checkpoint_layers": (request.checkpoint_layers,),
            "offload_activations": values("offload_activations", host),
            "checkpoint_interval": values("checkpoint_interval", INTERVALS)}
    options = []
    for combination in itertools.product(*axes.values()):
        try:
            options.append(MemoryOptions(mlp_tile_tokens=request.mlp_tile_tokens,
                                         logits_tile_tokens=request.logits_tile_tokens,
                                         expandable_segments=request.expandable_segments,
                                         fused_elementwise=fused,
                                         fused_backend=request.fused_backend,
                                         **dict(zip(axes, combination))))
        except ValueError:  # e.g. offload or an interval without checkpointing
            continue
    return options


def _offload_choices(request: AutoMemory, run: RunSpec, shape: ModelShape) -> list[tuple[float, int]]:
    """(optimizer share on the host, sub-group size) in increasing share: DeepSpeed's partial offload needs ZeRO-3
    and is cut by sub-group count, so a partial share comes with `SUB_GROUPS` sub-groups. FSDP2 keeps the optimizer on
    the device (its CPUOffloadPolicy moves everything or nothing: `RunSpec._check_fsdp2`) and has no sub-groups."""
    if run.fsdp2:
        return [(0.0, LIGHTNING_SUB_GROUP_SIZE)]
    configured = _configured_offload(run)
    if configured is not None:
        return [configured]
    ranks = run.world_size
    local = sum(math.ceil(numel / ranks) for numel in shape.parameter_numels())
    cut = request.sub_group_size or min(10**9, max(1, math.ceil(local / SUB_GROUPS)))
    if not run.on_cuda:
        shares = (0.0,)
    elif request.offload_optimizer is not None:
        shares = (request.offload_optimizer,)
    elif run.zero3:
        shares = tuple(step / RATIO_STEPS for step in range(RATIO_STEPS + 1))
    else:
        shares = (0.0, 1.0)
    if not run.on_cuda and request.sub_group_size is None:
        cut = run.sub_group_size or LIGHTNING_SUB_GROUP_SIZE  # nothing offloaded: the config's sub-groups stay
    return [(share, cut) for share in shares]


def _setup(request: AutoMemory, run: RunSpec, options: MemoryOptions, share: float, cut: int,
           seq_len: Optional[int] = None) -> TrainingSetup:
    return TrainingSetup.of_run(run, seq_len or request.seq_len, micro_batch=request.micro_batch, memory=options,
                                offload_optimizer=share, sub_group_size=cut,
                                host_process_bytes=TrainingSetup.host_process_bytes if run.on_cuda else 0)


def _best_share(shape, request, run, kernel, budget, options, offloads,
                speeds: DeviceSpeeds = H200) -> Optional[Candidate]:
    """The smallest optimizer share on the host with which `options` fit (more share: more CPU Adam time)."""
    for share, cut in offloads:
        setup = _setup(request, run, options, share, cut)
        plan = plan_memory(shape, setup)
        if budget.fits(plan):
            return Candidate(setup, plan, predict_step_time(shape, setup, kernel, speeds,
                                                            host_beside_device=run.on_cuda))
    return None


def choose(shape: ModelShape, request: AutoMemory, run: RunSpec, free: tuple[float, float], *,
           kernel: Optional[str] = None, fused_elementwise: bool = False,
           refused: frozenset = frozenset(), speeds: DeviceSpeeds = H200) -> AutoChoice:
    """The fastest predicted configuration of `run` that fits `free` (device, host bytes per rank) less the margins;
    raises `ValueError` naming the longest length that would fit, and what to change, when none does. `kernel`: the
    SDPA kernel attention runs with (None: torch's order); `fused_elementwise`: whether that feature may be switched
    on (CUDA with Triton, and a model it recognises parts of); `refused`: the features the model refuses
    (`memory.features_refused_by`), left off; `speeds`: the step-time model's constants for the device
    (`step_time.speeds_for`; `decide` picks them from the device it runs on)."""
    if request.seq_len is None:
        raise ValueError('memory="auto" needs the training length: memory={"auto": True, "seq_len": N} (and'
                         ' "micro_batch" if it is not 1); the recipes fill both in from data.seq_len and data.batch_size.')
    budget = Budget(free[0] * (1 - request.device_margin), free[1] * (1 - request.host_margin), not run.on_cuda)
    offloads = _offload_choices(request, run, shape)
    refused = refused | selective_refusals(shape)
    option_sets = _option_sets(request, run, fused_elementwise, refused)
    fitting = [c for c in (_best_share(shape, request, run, kernel, budget, options, offloads, speeds)
                           for options in option_sets) if c is not None]
    fitting += _partial_candidates(shape, request, run, kernel, budget, option_sets, offloads, speeds)
    if not fitting:
        raise ValueError(_nothing_fits(shape, request, run, fused_elementwise, budget, offloads, refused))
    ranked = sorted(fitting, key=lambda c: c.key)  # stable: candidates in enumeration order on equal keys
    best = ranked[0]
    reasons = _reasons(shape, request, run, kernel, fused_elementwise, budget, offloads, best, refused, speeds)
    return AutoChoice(shape, run, kernel, budget, best, reasons, ranked[1] if len(ranked) > 1 else None, free,
                      speeds)


def _reasons(shape, request, run, kernel, fused_elementwise, budget, offloads, best: Candidate,
             refused: frozenset = frozenset(), speeds: DeviceSpeeds = H200) -> dict[str, str]:
    """Per feature: pinned, refused by the model, or what switching it alone would do (not fit, or its time)."""
    pinned, reasons = request.pinned(), {}
    for name in FEATURES:
        value = getattr(best.setup.memory, name)
        if name in pinned:
            reasons[name] = "set by you"
            continue
        if name in refused:
            reasons[name] = "the model's layers do not take it"
            continue
        other = 1 if name == "checkpoint_interval" and value > 1 else (2 if name == "checkpoint_interval" else not value)
        change = {name: other}
        if name == "activation_checkpointing" and value:  # off, with what only tunes it
            change.update(keep_attention_outputs=False, offload_activations=False, checkpoint_interval=1,
                          keep_matmul_outputs=False, keep_token_mixer_outputs=False, checkpoint_layers=None)
        if name == "checkpoint_interval" and best.setup.memory.checkpoint_layers is not None:
            change.update(checkpoint_layers=None)  # (sparser stretches of every layer)
        try:
            options = dataclasses.replace(best.setup.memory, **change)
        except ValueError:
            reasons[name] = "needs layer checkpointing"
            continue
        if name in ("offload_activations",) and not run.on_cuda:
            reasons[name] = "no host offload on CPU"
            continue
        alternative = _best_share(shape, request, run, kernel, budget, options, offloads, speeds)
        label = f"{name}={other}"
        if alternative is None:
            reasons[name] = f"with {label} nothing fits"
        else:
            delta = alternative.time.total - best.time.total
            reasons[name] = (f"with {label}: {delta:+.3f} s per step" + (" (and fewer features win ties)"
                                                                         if abs(delta) < 1e-9 else ""))
    reasons["checkpoint_layers"] = _checkpoint_layers_reason(shape, request, run, kernel, budget, offloads, best,
                                                             speeds)
    if request.fused_elementwise is not None:
        reasons["fused_elementwise"] = "set by you"
    elif not fused_elementwise:
        reasons["fused_elementwise"] = "needs CUDA with Triton and Llama-style norms or gated MLPs"
    else:
        off = _best_share(shape, request, run, kernel, budget,
                          dataclasses.replace(best.setup.memory, fused_elementwise=False), offloads, speeds)
        reasons["fused_elementwise"] = (f"with fused_elementwise=False: {off.time.total - best.time.total:+.3f} s per"
                                        " step" if off else "with fused_elementwise=False nothing fits")
    if run.fsdp2:
        reasons["offload_optimizer"] = "FSDP2: the optimizer stays on the device"
    elif "offload_optimizer" in pinned or run.offloads_optimizer:
        reasons["offload_optimizer"] = "set by you"
    elif not run.on_cuda:
        reasons["offload_optimizer"] = "no host offload on CPU"
    else:
        reasons["offload_optimizer"] = ("the smallest share that fits" if best.setup.offload_optimizer
                                        else "all on the device")
    return reasons


def longest_fit(shape: ModelShape, request: AutoMemory, run: RunSpec, free: tuple[float, float], *,
                fused_elementwise: bool = False, refused: frozenset = frozenset()) -> tuple[int, Optional[TrainingSetup]]:
    """The longest length `memory="auto"` can train in `free` (device, host bytes per rank, less the margins), with
    the most memory-saving configuration it may choose, and that configuration; `(0, None)` when not even the
    shortest length fits. A multiple of 64 tokens × the SP size (`request.seq_len` is not needed)."""
    budget = Budget(free[0] * (1 - request.device_margin), free[1] * (1 - request.host_margin), not run.on_cuda)
    return _longest_fit(shape, request, run, fused_elementwise, budget, _offload_choices(request, run, shape),
                        refused | selective_refusals(shape))


def _longest_fit(shape, request, run, fused_elementwise, budget, offloads,
                 refused: frozenset = frozenset()) -> tuple[int, Optional[TrainingSetup]]:
    def saving(o: MemoryOptions) -> tuple:
        return (o.activation_checkpointing, o.checkpoint_interval, o.tiled_mlp, o.tiled_logits_loss,
                o.low_memory_norms, not o.keep_attention_outputs, not o.keep_matmul_outputs,
                not o.keep_token_mixer_outputs)

    options = _option_sets(request, run, fused_elementwise, refused)
    most = max(map(saving, options))
    most_saving = [o for o in options if saving(o) == most]  # with and without host offload of the kept inputs
    longest, how = 0, None
    short = request.seq_len is not None and request.seq_len < 64 * run.sequence_parallel_size
    for option, (share, cut) in itertools.product(most_saving, offloads):  # every share: the limit `choose` has
        setup = _setup(request, run, option, share, cut, seq_len=1)
        seq = _longest(shape, setup, budget, 1 if short else 64)
        if seq > longest:
            longest, how = seq, setup
    return longest, (None if how is None else dataclasses.replace(how, seq_len=longest))


def _nothing_fits(shape, request, run, fused_elementwise, budget, offloads, refused: frozenset = frozenset()) -> str:
    """The longest length the most memory-saving allowed configurations fit, and what to change."""
    longest, how = _longest_fit(shape, request, run, fused_elementwise, budget, offloads, refused)
    sharding = "FSDP2" if run.fsdp2 else f"ZeRO-{run.zero_stage}"
    where = (f"{shape.name} at {request.seq_len} tokens × micro-batch {request.micro_batch} on sp"
             f" {run.sequence_parallel_size} × dp {run.data_parallel_size}, {sharding}, with"
             f" {budget.device / GIB:.2f} GiB of device memory" + ("" if budget.shared else
                                                                   f" and {budget.host / GIB:.2f} GiB of host memory")
             + " per rank (free, less the margins)")
    pins = request.pinned()
    unpin = f"; or unpin {sorted(pins)}" if pins else ""
    # FSDP2 has no optimizer on the host; its plan counts torch AdamW's fp32 temporary of the optimizer step.
    fsdp2 = (" On FSDP2 the optimizer stays on the device (an optimizer step with torch's foreach AdamW also makes"
             " an fp32 temporary of its local state, which the plan counts): strategy='ulysses' (DeepSpeed) can put"
             " a share of it on the host.") if run.fsdp2 else ""
    if longest == 0:
        return (f'memory="auto": nothing fits {where}, not even the shortest length: the model states alone are'
                f" too large. Shard them over more ranks ({'FSDP2' if run.fsdp2 else 'ZeRO-3'} over more GPUs), or free"
                f" memory{unpin}.{fsdp2}")
    return (f'memory="auto": nothing fits {where}. The longest length that fits is {longest} tokens (with'
            f" {_describe(how)}). To train {request.seq_len} tokens: raise sequence_parallel_size (each rank holds"
            f" seq/SP tokens), use more GPUs, or free memory{unpin}; or train at most {longest} tokens.{fsdp2}")


def _longest(shape: ModelShape, setup: TrainingSetup, budget: Budget, multiple: int) -> int:
    """The longest `seq_len` (a multiple of `multiple` × the SP size) whose plan fits `budget`; 0 if none does."""
    step = multiple * setup.sequence_parallel_size

    def fits(multiple: int) -> bool:
        return budget.fits(plan_memory(shape, dataclasses.replace(setup, seq_len=multiple * step)))

    if not fits(1):
        return 0
    low, high = 1, 2
    while high < 1 << 30 and fits(high):
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high): memory grows with the length
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step


def shape_of(models: Sequence[Any]) -> ModelShape:
    """The planner's shape of the module's largest model (Hugging Face Llama-style or hybrid config, or a
    `NativeCausalLM`)."""
    shapes = []
    for model in models:
        try:
            if isinstance(model, NativeCausalLM):
                shapes.append(model.planner_shape())
            else:
                config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
                shapes.append(ModelShape.from_hf_config(config, name=type(model).__name__))
        except (AttributeError, TypeError) as error:
            raise ValueError(f'memory="auto" plans Llama-style configs, the hybrids `layer_kinds` declares and the'
                             f" native GPT; {type(model).__name__} has no {error}. Set the memory features by hand"
                             " (memory={...}).") from error
    if not shapes:
        raise ValueError('memory="auto" needs a Hugging Face causal LM or a native GPT in the module (it plans their'
                         " shape); set the memory features by hand for other models.")
    return max(shapes, key=lambda shape: shape.num_parameters)


@dataclass(frozen=True)
class Confirmation:
    """What the first training steps measured, against what `memory="auto"` predicted for them."""

    steps: int
    step_s: float  # median seconds per optimizer step over the timed steps, on the slowest rank
    device_peak_bytes: Optional[float]  # the allocator's peak over the timed steps on the fullest rank (CUDA only)
    choice: AutoChoice

    @property
    def over_plan_bytes(self) -> float:
        """How far the measured device peak exceeds the planned one (0 if it does not, or on CPU)."""
        if self.device_peak_bytes is None:
            return 0.0
        return max(0.0, self.device_peak_bytes - self.choice.best.plan.gpu_total)

    @property
    def exceeds_plan(self) -> bool:
        """More than 1% over the planned device peak (the planner over-predicts long rows by 2-3%: measured)."""
        return self.over_plan_bytes > 0.01 * self.choice.best.plan.gpu_total

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "step_s": self.step_s, "device_peak_bytes": self.device_peak_bytes,
                "over_plan_bytes": self.over_plan_bytes}

    def report(self) -> str:
        best = self.choice.best
        line = f'lightning_ulysses memory="auto" confirmed over {self.steps} steps: step {self.step_s:.3f} s'
        if self.choice.run.on_cuda:
            line += f" (predicted {best.time.total:.3f} s, {self.step_s / best.time.total - 1:+.0%})"
        else:  # the step-time model's rates are a GPU's
            line += " (no prediction on CPU)"
        if self.device_peak_bytes is not None:
            line += (f", device peak {self.device_peak_bytes / GIB:.2f} GiB (planned {best.plan.gpu_total / GIB:.2f},"
                     f" usable {self.choice.budget.device / GIB:.2f})")
        if self.exceeds_plan:
            line += (f". The device peak is {self.over_plan_bytes / GIB:.2f} GiB over the plan: the margin is being"
                     " used up, and a longer row or a fuller step may run out of memory. Pin a memory-saving feature"
                     ' (e.g. memory={"auto": True, "activation_checkpointing": True, ...}) or raise device_margin, and'
                     " report the block above (the planner under-predicted this model)")
        return line


class StepProbe:
    """Times `steps` optimizer steps after the first one (which compiles, allocates the optimizer's states and
    settles the allocator) at the batch boundaries, from inside the strategy's `on_train_batch_start`; then one
    all-reduce (the maximum over ranks) makes the result the same on every rank. Nothing runs besides the training
    itself, so it costs no time beyond `steps + 1` CUDA synchronisations; every rank reaches the all-reduce at the
    same batch, as it trains the same number of batches."""

    def __init__(self, choice: AutoChoice, steps: int, accumulate: int = 1) -> None:
        self.choice, self.steps, self.accumulate = choice, steps, accumulate
        self.batches = 0
        self.starts: list[float] = []

    def on_batch_start(self, device: torch.device, reduce: bool) -> Optional[Confirmation]:
        """Call at every training batch's start; returns the confirmation once, at the batch after the last timed
        step (`reduce`: all-reduce over the default group)."""
        first, last = self.accumulate, self.accumulate * (self.steps + 1)  # the timed steps' first batches
        batch, self.batches = self.batches, self.batches + 1
        if batch < first or batch > last or (batch - first) % self.accumulate:
            return None
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        self.starts.append(time.perf_counter())
        if cuda and batch == first:
            torch.cuda.reset_peak_memory_stats(device)
        if batch < last:
            return None
        step_s = statistics.median(b - a for a, b in zip(self.starts, self.starts[1:]))
        peak = float(torch.cuda.max_memory_allocated(device)) if cuda else -1.0
        measured = torch.tensor([step_s, peak], dtype=torch.float64, device=device)
        if reduce:
            torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
        step_s, peak = measured.tolist()
        return Confirmation(self.steps, step_s, peak if peak >= 0 else None, self.choice)


def decide(request: Union[MemoryOptions, AutoMemory], run: RunSpec, models: Sequence[Any], *,
           kernel_priority: Union[str, tuple[str, ...], None], local_ranks: int,
           reduce: bool) -> tuple[Optional[tuple[str, ...]], Optional[AutoChoice]]:
    """`memory="auto"` and `sdpa_kernel_priority="auto"` for `run`, once per run, before the memory features are
    applied and DeepSpeed starts: (the SDPA kernel priority — `kernel_priority` as given unless it is "auto" —, or
    None for torch's order; the memory choice, or None when memory is not "auto"). Every rank reaches the one
    all-reduce (`reduce`: over the default group) and then computes the same choice from the same inputs: the least
    free memory over all ranks, the largest of `models`' shapes from its config (also under ZeRO-3, where its
    parameters are already partitioned), and the run; a refusal is raised on every rank alike. `local_ranks`: the
    ranks on this node, which share its host memory."""
    memory_auto, kernel_auto = isinstance(request, AutoMemory), kernel_priority == "auto"
    device = run.device
    device_free, host_free = request.free_bytes(device, local_ranks) if memory_auto else (0, 0)
    level = float(_AUTO_PRIORITIES.index(auto_sdpa_kernel(device)) if kernel_auto else 0)
    # the device's step-time constants, by their place in `KNOWN_DEVICES`: every rank takes the same (the least)
    known = list(KNOWN_DEVICES)
    speeds_index = float(known.index(device_speeds(device).name)) if memory_auto and run.on_cuda else 0.0
    agreed = torch.tensor([device_free, host_free, level, speeds_index], dtype=torch.float64, device=device)
    if reduce:
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    device_free, host_free, level, speeds_index = agreed.tolist()
    priority = _AUTO_PRIORITIES[int(level)] if kernel_auto else kernel_priority
    if not memory_auto:
        return priority, None
    # inductor needs Triton for GPU code; the model must have parts `fused_elementwise` recognises
    fusable = (run.on_cuda and importlib.util.find_spec("triton") is not None
               and all(map(fused_elementwise_applies, models)))
    refused = frozenset().union(*map(features_refused_by, models))
    return priority, choose(shape_of(models), request, run, (device_free, host_free),
                            kernel=(priority or (None,))[0] if run.on_cuda else None, fused_elementwise=fusable,
                            refused=refused, speeds=KNOWN_DEVICES[known[int(speeds_index)]][0])


class AutoDecisions:
    """`memory="auto"` and `sdpa_kernel_priority="auto"` of one strategy: decided once (`decide`, in the first run's
    setup: then fixed for every later run of the strategy, fit after fit) and confirmed by that run's first training
    steps (`confirm`). Until decided, `memory` is the request (`MemoryOptions`, or `AutoMemory`) and
    `kernel_priority` torch's order (None) for "auto"."""

    def __init__(self, memory: Union[MemoryOptions, AutoMemory],
                 kernel_priority: Union[str, tuple[str, ...], None]) -> None:
        self.memory = memory
        self.requested_kernel_priority = kernel_priority
        # "auto" is decided in `decide`; until then (and on CPU, where torch ignores it) torch's order
        self.kernel_priority = None if kernel_priority == "auto" else kernel_priority
        self.choice: Optional[AutoChoice] = None
        # What the first training steps measured against the choice (`AutoMemory.confirm_steps`), once known.
        self.confirmation: Optional[Confirmation] = None
        self._probe: Optional[StepProbe] = None  # until it has confirmed

    def decide(self, run: RunSpec, models: Sequence[Any], *, on_cuda: bool, local_ranks: int, reduce: bool,
               accumulate: int) -> Optional[RunSpec]:
        """Decide what is "auto" for `run` (`decide` above: every rank alike) unless already decided; returns `run`
        with the optimizer offload chosen, which the caller writes into the DeepSpeed config, or None when no memory
        choice was made. `models`: the models the memory engine serves; `accumulate`: micro-batches per optimizer
        step (the steps `confirm` times)."""
        request = self.memory
        kernel_auto = self.requested_kernel_priority == "auto"
        if not (isinstance(request, AutoMemory) or (kernel_auto and on_cuda)) or self.choice is not None:
            return None
        self.kernel_priority, choice = decide(
            request, run, models, kernel_priority=self.requested_kernel_priority if kernel_auto
            else self.kernel_priority, local_ranks=local_ranks, reduce=reduce)
        if choice is None:
            return None
        self.memory, self.choice = choice.memory, choice
        if request.confirm_steps:
            self._probe = StepProbe(choice, int(request.confirm_steps), accumulate)
        return run.with_memory_choice(choice.offload_optimizer, choice.sub_group_size)

    def confirm(self, device: torch.device, reduce: bool) -> Optional[Confirmation]:
        """At every training batch's start: the confirmation of the choice, once, when its timed steps are done."""
        if self._probe is None:
            return None
        confirmation = self._probe.on_batch_start(device, reduce)
        if confirmation is not None:
            self.confirmation, self._probe = confirmation, None
        return confirmation


def check_optimizer(choice: Optional[AutoChoice], optimizer: Any) -> None:
    """DeepSpeed runs its optimizer offload with its own CPU Adam: a choice that offloads needs it from
    `configure_optimizers`."""
    if choice is None or not choice.offload_optimizer or optimizer is None:
        return
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):  # DeepSpeed's offload runs CPU Adam on the host share
        raise ValueError(
            f'memory="auto" moves {choice.offload_optimizer:.0%} of the optimizer to the host, where DeepSpeed'
            f" needs deepspeed.ops.adam.DeepSpeedCPUAdam, but configure_optimizers returned"
            f" {type(optimizer).__name__}. Return DeepSpeedCPUAdam, or keep the optimizer on the device:"
            ' memory={"auto": True, "offload_optimizer": 0.0, ...}.')


# -- partial layer checkpointing and kept products (`planning/selective.py`) ------------------------------------------


def selective_refusals(shape: ModelShape) -> frozenset[str]:
    """The kept-products options `memory="auto"` leaves off for `shape`: `keep_matmul_outputs` where a part's
    products are not declared (none today: every declared part declares them), `keep_token_mixer_outputs` where no
    token mixer marks its recurrence (no hybrid, or one with neither a Gated DeltaNet nor a Mamba2 mixer). FSDP2 runs
    both as DeepSpeed does (tests/distributed/test_fsdp.py)."""
    parts = [part for layer in shape.layers for part in layer.parts]
    refused = set()
    if any(part.product_bytes is None for part in parts):
        refused.add("keep_matmul_outputs")
    if not any(part.mixer_product_bytes for part in parts):
        refused.add("keep_token_mixer_outputs")
    return frozenset(refused)


def _checkpoint_layers_for(order: list[int], uncheckpointed: int, num_layers: int):
    """`checkpoint_layers` leaving the first `uncheckpointed` layers of `order` out: a count where those are the
    last layers (the first ones checkpointed), else the indices."""
    left_out = set(order[:uncheckpointed])
    kept = [index for index in range(num_layers) if index not in left_out]
    return len(kept) if kept == list(range(len(kept))) else tuple(kept)


def _partial_candidates(shape, request, run, kernel, budget, option_sets, offloads,
                        speeds: DeviceSpeeds = H200) -> list[Candidate]:
    """For each option set that checkpoints every layer one by one (`checkpoint_layers` not pinned), the plans that
    leave as many layers un-checkpointed as fit — at every optimizer share on the host, since more layers kept can
    need a larger share —, the layers taken in `uncheckpoint_order` (most recompute time saved per byte first)."""
    candidates = []
    for options in option_sets:
        if not options.activation_checkpointing or options.checkpoint_interval != 1 or \
                request.checkpoint_layers is not None or options.checkpoint_layers is not None:
            continue
        probe = _setup(request, run, options, 0.0, offloads[0][1])
        costs = layer_costs(shape, probe.compute_bytes, options,
                            _saved_bytes_by_layer(shape, probe.compute_bytes, options))
        order = uncheckpoint_order(costs, layer_recompute_seconds(shape, probe, kernel, speeds))
        uncheckpointed = 0
        for share, cut in offloads:  # the count that fits only grows with the share
            def fits(count: int):
                partial = dataclasses.replace(options, checkpoint_layers=_checkpoint_layers_for(
                    order, count, shape.num_layers))
                setup = _setup(request, run, partial, share, cut)
                plan = plan_memory(shape, setup)
                return (setup, plan) if budget.fits(plan) else None

            while uncheckpointed + 1 < shape.num_layers and fits(uncheckpointed + 1):
                uncheckpointed += 1
            found = fits(uncheckpointed) if uncheckpointed else None
            if found is not None:
                setup, plan = found
                candidates.append(Candidate(setup, plan, predict_step_time(shape, setup, kernel, speeds,
                                                                           host_beside_device=run.on_cuda)))
            if uncheckpointed == shape.num_layers - 1:
                break
    return candidates


def _checkpoint_layers_reason(shape, request, run, kernel, budget, offloads, best: Candidate,
                              speeds: DeviceSpeeds = H200) -> str:
    m = best.setup.memory
    if request.checkpoint_layers is not None:
        return "set by you"
    if not m.activation_checkpointing:
        return "needs layer checkpointing"
    if m.checkpoint_layers is None:
        return "every layer (leaving one out does not fit, or is not faster)"
    every = _best_share(shape, request, run, kernel, budget, dataclasses.replace(m, checkpoint_layers=None), offloads,
                        speeds)
    layers = describe_layers(m.checkpoint_layers, shape.num_layers)
    if every is None:
        return f"{layers}; with every layer checkpointed nothing fits"
    return f"{layers}; with every layer checkpointed: {every.time.total - best.time.total:+.3f} s per step"
