"""Our PyTorch kernels in place of transformers' costly fallbacks, for the calls of prepared mixers.

A family's mixer calls its recurrence by a module-level name of its modeling file, which transformers binds at
import: to the fused kernel's package where it is installed, else to its own PyTorch fallback. Two fallbacks cost
what ours do not:
- `torch_chunk_gated_delta_rule` (Gated DeltaNet, KDA's families; fla's kernel where installed): its backward is
  quadratic in the row's length; ours (delta_rule.py) computes the same operations in the same order, linear in it;
- `mamba2_chunk_scan` (every Mamba2 family: Mamba2, Nemotron-H, Bamba, Zamba2, Falcon-H1, Granite-MoE-hybrid;
  mamba_ssm's `mamba_chunk_scan_combined` where installed): it leaves autograd about 1 MB per token per layer;
  ours (ssd.py) keeps its inputs and one state per block, and recomputes a block at a time in backward.
For the duration of a prepared mixer's call — and only where the name is still bound to transformers' fallback —
the name is bound to ours. fla's and mamba_ssm's kernels, where installed, are never replaced; the model outside our
calls (and every other model) sees the module unchanged.

Why a scoped rebinding rather than a copy of the family's forward: the forward is the family's own code, wrapped in
transformers' decorators, and stays so (mixers/head_split.py: the view runs the family's code).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator

import torch

from lightning_ulysses.mixers.delta_rule import chunk_gated_delta_rule
from lightning_ulysses.mixers.ssd import mamba2_chunk_scan

# transformers' fallback's name in a modeling file → ours
LINEAR_TIME: dict[str, Callable] = {"torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
                                    "mamba2_chunk_scan": mamba2_chunk_scan}


def _function_behind(bound: object) -> object:
    """What a module-level name calls: the object itself, or, where the `kernels` package is installed (a dependency
    of transformers from 5.25 on), the function `kernels` turned into a module instance: `use_kernel_forward_from_hub`
    on a function returns an `nn.Module` (class attribute `kernel_layer_name`) whose forward calls that function
    (a closure variable, `func`) unless a model kernelized it; the name then no longer carries the function's name."""
    if isinstance(bound, torch.nn.Module) and hasattr(type(bound), "kernel_layer_name"):
        return inspect.getclosurevars(type(bound).forward).nonlocals.get("func", bound)
    return bound


def _is_transformers_fallback(bound: object, name: str) -> bool:
    """Whether the name calls transformers' own PyTorch function. transformers binds it to a wrapper carrying that
    function's name (`use_kernel_func_from_hub_with_fallback`) whether or not fla is installed; the wrapper calls
    `implementation` (closure variables), fla's function where fla imports, else `torch_function` itself."""
    function = _function_behind(bound)
    if not (getattr(function, "__name__", None) == name
            and getattr(function, "__module__", "").startswith("transformers.")):
        return False
    behind = inspect.getclosurevars(function).nonlocals if inspect.isfunction(function) else {}
    if "implementation" in behind and "torch_function" in behind:
        return behind["implementation"] is behind["torch_function"]
    return True  # the function itself (no wrapper)


class LinearTimeKernels:
    """The names of `module_class`'s modeling file that are bound to a quadratic transformers fallback, and
    `in_place()`, which binds them to ours for the duration of a call."""

    def __init__(self, module_class: type[torch.nn.Module], replacements: dict[str, Callable] = LINEAR_TIME):
        self.namespace = inspect.unwrap(module_class.forward).__globals__
        self.replacements = {name: ours for name, ours in replacements.items()
                             if _is_transformers_fallback(self.namespace.get(name), name)}

    @contextlib.contextmanager
    def in_place(self) -> Iterator[None]:
        if not self.replacements:
            yield
            return
        bound = {name: self.namespace[name] for name in self.replacements}
        self.namespace.update(self.replacements)
        try:
            yield
        finally:
            self.namespace.update(bound)
