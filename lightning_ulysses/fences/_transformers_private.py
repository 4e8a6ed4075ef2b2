"""Every private transformers name lightning_ulysses relies on, in one place.

transformers changes its internals between releases without deprecation, so nothing else in the package touches
one: it calls the accessor here. Each entry says why no public API serves. Checked against transformers
`TRANSFORMERS_CHECKED` (the attention-name and model internals also on 5.24.0: test_transformers_private passes);
`tests/unit/test_transformers_private.py` and `test_pretrained.py` fail when the installed transformers removes or
re-signs them (re-check the reason given here before changing an accessor to follow it).

transformers is imported inside each accessor: the fences load before anything imports it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

TRANSFORMERS_CHECKED = "5.25.0"

# -- the weights `from_pretrained` reads ---------------------------------------------------------------------------
# `PreTrainedModel.from_pretrained` builds the model on the meta device, then calls the static method
# `_load_pretrained_model(model, state_dict, checkpoint_files, load_config)`, which reads every checkpoint tensor whole
# into host memory and assigns it, then `_finalize_model_loading(model, load_config, loading_info)`, which moves the
# keys reported missing and the non-persistent buffers (RoPE's `inv_freq`) off the meta device and initialises them.
# transformers reads a rank's shard only of parameters that are already DTensors when it loads (its own
# `DistributedConfig` path, which applies its own `fully_shard` plan and mesh); no public argument leaves the
# parameters on the meta device unread. The FSDP2 strategy's `from_pretrained` in `configure_model` therefore
# replaces this one step while `configure_model` runs (`integration/pretrained.ShardedPretrainedLoads`).
PRETRAINED_LOAD = "_load_pretrained_model"
PRETRAINED_LOAD_PARAMETERS = ("model", "state_dict", "checkpoint_files", "load_config", "expected_keys")


@contextlib.contextmanager
def pretrained_load_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """Within the context, `PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config,
    ...)` calls `replacement(original, model, state_dict, checkpoint_files, load_config, ...)` instead (process-wide:
    it is a static method of the base class). Restored on exit, also when the body raises."""
    from transformers import PreTrainedModel

    original = inspect.getattr_static(PreTrainedModel, PRETRAINED_LOAD)
    load = original.__func__ if isinstance(original, staticmethod) else original

    def replaced(*args: Any, **kwargs: Any) -> Any:
        return replacement(load, *args, **kwargs)

    setattr(PreTrainedModel, PRETRAINED_LOAD, staticmethod(replaced))
    try:
        yield
    finally:
        setattr(PreTrainedModel, PRETRAINED_LOAD, original)


def nothing_loaded(tied_keys: Any = ()) -> tuple[Any, None]:
    """What `_load_pretrained_model` returns when it read nothing and only `tied_keys` are missing (the names
    `_finalize_model_loading` ties to others: its `tie_weights(missing_keys=...)` ties only those) in a
    `transformers.utils.loading_report.LoadStateDictInfo`: `_finalize_model_loading` then initialises only the
    non-persistent buffers (tied names are neither moved nor initialised), and reports nothing; no disk-offload
    index."""
    from transformers.utils.loading_report import LoadStateDictInfo

    return LoadStateDictInfo(missing_keys=set(tied_keys), unexpected_keys=set(), mismatched_keys=set(), conversion_errors={},
                             error_msgs=[], skipped_pp_keys=set()), None


def pretrained_load_parameters() -> tuple[str, ...]:
    """The parameter names of the installed `_load_pretrained_model` (for the fence's test)."""
    from transformers import PreTrainedModel

    return tuple(inspect.signature(getattr(PreTrainedModel, PRETRAINED_LOAD)).parameters)


def reads_plain_weights(load_config: Any) -> bool:
    """Whether the `LoadStateDictConfig` transformers hands `_load_pretrained_model` (a private dataclass of
    `modeling_utils`) asks for nothing but the checkpoint's tensors in the model's own dtypes: no quantizer, device
    map, disk offload, tensor-parallel mesh, or per-module dtype plan (`keep_in_fp32` modules)."""
    return (getattr(load_config, "hf_quantizer", None) is None and getattr(load_config, "device_map", None) is None
            and getattr(load_config, "device_mesh", None) is None and not getattr(load_config, "dtype_plan", None)
            and getattr(load_config, "disk_offload_folder", None) is None)


# -- the device `from_pretrained` kernelizes for --------------------------------------------------------------------
# With the `kernels` package installed, `from_pretrained` ends with `set_use_kernels` → `hub_kernels.kernelize`, which
# picks each layer's kernel for `model._kernels_device or model.device` (transformers' own answer for parameters left
# on the meta device by offloading) and refuses "meta". No argument of `from_pretrained` sets it.
KERNELS_DEVICE = "_kernels_device"


def kernelize_for(model: Any, device_type: str) -> None:
    """`model._kernels_device = device_type` unless set: the device `kernelize` picks kernels for when the model's
    parameters are still on the meta device (a plain load would have them on `device_type`)."""
    if getattr(model, KERNELS_DEVICE, None) is None:
        setattr(model, KERNELS_DEVICE, device_type)


# -- the attention implementation of one config ----------------------------------------------------------------------
# `PreTrainedConfig._attn_implementation` is the name transformers looks attention and mask functions up by (a
# property over `_attn_implementation_internal`). Its public setter is `PreTrainedModel.set_attn_implementation`,
# which switches a model with every sub-model and sub-config at once; reading it per config, and setting one config
# back alone (a private config copy at `restore()`), has no public spelling.
def attention_implementation(config: Any, default: Any = None) -> Any:
    """`config._attn_implementation` (`default` for an object that is not a transformers config)."""
    return getattr(config, "_attn_implementation", default)


def set_attention_implementation(config: Any, name: str) -> None:
    """`config._attn_implementation_internal = name`: this config alone (its sub-configs keep theirs)."""
    config._attn_implementation_internal = name


def can_set_attention_implementation(model_class: type) -> bool:
    """`PreTrainedModel._can_set_attn_implementation()`: transformers' source heuristic for whether a class
    dispatches attention through `AttentionInterface` (it only logs a warning where it cannot switch one)."""
    return model_class._can_set_attn_implementation()


def unregister_attention(interface: type, name: str) -> None:
    """Remove `name` from `interface` (`AttentionInterface` or `AttentionMaskInterface`, both `GeneralInterface`s):
    `register` writes the class-wide `_global_mapping`, and the mapping's public `__delitem__` deletes only from an
    instance's local one. Tolerates a name already gone."""
    interface._global_mapping.pop(name, None)


# -- a loss function assigned to one model ---------------------------------------------------------------------------
# `PreTrainedModel.loss_function` is a property: its setter keeps an assigned loss in `_loss_function`, and its getter
# falls back to the family's loss when none is assigned. `restore()` must tell "none assigned" from an assigned one,
# which the property does not show.
LOSS_FUNCTION = "_loss_function"


def assigned_loss_function(model: Any, default: Any) -> Any:
    """The loss function assigned to this model instance (`model.loss_function = ...`), else `default`."""
    return model.__dict__.get(LOSS_FUNCTION, default)


def forget_loss_function(model: Any) -> None:
    """Drop an assigned loss function: the model's `loss_function` is its family's again."""
    model.__dict__.pop(LOSS_FUNCTION, None)


# -- the inline attention of BLOOM and GPT-Neo (adapters/) ---------------------------------------------------------
# The adapters re-state these families' attention forwards around the exchange and call the pieces the modules' own
# forwards call (no public spelling): `BloomAttention._reshape(fused_qkv)` → (query, key, value),
# `modeling_bloom._get_alibi_slopes(num_heads, device)`, `GPTNeoSelfAttention._split_heads(tensor, heads, head_dim)`.
def bloom_split_qkv(module: Any, fused_qkv: Any) -> Any:
    """`BloomAttention._reshape(fused_qkv)`: the fused projection split into query, key and value heads."""
    return module._reshape(fused_qkv)


def bloom_alibi_slopes(module: Any, num_heads: int, device: Any) -> Any:
    """`_get_alibi_slopes(num_heads, device)` of the module that defines `module`'s class (`modeling_bloom`)."""
    return inspect.getmodule(type(module))._get_alibi_slopes(num_heads, device)


def gpt_neo_split_heads(module: Any, tensor: Any, num_heads: int, head_dim: int) -> Any:
    """`GPTNeoSelfAttention._split_heads(tensor, num_heads, head_dim)`."""
    return module._split_heads(tensor, num_heads, head_dim)


# -- model internals read by the memory engine, the export and the examples --------------------------------------
def checkpoints_with_cache(layer: Any) -> bool:
    """`GradientCheckpointingLayer._can_checkpoint_with_cache`: whether transformers' own checkpointing keeps a
    layer's cache arguments in its recompute (the layer only reads them); False for any other module."""
    return bool(getattr(layer, "_can_checkpoint_with_cache", False))


def tied_weights_keys(model: Any) -> Any:
    """`PreTrainedModel._tied_weights_keys`: the names tied to another weight (a mapping from 5.x on, a list
    before; None or empty when nothing is tied)."""
    return getattr(model, "_tied_weights_keys", None)


def init_weights(model: Any, module: Any) -> None:
    """`PreTrainedModel._init_weights(module)`: the family's initialisation of one module (what `post_init` runs on
    every module; the public `init_weights` re-initialises the whole model at once)."""
    model._init_weights(module)


# The private names above that the accessors read directly, as (module path, attribute path): what
# `tests/unit/test_transformers_private.py` checks exists in the installed transformers (`_loss_function`, an
# instance attribute, and `_kernels_device` are checked by behaviour and by source there and in test_pretrained.py).
FENCED: tuple[tuple[str, str], ...] = (
    ("transformers.modeling_utils", f"PreTrainedModel.{PRETRAINED_LOAD}"),
    ("transformers.modeling_utils", "PreTrainedModel._can_set_attn_implementation"),
    ("transformers.modeling_utils", "PreTrainedModel._init_weights"),
    ("transformers.modeling_utils", "PreTrainedModel._tied_weights_keys"),
    ("transformers.configuration_utils", "PreTrainedConfig._attn_implementation"),
    ("transformers.utils.generic", "GeneralInterface._global_mapping"),
    ("transformers.modeling_layers", "GradientCheckpointingLayer._can_checkpoint_with_cache"),
    ("transformers.models.bloom.modeling_bloom", "BloomAttention._reshape"),
    ("transformers.models.bloom.modeling_bloom", "_get_alibi_slopes"),
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPTNeoSelfAttention._split_heads"),
)
