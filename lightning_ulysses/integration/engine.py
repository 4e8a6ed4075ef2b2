"""The run's DeepSpeed engine, as `UlyssesDeepSpeedStrategy` starts and frees it: started with our `mpu` (without it
ZeRO reduces and partitions as if every rank held different data) and the device rank, which Lightning leaves None on
CPU (DeepSpeed then crashes comparing None >= 0); freed with the Trainer, which DeepSpeed's own references prevent;
and, on CPU, spared the shared-memory op build that training never uses. Every DeepSpeed internal this needs is
reached through `_deepspeed_private`.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.integration import console
from lightning_ulysses.parallel.layout import SequenceParallelGroups


def deepspeed_engine_type() -> type:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def skip_shared_memory_all_reduce_build(quiet: bool = True) -> None:
    """On CPU, DeepSpeed's backend compiles its shared-memory all-reduce op when the process group starts
    (`deepspeed/comm/torch.py: build_shm_op`): C++ against torch's headers, ~140 s of CPU on the first run of a
    machine, with every rank waiting on the build lock, and a compiler required. Only DeepSpeed-inference's
    `inference_all_reduce` uses it, which training never calls. Marked incompatible, the op is not built and
    `inference_all_reduce` falls back to torch's all-reduce; the flag is DeepSpeed's own (`__compatible_ops__`,
    which `build_shm_op` reads). Its first read probes every op by compiling test programs; `quiet`: with their
    linker errors discarded (`console.quiet_compiler_probes`)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        with console.quiet_compiler_probes() if quiet else contextlib.nullcontext():
            compatible_ops = deepspeed_private.compatible_ops()
        compatible_ops[builder.NAME] = False


def initialize(groups: SequenceParallelGroups, device_rank: int, **kwargs: Any) -> tuple[tuple[Any, ...], Any]:
    """`deepspeed.initialize(**kwargs)` as Lightning calls it (2.6) plus the `mpu` of `groups` (None at SP 1) and the
    device rank: (what it returns, the mpu)."""
    import deepspeed

    mpu = groups.deepspeed_mpu() if groups.sequence_parallel_world_size > 1 else None
    # DeepSpeed keeps the last engine's mpu in a module global and only overwrites it with a non-None one:
    # clear it so an SP-1 engine after an SP-2 engine in one process does not reduce over stale groups.
    deepspeed_private.register_mpu(mpu)
    return deepspeed.initialize(args=argparse.Namespace(device_rank=device_rank), mpu=mpu, dist_init_required=False,
                                **kwargs), mpu


def forget_mpu(mpu: Optional[Any]) -> None:
    """Clear DeepSpeed's global mpu where it is still `mpu` (set by `initialize`): its groups are being released."""
    registered = deepspeed_private.registered_mpu()
    if registered is not None and registered is mpu:
        deepspeed_private.register_mpu(None)


def release(engine: Any) -> None:
    """Let the run's DeepSpeed engine be freed with the Trainer: DeepSpeed's own references keep it alive for the life
    of the process otherwise (DESIGN-NOTES, 2026-12-02, engines), with its optimizer state and buffers.
    `engine.destroy()` removes the ZeRO gradient-accumulation hooks (the ZeRO-2 cycle through autograd nodes, which
    gc does not walk) and the ZeRO-3 module hooks; the engine's own forward hooks on the user's module and ZeRO-3's
    module stack and `__params_to_release` cache are dropped here. Local to each rank, no collective: also after a
    failed run. Anything else than a DeepSpeed engine is left alone. Where the DeepSpeed internals this relies on
    moved, a warning says the engine stays in memory: a leak, not a reason to fail the run."""
    try:
        if not isinstance(engine, deepspeed_engine_type()):
            return
        engine.destroy()
        deepspeed_private.remove_engine_hooks(engine)
        deepspeed_private.forget_forward_module(engine.module)
        deepspeed_private.clear_params_to_release_cache()
    except Exception as error:
        rank_zero_warn(f"lightning_ulysses: the DeepSpeed engine of this run could not be freed ({error!r}); it"
                       " stays in memory until the process ends.")
