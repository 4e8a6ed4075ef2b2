"""Every private torch name lightning_ulysses relies on, in one place.

torch changes its underscore names (the `torch._C` bindings, `_`-prefixed modules and aten operators, `nn.Module`'s
tables, autograd nodes' attributes) without deprecation, so nothing else in the package touches one: it calls the
accessor or reads the alias here. Each entry says what it is and why no public API serves. All were checked against
torch `TORCH_CHECKED`; `tests/unit/test_torch_private.py` fails when the installed torch removes or renames any of
them, and `tests/unit/test_layers.py` fails when a module outside the fences uses a private name.

Modules torch loads lazily or only where they exist (`torch._dynamo`, symmetric memory, the pinning utilities) are
imported inside their accessor, as the call sites imported them before.
"""

from __future__ import annotations

import collections
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode

TORCH_CHECKED = "2.13.0"

# -- the SDPA kernels' priority ----------------------------------------------------------------------------------------
# `torch.nn.attention.sdpa_kernel(..., set_priority=True)` sets the order but restores on exit only the order of the
# kernels enabled at entry (`backends._restoring_priority`), and no public call reads the order.


def has_sdp_priority_order() -> bool:
    """Whether this torch has `torch._C._get_sdp_priority_order` (older ones do not)."""
    return hasattr(torch._C, "_get_sdp_priority_order")


def sdp_priority_order() -> list[int]:
    """`torch._C._get_sdp_priority_order()`: the fused SDPA kernels (`SDPBackend` values) in the order torch tries
    them."""
    return torch._C._get_sdp_priority_order()


def set_sdp_priority_order(order: list[int]) -> None:
    """`torch._C._set_sdp_priority_order(order)`: put a whole order back."""
    torch._C._set_sdp_priority_order(order)


# -- aten's fused attention kernels ----------------------------------------------------------------------------------
# The ring calls the kernels `F.scaled_dot_product_attention` dispatches to directly: it needs their log-sum-exp
# and their backward on one block, which the public function does not return. The memory engine recognises their
# calls by the same operators (`checkpointing._ATTENTION_KERNELS`). Looked up here at import (CPU builds register
# them too; they run only on their devices).
_aten = torch.ops.aten
SDPA_FLASH_FOR_CPU = _aten._scaled_dot_product_flash_attention_for_cpu
SDPA_FLASH_FOR_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward
SDPA_FLASH = _aten._scaled_dot_product_flash_attention
SDPA_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_backward
SDPA_EFFICIENT = _aten._scaled_dot_product_efficient_attention
SDPA_EFFICIENT_BACKWARD = _aten._scaled_dot_product_efficient_attention_backward
SDPA_CUDNN = _aten._scaled_dot_product_cudnn_attention
SDPA_CUDNN_BACKWARD = _aten._scaled_dot_product_cudnn_attention_backward
# Their names, as `getattr(torch.ops.aten, name)` takes them (where a torch lacks one, the caller skips it).
SDPA_KERNEL_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
# aten's grouped matrix product (transformers' `grouped_mm` experts dispatch to it).
GROUPED_MM_NAME = "_grouped_mm"


def op_schema(op: Any) -> Any:
    """`OpOverload._schema`: the operator's `FunctionSchema` (its arguments' names and aliasing); the public
    `torch.ops` objects do not show it otherwise."""
    return op._schema


# -- dispatch, compile ----------------------------------------------------------------------------------------------
# `TorchDispatchMode` is what `torch.utils.checkpoint`'s selective checkpointing itself subclasses; torch exports it
# only from this private module.
TorchDispatchMode = _TorchDispatchMode


def lookup_compile_backend(name: str) -> Any:
    """`torch._dynamo.lookup_backend(name)`: raises for a `torch.compile` backend name that does not exist (torch
    checks the name only at the first compiled call)."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """`torch._dynamo.maybe_mark_dynamic`: a dimension compiled as dynamic where it can be, without the error
    `torch._dynamo.mark_dynamic` raises when it cannot."""
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(tensor, dim)


# -- tensors and autograd nodes ------------------------------------------------------------------------------------
def version_counter(tensor: torch.Tensor) -> int:
    """`Tensor._version`: bumped by every in-place change of the tensor's storage (what autograd's own check of saved
    tensors reads); no public accessor."""
    return tensor._version


def forward_class_of(node: Any) -> Any:
    """`BackwardCFunction._forward_cls`: the `torch.autograd.Function` a graph node belongs to (None for a node of a
    built-in operator)."""
    return getattr(node, "_forward_cls", None)


def saved_values_of(node: Any) -> list[Any]:
    """The `_saved_*` attributes of a built-in operator's graph node: what it keeps for its backward (the public
    `saved_tensors` exists only on custom functions' nodes)."""
    return [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]


# -- nn.Module's own tables ----------------------------------------------------------------------------------------
# A module's parameters, buffers and children live in three dicts, and its hooks in seven more; `register_*` and
# `setattr` go through checks (a parameter slot cannot take a tensor, a child must be a module) that a view of the
# module for one rank's channels must bypass, and no public call copies a module shallowly without its hooks.
HOOK_TABLES = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def parameter_table(module: nn.Module) -> dict[str, Any]:
    """`module._parameters`, the live dict (None entries included)."""
    return module._parameters


def buffer_table(module: nn.Module) -> dict[str, Any]:
    """`module._buffers`, the live dict (None entries included)."""
    return module._buffers


def child_table(module: nn.Module) -> dict[str, Any]:
    """`module._modules`, the live dict."""
    return module._modules


def bare_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` with its own parameter, buffer and child tables and no hooks (those stay on the
    module itself), and without a `forward` installed on the instance."""
    copy = module.__class__.__new__(module.__class__)
    copy.__dict__.update(module.__dict__)
    copy.__dict__.pop("forward", None)
    copy.__dict__["_parameters"] = dict(module._parameters)
    copy.__dict__["_modules"] = dict(module._modules)
    copy.__dict__["_buffers"] = dict(module._buffers)
    for name in HOOK_TABLES:
        if name in copy.__dict__:
            copy.__dict__[name] = collections.OrderedDict()
    return copy


# `torch.nn.modules.batchnorm._NormBase`: the base of every batch and instance norm, not exported.
NormBase = torch.nn.modules.batchnorm._NormBase


# -- process groups ------------------------------------------------------------------------------------------------
def default_process_group() -> Any:
    """`torch.distributed.distributed_c10d._get_default_group()`: the world group itself (`dist.group.WORLD` is a
    placeholder that compares unequal to the group `init_device_mesh` hands back for a world-sized dimension)."""
    return dist.distributed_c10d._get_default_group()


def registered_process_groups() -> dict[Any, Any]:
    """`torch.distributed.distributed_c10d._world.pg_map`: every group not yet destroyed (no public query; destroying
    one twice fails)."""
    return dist.distributed_c10d._world.pg_map


def symmetric_memory() -> ModuleType:
    """`torch.distributed._symmetric_memory`: symmetric-memory buffers and their rendezvous (the copy engine's
    all-to-all); torch has no public module for them yet. Raises ImportError where this torch lacks it."""
    from torch.distributed import _symmetric_memory

    return _symmetric_memory


# -- CUDA ----------------------------------------------------------------------------------------------------------
def set_allocator_settings(settings: str) -> None:
    """`torch.cuda.memory._set_allocator_settings`: `PYTORCH_CUDA_ALLOC_CONF` after CUDA has initialised (the
    variable is read only once, at initialisation)."""
    torch.cuda.memory._set_allocator_settings(settings)


def in_bad_fork() -> bool:
    """`torch.cuda._is_in_bad_fork()`: whether this process was forked after its parent used CUDA (which it then
    cannot); False where torch lacks it."""
    return getattr(torch.cuda, "_is_in_bad_fork", lambda: False)()


def pin_memory(address: int, nbytes: int) -> None:
    """`torch.cuda._pin_memory_utils.pin_memory`: page-lock host memory torch already allocated (a `pin_memory()`
    copy would double the host memory of every buffer)."""
    from torch.cuda._pin_memory_utils import pin_memory as pin

    pin(address, nbytes)


def unpin_memory(address: int) -> None:
    """`torch.cuda._pin_memory_utils.unpin_memory`: undo `pin_memory`."""
    from torch.cuda._pin_memory_utils import unpin_memory as unpin

    unpin(address)


# Every private name above, as (module path, attribute path): what `tests/unit/test_torch_private.py` checks exists.
FENCED: tuple[tuple[str, str], ...] = (
    ("torch._C", "_get_sdp_priority_order"),
    ("torch._C", "_set_sdp_priority_order"),
    *(("torch.ops.aten", name) for name in SDPA_KERNEL_NAMES),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_backward"),
    ("torch.ops.aten", "_scaled_dot_product_efficient_attention_backward"),
    ("torch.ops.aten", "_scaled_dot_product_cudnn_attention_backward"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    ("torch.ops.aten", GROUPED_MM_NAME),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch._dynamo", "lookup_backend"),
    ("torch._dynamo", "maybe_mark_dynamic"),
    ("torch.nn.modules.batchnorm", "_NormBase"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed._symmetric_memory", "rendezvous"),
    ("torch.cuda.memory", "_set_allocator_settings"),
    ("torch.cuda", "_is_in_bad_fork"),
    ("torch.cuda._pin_memory_utils", "pin_memory"),
    ("torch.cuda._pin_memory_utils", "unpin_memory"),
)
