"""transformers' hub kernels (`use_kernels`) are suspended while lightning_ulysses has a model prepared.

A model with `use_kernels` on is kernelized again by transformers at every `train()`/`eval()` that changes its mode,
and kernelizing resets the forward of every layer that has a kernel slot (`kernels`' `use_kernel_forward_from_hub`:
the RMSNorms of most families, Qwen3.5's Gated DeltaNet, ...) to its class's or the hub kernel's: it deletes the
forward lightning_ulysses installed on that instance. Measured with transformers 5.25: the first `eval()` after
preparation (Lightning's sanity check or validation) removed the split of Qwen3.5's Gated DeltaNet layers (at SP > 1
each rank would then run them over its shard as if it were the whole sequence: silently wrong) and every low-memory
norm. `from_pretrained` turns `use_kernels` on by default from transformers 5.25 on (wherever the `kernels` package,
one of its dependencies, is installed, unless `USE_HUB_KERNELS` is off); up to 5.24 only when asked for.

So while a model is prepared its hub kernels are off (`model.use_kernels = False`: from 5.25 on the layers get their
transformers forwards back, up to 5.24 the kernels already in place stay but are no longer re-applied), and the
undo turns them on again. A prepared model runs the torch implementations that lightning_ulysses is verified
against (and the mamba_ssm / flash-linear-attention / causal-conv1d packages where installed, which transformers
calls without kernelizing).
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn


def suspend_hub_kernels(model: nn.Module) -> Optional[Callable[[], None]]:
    """Turn off `use_kernels` on every transformers model in `model` that has it on; returns the undo (None when
    none had it on: nothing to undo, e.g. a model already suspended by an earlier preparation step)."""
    kernelized = [module for module in model.modules() if getattr(module, "use_kernels", False) is True]
    if not kernelized:
        return None
    for module in kernelized:
        module.use_kernels = False

    def resume() -> None:
        for module in kernelized:
            module.use_kernels = True

    return resume
