"""Preparing a LightningModule for sequence parallelism: one pipeline of module adapters, one undo.

Each kind of thing the strategy prepares has one `ModuleAdapter`: Hugging Face causal LMs, native
`UlyssesAttention` layers, `LossFunctionHost` models, modules bound to the groups (SP metrics), and the memory
engine's per-model hooks. The pipeline runs in three passes so that nothing is half-prepared:

1. `scan`: every adapter finds its modules (`find`) and reports what the layout must follow (`head_counts`) and how
   the models number rows given no positions (`PositionRule`), before any group exists — the ring size is settled
   from the heads of the models themselves.
2. `check`: every adapter checks its modules against the final layout; a refusal raises here, identical on every
   rank, before any module is touched.
3. `prepare`: every adapter changes its modules and returns the undo of each change; `PreparedModule.restore` runs
   them in reverse.

The strategy only builds the `SequenceParallelRuntime` between passes 1 and 2 and calls the pipeline; per-family
knowledge lives in `lightning_ulysses.adapters`, never here or in the strategy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lightning_ulysses.adapters import PositionRule, position_rule_of
from lightning_ulysses.adapters.native_model import NativeCausalLM
from lightning_ulysses.attention.core import UlyssesAttention
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import find_hf_models, hf_head_counts, prepare_hf_model, validate_hf_model, watch_positions
from lightning_ulysses.memory import MemoryOptions, apply_memory_options, mark_leaf_layers
from lightning_ulysses.parallel.layout import SequenceParallelGroups
from lightning_ulysses.training.loss import LossFunctionHost, SequenceParallelCausalLMLoss, swap_loss_function
from lightning_ulysses.training.metrics import SequenceParallel
from lightning_ulysses.training.moe import (SequenceParallelRouterLoss, exact_router_loss, batch_padding,
                                            validate_router_loss)

Undo = Callable[[], None]


@dataclass(frozen=True)
class SequenceParallelRuntime:
    """What one `setup` decided, handed to every adapter: the final groups (ring size included), the sharder that
    cuts each batch, the slot it publishes the batch's whole rows into, the loss, the all-to-all transport, and
    the options."""

    groups: SequenceParallelGroups
    sharder: SequenceSharder
    batch_rows: BatchRowsSlot
    loss: SequenceParallelCausalLMLoss
    memory: MemoryOptions
    overlap_head_groups: int = 1
    leaf_layers: bool = False  # ZeRO-3 gathers each decoder layer whole (`ZeroLeafLayers`)
    # How the Ulysses all-to-alls move their bytes (the strategy's agreed `exchange`); None: the collective one.
    transport: Any = None

    @property
    def sharded(self) -> bool:
        return self.groups.sequence_parallel_world_size > 1


class ModuleAdapter:
    """One kind of module the strategy prepares. `find` returns its modules in a LightningModule; the rest take
    what `find` returned. Defaults: nothing to report, nothing to check, nothing to change."""

    exchanges_tokens = False  # whether its modules move tokens between shards (some adapter must under SP)

    def find(self, root: torch.nn.Module) -> list[torch.nn.Module]:
        return []

    def head_counts(self, found: list) -> list[tuple[int, int]]:
        return []

    def position_models(self, found: list) -> list[torch.nn.Module]:
        """The models that number positions themselves when a batch has none (their `PositionRule`)."""
        return []

    def check(self, found: list, runtime: SequenceParallelRuntime) -> None:
        pass

    def prepare(self, found: list, runtime: SequenceParallelRuntime) -> list[Undo]:
        return []


class HuggingFaceModels(ModuleAdapter):
    """Causal LMs of transformers: attention switched to Ulysses, the loss swapped, MoE router losses made exact."""

    exchanges_tokens = True

    def __init__(self) -> None:
        self.configs: dict[str, Any] = {}  # module path → the config as the user built it (for save_pretrained)

    def find(self, root):
        self._names = {id(child): name for name, child in root.named_modules()}
        return find_hf_models(root)

    def head_counts(self, found):
        return [counts for counts in map(hf_head_counts, found) if counts is not None]

    def position_models(self, found):
        return found

    def check(self, found, runtime):
        groups = runtime.groups
        for model in found:
            validate_hf_model(model, groups.ulysses_size, groups.ring_size)
            if runtime.sharded:
                validate_router_loss(model)

    def prepare(self, found, runtime):
        groups = runtime.groups
        prepared = [prepare_hf_model(model, groups.ulysses_group, runtime.loss, ring_group=groups.ring_group,
                                     batch_rows=runtime.batch_rows, head_groups=runtime.overlap_head_groups,
                                     transport=runtime.transport)
                    for model in found]
        # The configs as the user built them (preparation swaps in a private copy with Ulysses attention).
        self.configs = {self._names[id(p.model)]: p.original_configs.get(id(p.model), p.model.config) for p in prepared}
        undo = [p.restore for p in prepared]
        if runtime.loss.group is not None:  # MoE load-balancing losses of the whole sequence (moe.py)
            sharder = runtime.sharder
            router_loss = SequenceParallelRouterLoss(
                runtime.loss.group, runtime.loss.gradient_scale,
                batch_padding(runtime.batch_rows, sharder.order, sharder.sequence_parallel_rank))
            undo += [exact_router_loss(model, router_loss) for model in found]
        return undo


class NativeAttention(ModuleAdapter):
    """`UlyssesAttention` layers of the user's own models: the batch's rows, the head-group pipelining and the
    all-to-all transport."""

    exchanges_tokens = True

    def find(self, root):
        return [m for m in root.modules() if isinstance(m, UlyssesAttention)]

    def head_counts(self, found):
        return [(m.num_heads, m.num_key_value_heads) for m in found if m.num_heads is not None]

    def prepare(self, found, runtime):
        undo = []
        for attention in found:
            attention.bind_batch_rows(runtime.batch_rows)
            attention.bind_head_groups(runtime.overlap_head_groups)
            attention.bind_transport(runtime.transport)
            undo += [functools.partial(attention.bind_batch_rows, None),
                     functools.partial(attention.bind_head_groups, None),
                     functools.partial(attention.bind_transport, None)]
        return undo


class GroupBound(ModuleAdapter):
    """Modules that take the groups themselves (`bind_parallel_groups`: SP metrics, `UlyssesAttention`, ...)."""

    def find(self, root):
        return [m for m in root.modules() if callable(getattr(m, "bind_parallel_groups", None))]

    def prepare(self, found, runtime):
        for module in found:
            module.bind_parallel_groups(runtime.groups)
        return [functools.partial(module.bind_parallel_groups, None) for module in found]


class LossHosts(ModuleAdapter):
    """`LossFunctionHost` models (the native GPT): the SP loss, and a check that they are given the batch's
    positions (they number a shard from 0 otherwise, as HF models do)."""

    def find(self, root):
        return [m for m in root.modules() if isinstance(m, LossFunctionHost)]

    def prepare(self, found, runtime):
        undo = [swap_loss_function(host, runtime.loss) for host in found]
        if runtime.sharded:
            groups = runtime.groups
            undo += [watch_positions(host, runtime.batch_rows, groups.ulysses_group, groups.ring_group).remove
                     for host in found]
        return undo


class MemoryEngine(ModuleAdapter):
    """The memory features' per-model hooks (tiled MLP, tiled logits + loss, checkpointing, low-memory norms) on
    every model that has layers to apply them to: HF causal LMs and `NativeCausalLM`s (the example GPT)."""

    def find(self, root):
        return [*find_hf_models(root), *(m for m in root.modules() if isinstance(m, NativeCausalLM))]

    def prepare(self, found, runtime):
        if not runtime.memory.changes_models:
            return []
        return [undo for model in found for undo in apply_memory_options(model, runtime.memory)]


class ZeroLeafLayers(ModuleAdapter):
    """Under ZeRO-3 (`zero3_leaf_layers`), every decoder layer of the models the memory engine serves is a DeepSpeed
    leaf: its parameters are gathered whole around its forward and backward, not submodule by submodule."""

    find = MemoryEngine.find

    def prepare(self, found, runtime):
        if not runtime.leaf_layers:
            return []
        return [undo for model in found for undo in mark_leaf_layers(model, runtime.memory)]


@dataclass
class ModuleScan:
    """What pass 1 found: per adapter, its modules; and what the layout and the sharder must follow."""

    found: list[tuple[ModuleAdapter, list]]
    head_counts: list[tuple[int, int]]
    position_rule: Optional[PositionRule]

    def memory_engine_models(self) -> list:
        """The models the memory engine serves (what `memory="auto"` plans for)."""
        return [model for adapter, models in self.found if isinstance(adapter, MemoryEngine) for model in models]

    def check(self, runtime: SequenceParallelRuntime) -> None:
        for adapter, modules in self.found:
            adapter.check(modules, runtime)

    def prepare(self, runtime: SequenceParallelRuntime) -> "PreparedModule":
        """Prepare every module (all checks first); on a failure midway, what was prepared is undone."""
        self.check(runtime)
        prepared = PreparedModule()
        try:
            for adapter, modules in self.found:
                prepared.undo += adapter.prepare(modules, runtime)
        except BaseException:
            prepared.restore()
            raise
        prepared.hf_configs = next(a.configs for a, _ in self.found if isinstance(a, HuggingFaceModels))
        return prepared


@dataclass
class PreparedModule:
    """The undo of one preparation, and the configs `save_pretrained` needs (module path → config)."""

    undo: list[Undo] = field(default_factory=list)
    hf_configs: dict[str, Any] = field(default_factory=dict)

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo = []


def pipeline() -> list[ModuleAdapter]:
    """The adapters, in the order they prepare (HF models before the modules bound to groups, the memory engine
    last: it wraps the layers as the attention left them)."""
    return [HuggingFaceModels(), GroupBound(), NativeAttention(), LossHosts(), MemoryEngine(), ZeroLeafLayers()]


def scan(root: torch.nn.Module, sequence_parallel_size: int) -> ModuleScan:
    """Pass 1, before any group or collective: find every adapter's modules; refuse a sharded module in which
    nothing would exchange tokens between shards."""
    found = [(adapter, adapter.find(root)) for adapter in pipeline()]
    if sequence_parallel_size > 1 and not any(modules for adapter, modules in found if adapter.exchanges_tokens):
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} but {type(root).__name__} holds no Hugging Face"
            " PreTrainedModel and no lightning_ulysses.UlyssesAttention, so nothing would exchange tokens between"
            " shards. Wrap your attention: UlyssesAttention('sdpa') (a built-in backend; flash_attention_2/3,"
            " flex_attention too) or UlyssesAttention(F.scaled_dot_product_attention) (your own local attention"
            " callable)."
        )
    head_counts = [counts for adapter, modules in found for counts in adapter.head_counts(modules)]
    position_rule = position_rule_of([m for adapter, modules in found for m in adapter.position_models(modules)])
    return ModuleScan(found, head_counts, position_rule)


def bind_for_whole_rows(root: torch.nn.Module, groups: SequenceParallelGroups) -> PreparedModule:
    """Evaluation on whole rows (`sequence_parallel_in_evaluation=False`): every SP rank evaluates the same rows,
    so SP-aware metrics sync over DP only; nothing else is prepared."""
    metrics = [m for m in root.modules() if isinstance(m, SequenceParallel)]
    for metric in metrics:
        metric.bind_parallel_groups(groups, whole_rows=True)
    return PreparedModule(undo=[functools.partial(metric.bind_parallel_groups, None) for metric in metrics])


# Set on an adapter weight whose initial values are known to be peft's: given by `models.lora._initialise_adapter`,
# or whole (not partitioned) when peft initialised it. `check_adapters_initialised` refuses partitioned adapter
# weights without it.
INITIALISED_MARK = "lightning_ulysses_lora_initialised"


def check_adapters_initialised(root: torch.nn.Module) -> None:
    """Refuses LoRA adapter weights in `root` that ZeRO-3 partitioned at creation (`zero.Init`: `configure_model`)
    and none of `models.lora`'s functions initialised: peft's own initialisation of them was a no-op (see
    `models.lora._initialise_adapter`), so they hold random values the user never asked for. Decided from the module
    tree alone (the same on every rank: no collective). A weight that is whole here got peft's own values and is
    marked, so that once DeepSpeed has partitioned it (a model built in `__init__`) a later setup (validate after
    fit) does not refuse it. Nothing to do without peft or without adapters."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return
    unset: dict[str, str] = {}  # adapter name -> one of its weights
    for path, layer in root.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for kind in layer.adapter_layer_names:
            for adapter, part in getattr(layer, kind, {}).items():
                weights = part.named_parameters() if isinstance(part, torch.nn.Module) else [("", part)]
                for weight_name, weight in weights:
                    if getattr(weight, INITIALISED_MARK, False):
                        continue
                    if not hasattr(weight, "ds_id"):
                        setattr(weight, INITIALISED_MARK, True)
                    else:
                        unset.setdefault(adapter, ".".join(filter(None, (path, kind, adapter, weight_name))))
    if unset:
        raise ValueError(
            f"The LoRA adapters {sorted(unset)} were created partitioned by ZeRO-3 (in configure_model, under"
            f" deepspeed.zero.Init) and their initial values were never set ({next(iter(unset.values()))}, ...):"
            " peft initialises an adapter after ZeRO-3 has emptied its tensors, so `B` keeps a random init instead of"
            " zero and the model no longer starts as the pretrained one. Add adapters with"
            " lightning_ulysses.models.lora.add_adapter(peft_model, name, LoraSettings(...)) instead of peft's"
            " peft_model.add_adapter(name, config) (and the first with lightning_ulysses.models.lora.with_lora"
            " instead of get_peft_model): they give peft's values in the partitions.")
