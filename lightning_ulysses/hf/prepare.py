"""`prepare_hf_model`: switch one Hugging Face model to Ulysses attention on a private copy of its config, and
`PreparedHFModel.restore()`, which gives the model back exactly as it was."""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from lightning_ulysses.attention import inline
from lightning_ulysses.attention.backends import BACKENDS
from lightning_ulysses.attention.core import ProcessGroupHandle
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.fences._transformers_private import (assigned_loss_function, attention_implementation,
                                                            forget_loss_function, set_attention_implementation)
from lightning_ulysses.hf.binding import _BINDING_ATTRIBUTE, ULYSSES_ATTENTION, _Binding, is_ulysses_attention
from lightning_ulysses.hf.forward import register_model_attention, unregister_model_attention
from lightning_ulysses.hf.positions import _CacheCheck, _ForwardPositions, _PositionCheck
from lightning_ulysses.hf.validation import (_unswitchable_message, _unswitchable_submodel, _unswitched_module,
                                             hf_head_counts, token_mixer_modules, validate_hf_model)
from lightning_ulysses.mixers import install_mixers


_NOT_SET = object()


@dataclass
class PreparedHFModel:
    """What `prepare_hf_model` changed on one model; `restore()` undoes it."""

    model: PreTrainedModel
    backend: str
    original_configs: dict[int, Any] = field(default_factory=dict)
    original_loss_function: Any = _NOT_SET
    loss_swapped: bool = False
    hooks: list = field(default_factory=list)
    attention_name: str | None = None  # the model's own name in transformers' registries (`register_model_attention`)
    mask_configs: list = field(default_factory=list)  # the private configs that hold it
    inline_modules: list = field(default_factory=list)
    resume_hub_kernels: Callable[[], None] | None = None  # `suspend_hub_kernels`: off while prepared

    def restore(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for module in self.inline_modules:
            module.__dict__.pop("forward", None)
        self.inline_modules = []
        for config in self.mask_configs:  # a private config kept past restore() names no binding
            set_attention_implementation(config, ULYSSES_ATTENTION)
        self.mask_configs = []
        if self.attention_name is not None:
            unregister_model_attention(self.attention_name)
            self.attention_name = None
        for module in self.model.modules():
            if _BINDING_ATTRIBUTE in module.__dict__:
                del module.__dict__[_BINDING_ATTRIBUTE]
            original = self.original_configs.get(id(module))
            if original is not None:
                module.config = original
        if self.resume_hub_kernels is not None:  # last: kernelizing resets the forwards of layers with a kernel slot
            self.resume_hub_kernels()
            self.resume_hub_kernels = None
        if not self.loss_swapped:
            return
        if self.original_loss_function is _NOT_SET:
            forget_loss_function(self.model)
        else:
            self.model.loss_function = self.original_loss_function


def suspend_hub_kernels(model: torch.nn.Module) -> Callable[[], None] | None:
    """Turn off transformers' hub kernels (`use_kernels`) on every model in `model` that has them on, for as long as
    lightning_ulysses keeps it prepared (here and in `memory.apply_memory_options`); returns the undo, which turns
    them on again (None when none had them on: nothing to undo, e.g. already suspended by an earlier step).

    transformers kernelizes a model with `use_kernels` on again at every `train()`/`eval()` that changes its mode, and
    kernelizing resets the forward of every layer with a kernel slot (`kernels`' `use_kernel_forward_from_hub`: the
    RMSNorms of most families, Qwen3.5's Gated DeltaNet, ...): it deletes the forward installed on that instance.
    Measured with transformers 5.25: the first `eval()` after preparation (Lightning's sanity check, validation)
    removed the split of Qwen3.5's Gated DeltaNet layers (at SP > 1 each rank would then run them over its shard as if
    it were the whole sequence: silently wrong) and every low-memory norm. From 5.25 on `from_pretrained` turns
    `use_kernels` on by default (wherever the `kernels` package, one of its dependencies, is installed, unless
    `USE_HUB_KERNELS` is off); up to 5.24 only when asked for. Turned off, from 5.25 on the layers get their
    transformers forwards back (up to 5.24 the kernels in place stay, no longer re-applied): a prepared model runs the
    torch code lightning_ulysses is verified against (and mamba_ssm / flash-linear-attention / causal-conv1d where
    installed, which transformers calls without kernelizing)."""
    kernelized = [module for module in model.modules() if getattr(module, "use_kernels", False) is True]
    if not kernelized:
        return None
    for module in kernelized:
        module.use_kernels = False

    def resume() -> None:
        for module in kernelized:
            module.use_kernels = True

    return resume


def find_hf_models(root: torch.nn.Module) -> list[PreTrainedModel]:
    """The outermost `PreTrainedModel`s inside `root` (a `LlamaModel` inside a `LlamaForCausalLM` is not listed)."""
    found: list[PreTrainedModel] = []

    def visit(module: torch.nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found


def prepare_hf_model(
    model: PreTrainedModel, sequence_parallel_group, loss_function: Callable | None = None, *, ring_group=None,
    batch_rows: BatchRowsSlot | None = None, head_groups: int = 1, transport=None,
) -> PreparedHFModel:
    """Switch one model to Ulysses attention over `sequence_parallel_group` (and optionally swap its loss).

    With `ring_group` (hybrid Ulysses × ring, `SequenceParallelGroups.ulysses_group`/`.ring_group`), heads are
    scattered over `sequence_parallel_group` only and ring attention spans `ring_group`; batches must then be
    sharded in the zig-zag layout (`SequenceSharder(..., ring_size=...)`).

    `batch_rows`: the slot a `SequenceSharder(..., batch_rows=...)` publishes each batch's whole rows into; the
    attention then reads packed documents and padding from it instead of gathering them in every layer.

    `head_groups`: pipeline the all-to-alls with the attention of this many head groups (`overlap_head_groups`).

    `transport`: how this model's all-to-alls move their bytes (`copy_engine.transport_for`); None: the collective
    all-to-all. It lives on the model's binding only, so another model in the process keeps its own.
    """
    group = ProcessGroupHandle(sequence_parallel_group)
    ring = ProcessGroupHandle(ring_group)
    backend = validate_hf_model(model, group.world_size, ring.world_size)
    if is_ulysses_attention(attention_implementation(model.config)):
        raise RuntimeError(f"{type(model).__name__} is already prepared for sequence parallelism: restore() it first.")
    prepared = PreparedHFModel(model=model, backend=backend)
    if backend == "eager" and group.world_size > 1 and hf_head_counts(model) is not None:
        heads = hf_head_counts(model)[0] // group.world_size
        warnings.warn(
            f"{type(model).__name__} attends with eager attention: under sequence parallelism every rank runs it on"
            f" whole rows of its {heads} heads, materialising {heads} x seq x seq scores per layer"
            f" ({heads * 32768 ** 2 * 4 / 2 ** 30:.0f} GiB at 32K tokens in fp32). Use sdpa, flash or flex attention"
            " where the model supports them.", stacklevel=2)
    if loss_function is not None:
        prepared.original_loss_function = assigned_loss_function(model, _NOT_SET)
        prepared.loss_swapped = True
        model.loss_function = loss_function
    sharded = group.world_size > 1 or ring.world_size > 1
    if not sharded and (backend not in BACKENDS or _unswitchable_submodel(model) is not None
                        or inline.covers(model)):
        # SP 1 with a backend we do not wrap (eager), a model transformers cannot switch, or a family whose attention
        # modules an adapter takes over at SP > 1 (families/: BLOOM, MPT, Falcon, ...; Falcon can be switched from
        # transformers 5.25 on, but its ALiBi variant then adds its bias to the mask the "ulysses" key replaces): the
        # model keeps its own attention, exactly as unprepared (packed rows then follow transformers' own rules).
        return prepared
    # transformers would kernelize the model again at its next train()/eval(), deleting the forwards installed below
    prepared.resume_hub_kernels = suspend_hub_kernels(model)
    # Switched at SP 1 too: one attention for every SP size, so packed rows (position_ids restarting per document)
    # keep their documents apart at SP 1 exactly as at SP 8. Hugging Face's own sdpa path detects packing only
    # without an attention mask and without a KV cache, which its default `use_cache=True` creates even in training.
    binding = _Binding(group=group, backend=backend, ring=ring, batch_rows=batch_rows, head_groups=head_groups,
                       transport=transport)
    takes_over = sharded and inline.covers(model)
    if takes_over:  # attention computed inline: each module's own forward around the exchange (attention/inline.py)
        prepared.inline_modules = inline.install(model, binding)
        for module in model.modules():
            module.__dict__[_BINDING_ATTRIBUTE] = binding
    elif hf_head_counts(model) is not None:
        _switch_attention(model, prepared, binding)
    if "position_ids" in inspect.signature(model.forward).parameters or takes_over:
        recorder = _ForwardPositions(model, binding)
        prepared.hooks.append(model.register_forward_pre_hook(recorder, with_kwargs=True))
    if sharded and batch_rows is not None:
        prepared.hooks.append(model.register_forward_pre_hook(_PositionCheck(model, binding), with_kwargs=True))
    if sharded:
        prepared.hooks.append(model.register_forward_pre_hook(_CacheCheck(model, binding), with_kwargs=True))
    # Token mixers: split by heads where declared (at SP 1 too, so that packed documents restart them as they
    # restart the attention), else on whole rows (SP > 1 only).
    handles, whole_rows = install_mixers(token_mixer_modules(model), group.group, ring.group,
                                         decoding=lambda: binding.decode is not None, transport=transport,
                                         positions=lambda: binding.forward_positions)
    prepared.hooks += handles
    if whole_rows:
        warnings.warn(
            f"{type(model).__name__}: {len(whole_rows)} token-mixing layers that are not attention run on whole rows"
            f" on every one of the {group.world_size * ring.world_size} sequence-parallel ranks (exact, but their"
            " compute and activations do not shrink with the SP size, and each costs an all-gather of the hidden"
            " states and an all-reduce of their gradient): " + "; ".join(whole_rows[:3])
            + (f"; and {len(whole_rows) - 3} more" if len(whole_rows) > 3 else ""), stacklevel=2)
    return prepared


def _switch_attention(model: PreTrainedModel, prepared: PreparedHFModel, binding: _Binding) -> None:
    """Switch `model` to the "ulysses" attention on a private config copy, its modules bound to `binding`, under a
    name of its own (`register_model_attention`) by which the mask function finds `binding`."""
    prepared.attention_name = register_model_attention(type(model).__name__, binding)
    # Private config copy, installed on every module that referenced the shared one (or a sub-config of it).
    memo: dict[int, Any] = {}
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        shared = module.__dict__.get("config")
        if shared is not None and id(shared) in memo:
            prepared.original_configs[id(module)] = shared
            module.config = memo[id(shared)]
    try:
        model.set_attn_implementation(prepared.attention_name)
    except (ValueError, NotImplementedError) as error:
        prepared.restore()
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so"
            " lightning_ulysses cannot swap it. Wrap its attention in lightning_ulysses.UlyssesAttention."
        ) from error
    unswitched = _unswitched_module(model, memo)
    if unswitched is not None:
        prepared.restore()
        raise ValueError(_unswitchable_message(model, unswitched))
    for module in model.modules():
        module.__dict__[_BINDING_ATTRIBUTE] = binding
    prepared.mask_configs = [config for config in memo.values() if isinstance(config, PreTrainedConfig)
                             and attention_implementation(config) == prepared.attention_name]
