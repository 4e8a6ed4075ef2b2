"""The long-sequence memory engine: each feature on or off on its own, each exact.

```python
UlyssesDeepSpeedStrategy(memory=MemoryOptions(tiled_mlp=True, tiled_logits_loss=True,
                                              activation_checkpointing=True, offload_activations=True))
UlyssesDeepSpeedStrategy(memory={"tiled_mlp": True})          # a mapping works too (Hydra recipes)
```

- `tiled_mlp`: every decoder layer's `mlp` runs over `mlp_tile_tokens`-token tiles, recomputed in backward.

Every recompute replays the random state of its forward (dropout draws the same masks) and a checkpointed layer's
recompute gets no KV cache (however the model passes it: GPT-2 passes it by position), so gradients stay exact with
dropout and with `use_cache=True`.
- `tiled_logits_loss`: training forwards with labels compute the loss from the final hidden states tile by tile
  (`logits_tile_tokens`); whole `[seq, vocab]` logits never exist, and `outputs.logits` is `None`.
- `activation_checkpointing`: every decoder layer keeps only its input and recomputes itself in backward;
  `offload_activations` moves those inputs to pinned host memory; `checkpoint_interval` k keeps only every k-th
  layer's input (the others are recomputed from it: k − 1 extra layer forwards per k layers, 1/k of the kept bytes);
  `keep_attention_outputs` keeps the attention kernels' outputs (where the inputs are kept) so the recompute skips
  the attention forward, the dominant kernel at long sequences; `keep_matmul_outputs` keeps the products of the
  linear layers (projections, MLPs, experts) and `keep_token_mixer_outputs` those of a token mixer's chunked
  recurrence (the gated delta rule, the Mamba2 scan), so the recompute runs only the cheap elementwise work (norms,
  activations, RoPE) again; `checkpoint_layers` checkpoints only some decoder layers (N: the first N; or the indices given), the
  others keep their activations and are not recomputed.
- `low_memory_norms`: every Llama-style RMSNorm of a Hugging Face model keeps only its 16-bit input and an fp32
  rstd per token for backward (not an fp32 copy of its input); other RMSNorms are refused; a no-op for the native
  GPT, whose LayerNorms keep only their input already.
- `fused_elementwise`: every Llama-style RMSNorm and every gated MLP's `act(gate) * up` run through `torch.compile`d
  pure functions (`fused_backend`, default inductor), weights passed at call time; composes with every option above
  (with `low_memory_norms` the low-memory norm itself is compiled); a model with neither is refused. RoPE is not
  fused (see `memory/fused.py`).
- `expandable_segments`: the CUDA allocator grows segments in place instead of fragmenting
  (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless that variable is set already).

Applied by `UlyssesDeepSpeedStrategy` to every Hugging Face causal LM (Llama-style: decoder layers with an `mlp`,
a linear output head) and every `NativeCausalLM` (the example `GPT`) in the LightningModule, before DeepSpeed wraps
the model; undone at teardown. `apply_memory_options` does the same for a model used without the strategy.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_ulysses.adapters.native_model import NativeCausalLM
from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.fences import _torch_private as torch_private
from lightning_ulysses.hf.prepare import suspend_hub_kernels
from lightning_ulysses.memory.checkpointing import HostActivationStore, checkpoint_layers
from lightning_ulysses.memory.fused import check_backend, gated_mlp_activation, use_fused_gated_mlp, use_fused_norm
from lightning_ulysses.memory.logits_loss import TiledLogitsLoss, fuse_head_with_loss, fuse_hugging_face_loss
from lightning_ulysses.memory.norms import llama_style_norms, use_low_memory_norm
from lightning_ulysses.memory.tiled_mlp import tile_mlp


@dataclass(frozen=True)
class MemoryOptions:
    tiled_mlp: bool = False
    mlp_tile_tokens: int = 8192
    tiled_logits_loss: bool = False
    logits_tile_tokens: int = 4096
    activation_checkpointing: bool = False
    offload_activations: bool = False
    checkpoint_interval: int = 1
    keep_attention_outputs: bool = False
    # None: every decoder layer (with activation_checkpointing); N: the first N layers, the others keep their
    # activations (the last layers run backward first, so what they keep is freed before any recompute peaks);
    # a tuple: those layer indices (what memory="auto" writes for a hybrid, by what each layer's recompute costs).
    checkpoint_layers: Optional[Union[int, tuple[int, ...]]] = None
    keep_matmul_outputs: bool = False
    keep_token_mixer_outputs: bool = False
    low_memory_norms: bool = False
    fused_elementwise: bool = False
    fused_backend: str = "inductor"
    expandable_segments: bool = False

    def __post_init__(self) -> None:
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError("offload_activations=True moves the checkpointed layer inputs to host memory: it needs"
                             " activation_checkpointing=True as well.")
        tuning = ("checkpoint_interval", "keep_attention_outputs", "keep_matmul_outputs", "keep_token_mixer_outputs",
                  "checkpoint_layers")
        if not self.activation_checkpointing and (self.checkpoint_interval != 1 or any(
                getattr(self, name) not in (False, None) for name in tuning[1:])):
            raise ValueError(f"{', '.join(tuning)} tune layer checkpointing: they need activation_checkpointing=True"
                             " as well.")
        layers = self.checkpoint_layers
        if isinstance(layers, (list, tuple)) or (layers is not None and not isinstance(layers, bool)
                                                 and hasattr(layers, "__iter__")):
            layers = tuple(int(index) for index in layers)
            object.__setattr__(self, "checkpoint_layers", layers)  # a list from Hydra or JSON
            if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
                raise ValueError(f"checkpoint_layers as layer indices must name distinct decoder layers (0, 1, ...),"
                                 f" at least one, got {list(layers)}; None checkpoints every layer")
        elif layers is not None and (isinstance(layers, bool) or int(layers) < 1):
            raise ValueError(f"checkpoint_layers is how many decoder layers are checkpointed (the first ones), at"
                             f" least 1, or their indices; got {layers!r}. Switch activation_checkpointing off to"
                             " checkpoint none; None checkpoints every layer.")
        if layers is not None and self.checkpoint_interval != 1:
            raise ValueError("checkpoint_layers checkpoints some layers one by one; checkpoint_interval > 1 recomputes"
                             " stretches of consecutive layers. Use one of them (checkpoint_interval=1 with"
                             " checkpoint_layers).")
        for name in ("mlp_tile_tokens", "logits_tile_tokens", "checkpoint_interval"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer (a number of tokens or layers), got {getattr(self, name)}")

    @classmethod
    def coerce(cls, options: Union["MemoryOptions", Mapping[str, Any], None]) -> "MemoryOptions":
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"memory must be a MemoryOptions or a mapping of its fields, got {type(options).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"Unknown memory option(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**{key: value for key, value in options.items() if value is not None})

    @property
    def changes_models(self) -> bool:
        return (self.tiled_mlp or self.tiled_logits_loss or self.activation_checkpointing or self.low_memory_norms
                or self.fused_elementwise)


_ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
_EXPANDABLE = "expandable_segments:True"


def apply_allocator_settings(options: MemoryOptions) -> Callable[[], None]:
    """Expandable segments for the CUDA caching allocator; an explicit `PYTORCH_CUDA_ALLOC_CONF` wins. Returns what
    puts the variable and the allocator back as they were (the run's teardown calls it: a later run without the
    option, or plain torch code in the process, then allocates as in a process that never set it)."""
    if not options.expandable_segments or _ALLOCATOR_VARIABLE in os.environ:
        return lambda: None
    os.environ[_ALLOCATOR_VARIABLE] = _EXPANDABLE  # read when CUDA initialises
    _set_expandable_segments(True)
    return _undo_allocator_settings


def _undo_allocator_settings() -> None:
    if os.environ.get(_ALLOCATOR_VARIABLE) == _EXPANDABLE:  # (unless someone set it since)
        del os.environ[_ALLOCATOR_VARIABLE]
        _set_expandable_segments(False)


def _set_expandable_segments(enabled: bool) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # else the variable is read when CUDA starts
        torch_private.set_allocator_settings(f"expandable_segments:{enabled}")


def _takes_hidden_states_only(mlp: nn.Module) -> bool:
    """Whether `mlp.forward` needs one argument (the hidden states): what `tile_mlp` tiles."""
    try:
        parameters = inspect.signature(mlp.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len([p for p in parameters if p.default is p.empty and p.kind in positional]) <= 1


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    if isinstance(model, NativeCausalLM):
        return model.decoder_layers()
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpointed_layers(layers: list[nn.Module], which: Optional[Union[int, tuple[int, ...]]]) -> list[nn.Module]:
    """The decoder layers `MemoryOptions.checkpoint_layers` names: all (None), the first N, or those indices."""
    if which is None:
        return layers
    indices = range(which) if isinstance(which, int) else sorted(which)
    if max(indices) >= len(layers):
        raise ValueError(f"checkpoint_layers={which!r} names layer {max(indices)}, but the model has {len(layers)}"
                         f" decoder layers (0 to {len(layers) - 1}). Name fewer, or None for every layer.")
    return [layers[index] for index in indices]


decoder_layers = _decoder_layers  # public: the FSDP2 strategy makes each decoder layer one fully_shard unit


def _fused_mlps(model: nn.Module, layers: list[nn.Module], norms: list[nn.Module],
                options: MemoryOptions) -> list[tuple[nn.Module, str]]:
    """The decoder layers' gated MLPs `fused_elementwise` fuses, with their activations; refuses a model where it
    recognises neither a norm nor a gated MLP."""
    if not options.fused_elementwise:
        return []
    check_backend(options.fused_backend)
    mlps = [(layer.mlp, gated_mlp_activation(layer.mlp)) for layer in layers
            if isinstance(getattr(layer, "mlp", None), nn.Module)]
    mlps = [(mlp, activation) for mlp, activation in mlps if activation is not None]
    if not norms and not mlps:
        raise ValueError(f"fused_elementwise fuses Llama-style RMSNorms and gated MLPs (`act(gate_proj(x)) *"
                         f" up_proj(x)`); {type(model).__name__} has neither. Switch it off for this model"
                         " (MemoryOptions(fused_elementwise=False); recipes: strategy.memory.fused_elementwise=false).")
    return mlps


def fused_elementwise_applies(model: nn.Module) -> bool:
    """Whether `fused_elementwise` would be accepted on `model` (`memory="auto"` switches it on only then): decoder
    layers, only Llama-style RMSNorms, and at least one of those or a recognised gated MLP. Changes nothing."""
    layers = _decoder_layers(model)
    try:
        norms = llama_style_norms(model, ("fused_elementwise",))
        _fused_mlps(model, layers, norms, MemoryOptions(fused_elementwise=True))
    except ValueError:
        return False
    return bool(layers)


def features_refused_by(model: nn.Module) -> frozenset[str]:
    """The memory features `apply_memory_options` refuses on `model` (`memory="auto"` leaves them off): the tiled MLP
    where a decoder layer has no `mlp` of the hidden states alone (Nemotron-H's blocks hold theirs as `mixer`), the
    low-memory norms where an RMSNorm is not Llama-style (Qwen3-Next's `1 + weight`). Changes nothing."""
    refused = set()
    layers = _decoder_layers(model)
    if not layers or not all(isinstance(getattr(layer, "mlp", None), nn.Module)
                             and _takes_hidden_states_only(layer.mlp) for layer in layers):
        refused.add("tiled_mlp")
    try:
        llama_style_norms(model, ("low_memory_norms",))
    except ValueError:
        refused.add("low_memory_norms")
    return frozenset(refused)


# DeepSpeed's own bound for leaves it picks (`stage3_module_granularity_threshold`) and its default
# `stage3_max_live_parameters`: GPT-3 176B's layers (1.8B parameters) stay gathered submodule by submodule.
LEAF_LAYER_MAX_PARAMETERS = 10**9


def _input_requiring_grad(layer: nn.Module, args: tuple, kwargs: dict):
    """A leaf layer's forward pre-hook: hidden states that need no gradient (frozen embeddings: LoRA, a frozen
    first stretch) come in as a fresh tensor that does, when the layer has trainable parameters. DeepSpeed releases
    a leaf's gathered parameters when the gradient of its inputs is computed; with no input needing one, its
    backward reads released (empty) parameters. The extra input gradient is dropped at the detach: parameter
    gradients are unchanged."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in layer.parameters()):
        return None
    if args and torch.is_tensor(args[0]) and not args[0].requires_grad and args[0].is_floating_point():
        return (args[0].detach().requires_grad_(), *args[1:]), kwargs
    hidden = kwargs.get("hidden_states")
    if not args and torch.is_tensor(hidden) and not hidden.requires_grad and hidden.is_floating_point():
        return args, {**kwargs, "hidden_states": hidden.detach().requires_grad_()}
    return None


def mark_leaf_layers(model: nn.Module, options: MemoryOptions) -> list[Callable[[], None]]:
    """Mark `model`'s decoder layers DeepSpeed ZeRO-3 leaf modules (as `deepspeed.utils.set_z3_leaf_modules` does):
    each layer's parameters are then gathered whole, once around its forward (and its checkpointed recompute) and
    once around its backward, instead of one submodule at a time, which costs host time per submodule. Must run
    before `deepspeed.initialize`. Not with `checkpoint_interval` > 1: a stretch recomputes its earlier layers
    inside a later layer's backward, outside their own hooks, where only submodule hooks gather parameters. Nor a
    layer of more than `LEAF_LAYER_MAX_PARAMETERS`.

    The marks stay (DeepSpeed registers its hooks for a leaf, none on its submodules, and a leaf is gathered
    correctly however it is run afterwards: `tile_mlp` leaves its mark for the same reason); the returned undos
    remove the input hooks (`_input_requiring_grad`)."""
    if options.activation_checkpointing and options.checkpoint_interval > 1:
        return []
    undo = []
    for layer in _decoder_layers(model):
        if sum(getattr(p, "ds_numel", p.numel()) for p in layer.parameters()) > LEAF_LAYER_MAX_PARAMETERS:
            continue  # gathered whole, it would hold more at once than DeepSpeed's default live-parameter budget
        deepspeed_private.mark_z3_leaf(layer)
        # before DeepSpeed's own pre-forward hooks, which read which inputs need a gradient
        undo.append(layer.register_forward_pre_hook(_input_requiring_grad, prepend=True, with_kwargs=True).remove)
    return undo


def apply_memory_options(model: nn.Module, options: MemoryOptions,
                         store: Optional[HostActivationStore] = None) -> list[Callable[[], None]]:
    """Apply `options` to one causal LM (Hugging Face or a `NativeCausalLM`); return the callables that undo it.

    All checks run before anything changes, so a refused model is left as it was.
    """
    restores: list[Callable[[], None]] = []
    if not options.changes_models:
        return restores
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"The memory options need a model with decoder layers; found none in {type(model).__name__}.")
    if options.tiled_mlp:
        missing = [type(layer).__name__ for layer in layers if not isinstance(getattr(layer, "mlp", None), nn.Module)]
        if missing:
            raise ValueError(f"tiled_mlp needs an `mlp` module in every decoder layer; {missing[0]} has none."
                             " Switch tiled_mlp off for this model.")
        more = [type(layer.mlp).__name__ for layer in layers if not _takes_hidden_states_only(layer.mlp)]
        if more:  # (BLOOM's MLP also takes the residual)
            raise ValueError(f"tiled_mlp tiles an `mlp` that takes the hidden states only; {more[0]} takes more"
                             " arguments. Switch tiled_mlp off for this model.")
    own_checkpointing = [getattr(m, "gradient_checkpointing", False) is True for m in [model, *layers]]
    if options.activation_checkpointing and any(own_checkpointing):
        raise ValueError(f"{type(model).__name__} already has its own gradient checkpointing enabled; with the memory"
                         " option activation_checkpointing=True every layer would be recomputed twice. Disable one of"
                         " them (for the recipes: model.activation_checkpointing=false).")
    norm_options = tuple(name for name in ("low_memory_norms", "fused_elementwise") if getattr(options, name))
    norms = llama_style_norms(model, norm_options) if norm_options else []  # refuses what it can't replace
    fused_mlps = _fused_mlps(model, layers, norms, options)
    try:
        # First, undone last: transformers would kernelize the model again at its next train()/eval(), deleting the
        # norms' forwards installed below (hf/prepare.py `suspend_hub_kernels`)
        resume_hub_kernels = suspend_hub_kernels(model)
        if resume_hub_kernels is not None:
            restores.append(resume_hub_kernels)
        if options.tiled_logits_loss:  # first: it refuses models whose logits are transformed before the loss
            loss = TiledLogitsLoss(options.logits_tile_tokens)
            if isinstance(model, NativeCausalLM):
                restores += [fuse_head_with_loss(model.lm_head, loss), model.use_logits_loss(loss)]
            else:
                restores.append(fuse_hugging_face_loss(model, loss))
        fused = options.fused_backend if options.fused_elementwise else None
        if options.low_memory_norms:
            restores += [use_low_memory_norm(norm, fused) for norm in norms]
        elif fused is not None:
            restores += [use_fused_norm(norm, fused) for norm in norms]
        # Before tiling: a tiled MLP runs the fused forward on each tile.
        restores += [use_fused_gated_mlp(mlp, activation, fused) for mlp, activation in fused_mlps]
        if options.tiled_mlp:
            restores += [tile_mlp(layer.mlp, options.mlp_tile_tokens) for layer in layers]
        if options.activation_checkpointing:
            if options.offload_activations and store is None:
                store = HostActivationStore()
            offload_to = store if options.offload_activations else None
            restores += checkpoint_layers(checkpointed_layers(layers, options.checkpoint_layers), offload_to,
                                          options.checkpoint_interval, options.keep_attention_outputs,
                                          options.keep_matmul_outputs, options.keep_token_mixer_outputs)
            if offload_to is not None:
                restores.insert(0, offload_to.release)  # undone last: unpins the host buffers
    except Exception:
        for restore in reversed(restores):
            restore()
        raise
    return restores


__all__ = ["HostActivationStore", "MemoryOptions", "TiledLogitsLoss", "apply_allocator_settings", "apply_memory_options",
           "features_refused_by", "fused_elementwise_applies", "mark_leaf_layers"]
