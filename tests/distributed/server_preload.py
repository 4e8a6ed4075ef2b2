"""Imported once by the fork server every rank is forked from (harness._PRELOAD, last): what each rank's first case
would otherwise pay for itself, done before any rank exists, so that every rank of every case starts from this same
state, warm.

Measured on one ZeRO-2 parity case at world 2 (CPU seconds of one rank): 0.7 s importing what the server had not
(peft, which the adapter check imports on every run; DeepSpeed's expert-parallel modules), 0.9 s in two full
`gc.collect()` over the ~550k objects of the imported libraries (DeepSpeed's ZeRO set-up and the workers' own), and
DeepSpeed's op-compatibility probe, which compiles test programs (subprocesses) on the first read.
"""

import gc
import weakref

import deepspeed.module_inject.auto_ep_layer  # noqa: F401 - imported by the first DeepSpeed engine
import deepspeed.utils.nvtx
import peft  # noqa: F401
from deepspeed.accelerator import get_accelerator

import lightning_ulysses  # noqa: F401
import tests.distributed.common  # noqa: F401
import tests.distributed.packed  # noqa: F401
from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.integration import console

# (its "Setting accelerator to CPU" warning and the linker errors the probe means to discard: the server's stderr is
# the test session's)
with console.quiet_compiler_probes():
    get_accelerator()  # DeepSpeed's accelerator detection, kept in its module
    deepspeed_private.compatible_ops()  # the probe's answers, kept in deepspeed.ops (the strategy reads them)

# DeepSpeed wraps its ZeRO bookkeeping in NVTX ranges (a push and a pop around each of ~1000 calls per step); on CPU
# they mark nothing. Profiling and markers only: no result depends on them.
deepspeed.utils.nvtx.enable_nvtx = False

# The finalizers of what is alive now (torch.library's deregister every op library the imports registered: ~190 at
# ~1 ms each, 0.3 s at every rank's exit) are this server's: a rank ending does not run them (it ends with the process,
# as a forked process does; harness._as_script runs only the exit functions, and the finalizers made in the rank).
for finalizer in [candidate for candidate in gc.get_objects() if type(candidate) is weakref.finalize]:
    finalizer.atexit = False

# Everything alive now lives as long as a rank: frozen (tests.distributed.common.settle_heap), DeepSpeed's
# `gc.collect()` at every ZeRO engine's set-up and the workers' own collections do not walk it again.
gc.collect()
gc.freeze()
