"""Every private DeepSpeed name lightning_ulysses relies on, in one place.

DeepSpeed changes its internals (module globals, name-mangled methods, underscore attributes) without deprecation,
so nothing else in the package touches one: it calls the accessor here. Each entry says what it is and why no public
API serves. All were checked against deepspeed `DEEPSPEED_CHECKED`; `tests/unit/test_deepspeed_private.py` fails
when the installed DeepSpeed removes or renames any of them (re-check the reason given here before changing an
accessor to follow it), and `tests/unit/test_layers.py` fails when a module outside this one names them.

DeepSpeed is imported inside each accessor, not here: importing it is slow and prints (the accelerator it
detects), and the core modules that import this one (`memory`) must load without it; `console` installs its
filters before the strategy first calls into DeepSpeed.

Public DeepSpeed API stays where it is used: `deepspeed.initialize`, `deepspeed.zero.GatheredParameters`,
`deepspeed.ops.adam.DeepSpeedCPUAdam`, `deepspeed.comm`, `deepspeed.accelerator.get_accelerator`,
`deepspeed.utils.zero_to_fp32`, `DeepSpeedEngine` and its documented methods, and the ZeRO-3 parameter attributes
`ds_id` / `ds_shape` / `ds_numel` (no underscore; what DeepSpeed's own docs and `GatheredParameters` users read).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

DEEPSPEED_CHECKED = "0.19.8"

# -- ZeRO-3 leaf modules ---------------------------------------------------------------------------------------------
# `deepspeed.utils.set_z3_leaf_module(module, True)` / `z3_leaf_module(module)` are the public spelling; they import
# DeepSpeed, which the memory engine must not (it also serves models used without the strategy). The mark they set
# and read is this attribute (`deepspeed/utils/z3_leaf_module.py`).
Z3_LEAF_ATTRIBUTE = "_z3_leaf"


def mark_z3_leaf(module: nn.Module) -> None:
    """`module._z3_leaf = True`, as `deepspeed.utils.set_z3_leaf_module(module, True)` sets it: ZeRO-3 then gathers
    the module's parameters whole around its forward and backward (hooks registered at `deepspeed.initialize`)."""
    setattr(module, Z3_LEAF_ATTRIBUTE, True)


def is_z3_leaf(module: nn.Module) -> bool:
    """`deepspeed.utils.z3_leaf_module(module)`, read without importing DeepSpeed."""
    return bool(getattr(module, Z3_LEAF_ATTRIBUTE, False))


# -- the model-parallel unit of the last engine ----------------------------------------------------------------------
def registered_mpu() -> Any:
    """`deepspeed.utils.groups.mpu`: the module global where `deepspeed.initialize` keeps the last engine's `mpu`;
    DeepSpeed only ever overwrites it with a non-None one, and there is no public reset."""
    from deepspeed.utils import groups

    return groups.mpu


def register_mpu(mpu: Any) -> None:
    """Set `deepspeed.utils.groups.mpu`: before `deepspeed.initialize` (so that an engine without SP after one with
    it does not reduce over the stale groups), and back to None when the strategy releases its groups."""
    from deepspeed.utils import groups

    groups.mpu = mpu


# -- the ops DeepSpeed may build --------------------------------------------------------------------------------------
def compatible_ops() -> dict[str, bool]:
    """`deepspeed.ops.__compatible_ops__`: op name → whether DeepSpeed may build it, the dict `build_shm_op`
    (`deepspeed/comm/torch.py`) reads before compiling the CPU shared-memory all-reduce; no public switch.
    Its first read probes every op by compiling test programs (`deepspeed/ops/__init__.py`, a lazy module
    attribute): the caller decides what to do with their output. Returned as the live dict, to be changed in place."""
    import deepspeed.ops

    return deepspeed.ops.__compatible_ops__


# -- freeing an engine ----------------------------------------------------------------------------------------------
# The engine attributes holding its forward hooks on the user's module and its dataloader check
# (`DeepSpeedEngine.__init__`): `destroy()` leaves them registered, so the user's module keeps the engine alive.
ENGINE_HOOK_HANDLES = ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check")


def remove_engine_hooks(engine: Any) -> None:
    """Remove the hooks `ENGINE_HOOK_HANDLES` names (those the engine holds a handle to; there is no public call)."""
    for name in ENGINE_HOOK_HANDLES:
        handle = getattr(engine, name, None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()


def forget_forward_module(module: nn.Module) -> None:
    """Drop `module` from `deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK`, the module global ZeRO-3
    pushes the engine's module onto before its forward and pops after it (so a forward that raised leaves it
    there), which keeps the engine alive (DESIGN-NOTES, 2026-12-02); nothing public resets it. Tolerates its absence
    (a DeepSpeed without it holds no such reference)."""
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
    stack[:] = [m for m in stack if m is not module]


def clear_params_to_release_cache() -> None:
    """Clear `PartitionedParameterCoordinator.__params_to_release`'s `lru_cache` (name-mangled, keyed on
    (coordinator, submodule, step): it keeps every engine's coordinator alive; a cache only, recomputed by the
    engines still running). Wrapped by DeepSpeed's `instrument_w_nvtx`, which does not `functools.wraps`: the cache
    is then a cell of the wrapper's closure. Tolerates its absence."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    cached = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    if cached is not None:
        _clear_lru_cache(cached)


def _clear_lru_cache(function: Callable[..., Any]) -> None:
    if hasattr(function, "cache_clear"):
        function.cache_clear()
        return
    for cell in getattr(function, "__closure__", None) or ():
        inner = cell.cell_contents
        if callable(inner) and hasattr(inner, "cache_clear"):
            inner.cache_clear()


# -- export -------------------------------------------------------------------------------------------------------
def consolidated_16bit_state_dict(engine: Any) -> Optional[dict[str, Any]]:
    """`DeepSpeedEngine._zero3_consolidated_16bit_state_dict()`: a ZeRO-3 model's whole 16-bit state dict on global
    rank 0 (None elsewhere), gathered one module at a time. A collective: every rank calls it. The public
    `save_16bit_model` wraps it but only writes a file (with `torch.save`), where the export needs the tensors."""
    return engine._zero3_consolidated_16bit_state_dict()


# Every private name above, as (module path, attribute path): what `tests/unit/test_deepspeed_private.py` checks
# exists and `tests/unit/test_layers.py` refuses outside this module.
FENCED: tuple[tuple[str, str], ...] = (
    ("deepspeed.utils.z3_leaf_module", "set_z3_leaf_module"),  # sets Z3_LEAF_ATTRIBUTE (checked by behaviour)
    ("deepspeed.utils.groups", "mpu"),
    ("deepspeed.ops", "__compatible_ops__"),
    ("deepspeed.runtime.zero.parameter_offload", "FWD_MODULE_STACK"),
    ("deepspeed.runtime.zero.partitioned_param_coordinator",
     "PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._zero3_consolidated_16bit_state_dict"),
)
