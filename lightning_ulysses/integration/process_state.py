"""What a run replaces for the whole process, put back at its end: `ProcessWideState`.

A run of the strategy changes two things beyond the user's modules that outlive it unless undone:
- DeepSpeed's `zero.Init`, which Lightning enters around `configure_model` under ZeRO-3 (`model_sharded_context`),
  sets `torch.nn.functional.linear` to its ZeRO-3 linear (and, with its quantized initialisation, wraps
  `torch.nn.functional.embedding` too) and leaves them so for the rest of the process: its own `__exit__` puts back
  every other function it patched, not these ("This will persist unless manually reset": deepspeed 0.19.8
  `runtime/zero/partition_parameters.py`, `_enable_mem_efficient_linear`). A later run in the process (a notebook's
  next cell, ZeRO-2 after ZeRO-3, FSDP2) and any plain torch code then compute every `nn.Linear` with DeepSpeed's
  autograd function, which adds the bias in place (so a biased linear keeps no product for the memory engine).
- `memory.expandable_segments`: the CUDA allocator's setting and `PYTORCH_CUDA_ALLOC_CONF`
  (`memory.apply_allocator_settings`, which returns its own undo).

The functions are taken as the run finds them (the strategy's `setup_environment`, the first hook of every run, before
`configure_model`) and put back at its teardown, which Lightning runs after an exception too: the run itself keeps
DeepSpeed's linear from `configure_model` on, as a run alone in its process does. Everything else a run sets up
process-wide undoes itself (the SDPA kernel order and the FA4 choice are entered per step and restored on exit,
DeepSpeed's `mpu` global is cleared with the groups, the engine's hooks are removed with it, the models' attention,
loss and mixers are given back by the preparation's undo). What stays on purpose: the `"ulysses"` names added to
transformers' attention registries (no existing name changes) and the console filters of `quiet_third_party`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# (owner, name) of every function a library replaces during a run and leaves replaced (module docstring).
LEFT_REPLACED: tuple[tuple[Any, str], ...] = ((torch.nn.functional, "linear"), (torch.nn.functional, "embedding"))


class ProcessWideState:
    """The functions of `LEFT_REPLACED` as a run found them, and the undo of anything else the run changed for the
    process (`add_undo`); `restore()` puts it all back, once."""

    def __init__(self) -> None:
        self._functions: Optional[dict[tuple[Any, str], Any]] = None
        self._undo: list[Callable[[], None]] = []

    def take(self) -> None:
        """At the start of a run, before anything of it changes the process (a run after a failed one, whose
        teardown did not come, puts that one's leftovers back first)."""
        self.restore()
        self._functions = {(owner, name): getattr(owner, name) for owner, name in LEFT_REPLACED}

    def add_undo(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def restore(self) -> None:
        """Put back what `take` found and run the undos, last first. Nothing when nothing was taken."""
        functions, self._functions = self._functions, None
        for (owner, name), function in (functions or {}).items():
            if getattr(owner, name) is not function:
                setattr(owner, name, function)
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()
