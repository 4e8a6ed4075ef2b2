"""Start the ranks of `UlyssesDeepSpeedStrategy` by forking the current process, for Jupyter notebooks.

`Trainer(strategy="ulysses_notebook")` (or `UlyssesDeepSpeedStrategy(start_method="fork")`) uses this launcher:
Lightning's own `_MultiProcessingLauncher` with start method "fork" (what `ddp_notebook` uses). Each forked rank
runs the strategy's `setup_environment` → `setup_distributed` exactly as a script rank does, so the SP/DP groups,
DeepSpeed and the process group only ever exist in the ranks, and the notebook's process can fit again. On top
of Lightning's launcher:

- it refuses, before any process starts, what a forked rank cannot survive: no `fork` on this platform, CUDA
  already initialised in the parent, `torch.distributed` already initialised in the parent; and each rank checks
  first thing for the case the parent cannot see (CUDA queried before Lightning made that query fork-safe);
- every launch gets a fresh MASTER_PORT, and the parent's environment is left as it was, so a second Trainer in
  the same kernel does not reuse the port of the first one;
- after fit, the weights rank 0 sends back to the parent's LightningModule are gathered first under ZeRO-3 (each
  rank only holds a partition); under DeepSpeed's 16-bit precisions they are the module's 16-bit weights, not
  the fp32 master weights, and a warning says so.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ulysses.fences import _lightning_private as lightning_private
from lightning_ulysses.fences import _torch_private as torch_private

_RUN_AS_SCRIPT = (
    "run the training as a script, where every rank is a fresh process: Trainer(strategy='ulysses') in"
    " `python train.py` (e.g. `python recipes/train.py trainer.devices=2`)"
)


def check_start_method(start_method: Any) -> Optional[str]:
    if start_method not in (None, "fork"):
        raise ValueError(f"start_method must be None (script launch) or 'fork' (notebooks), got {start_method!r}.")
    return start_method


def check_fork_available() -> None:
    """Raise if this platform cannot fork processes (Windows)."""
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError(
            "strategy='ulysses_notebook' (start_method='fork') starts its ranks by forking this process, and this"
            f" platform cannot fork (available start methods: {', '.join(mp.get_all_start_methods())})."
            f" Instead, {_RUN_AS_SCRIPT}."
        )


def check_parent_can_fork() -> None:
    """Raise if a child forked from this process could not run a rank; called right before forking."""
    check_fork_available()
    # Lightning's `_check_bad_cuda_fork` only detects a process that *is* a bad fork child; a parent that has
    # created a CUDA context passes it, and then every child dies with "Cannot re-initialize CUDA in forked
    # subprocess". On a GPU machine DeepSpeed uses CUDA even when Lightning trains on CPU, so refuse in both cases.
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "strategy='ulysses_notebook' forks this process to start its ranks, but CUDA is already initialised here"
            " (a tensor or model was moved to the GPU, or torch.cuda was used, before trainer.fit), and forked"
            " processes cannot use CUDA. Restart the kernel and keep everything on the CPU until trainer.fit (the"
            f" Trainer moves the model to each rank's GPU itself), or {_RUN_AS_SCRIPT}."
        )
    # The children would inherit this process group (and DeepSpeed's handle on it) instead of creating their own.
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "strategy='ulysses_notebook' forks this process to start its ranks, but torch.distributed is already"
            " initialised here (by an earlier in-process run, e.g. a script-launch strategy or DeepSpeed), and the"
            " forked ranks would inherit that process group. Run every distributed fit of this session with"
            " strategy='ulysses_notebook' (it forks at devices=1 too, so this process never joins a process group),"
            " or call torch.distributed.destroy_process_group() before this fit, or restart the kernel."
        )


def configure_launcher(strategy) -> bool:
    """Set the strategy's launcher where the script launch cannot serve; False: leave it to Lightning's own.

    `start_method="fork"` forks the ranks (`UlyssesForkLauncher`; the children run setup_environment →
    setup_distributed exactly like script ranks). In a notebook or an interactive session one rank needs no launch
    (it runs in this process, so a single-GPU notebook works unchanged — Lightning would refuse any script launcher
    there, even one that starts nothing); more ranks are refused, naming the fork launch (Lightning's own refusal
    suggests strategy='ddp_notebook', which has no sequence parallelism)."""
    if strategy.start_method == "fork":
        lightning_private.set_launcher(strategy, UlyssesForkLauncher(strategy))
        return True
    if not lightning_private.is_interactive():
        return False
    if strategy.num_processes * strategy.num_nodes == 1:
        lightning_private.set_launcher(strategy, None)
        return True
    raise RuntimeError(
        f"{type(strategy).__name__} with the script launch cannot start ranks from a notebook or an interactive"
        " session. Use Trainer(strategy='ulysses_notebook') or UlyssesDeepSpeedStrategy(..., start_method="
        "'fork'), which forks this process, or run the training as a script."
    )


class UlyssesForkLauncher(lightning_private.MultiProcessingLauncher):
    """Lightning's fork launcher with the checks, port handling and ZeRO-3 weight return described above."""

    def __init__(self, strategy: "pl.strategies.ParallelStrategy") -> None:
        check_fork_available()  # at Trainer construction: fail before anything runs
        super().__init__(strategy, start_method="fork")

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        check_parent_can_fork()
        environment = lightning_private.launcher_strategy(self).cluster_environment
        user_port = os.environ.get("MASTER_PORT")
        if user_port is None and type(environment) is LightningEnvironment:
            # LightningEnvironment caches the port it picked; the base launcher exports it as MASTER_PORT for the
            # children. Forget it so this launch (a re-launch of the same Trainer, e.g. validate after fit) picks a
            # free port again instead of the one the last launch's rank 0 was bound to.
            lightning_private.forget_main_port(environment)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            # The base launcher sets MASTER_PORT in this (the parent's) environment; a second Trainer would read it
            # back and reuse the port. Leave the environment as the user had it.
            if user_port is None:
                os.environ.pop("MASTER_PORT", None)
            else:
                os.environ["MASTER_PORT"] = user_port

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        # In each forked rank, first thing. The parent passed `check_parent_can_fork`, but CUDA can also be
        # "poisoned" for forks without counting as initialised: torch.cuda.is_available() called before Lightning
        # was imported (Lightning switches it to NVML, which is fork-safe) queries the CUDA runtime. The rank would
        # then die deep inside setup with "Cannot re-initialize CUDA in forked subprocess"; say what to do instead.
        if torch_private.in_bad_fork():
            raise RuntimeError(
                "This rank was forked by strategy='ulysses_notebook' from a process that had already used CUDA (e.g."
                " torch.cuda.is_available() or a CUDA tensor before `import lightning`), and forked processes cannot"
                " use CUDA. Restart the kernel, import lightning (or lightning_ulysses) before touching torch.cuda, and"
                f" keep everything on the CPU until trainer.fit; or {_RUN_AS_SCRIPT}."
            )
        lightning_private.wrapping_function_above(UlyssesForkLauncher, self, process_idx, *args, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[lightning_private.WorkerOutput]:
        # Rank 0's state dict goes back to the parent, whose LightningModule loads it (after fit only).
        if trainer.state.fn != TrainerFn.FITTING:
            return lightning_private.collect_rank_zero_results_above(UlyssesForkLauncher, self, trainer, results)
        module = trainer.lightning_module
        half = sorted({str(p.dtype) for p in module.parameters() if p.dtype in (torch.float16, torch.bfloat16)})
        if half:
            # DeepSpeed casts the module itself to 16 bits; the fp32 master weights live in its optimizer.
            rank_zero_warn(
                f"The weights copied back to the notebook's LightningModule are the trained module's {'/'.join(half)}"
                " weights, not DeepSpeed's fp32 master weights (those stay in the optimizer of the forked ranks)."
                " To keep them, save a checkpoint during fit (e.g. a ModelCheckpoint callback)."
            )
        if not getattr(lightning_private.launcher_strategy(self), "zero_stage_3", False):
            return lightning_private.collect_rank_zero_results_above(UlyssesForkLauncher, self, trainer, results)
        # Under ZeRO-3 each rank holds only a partition of every parameter (the parameter itself is an empty
        # placeholder, which the parent could not load): gather the full parameters first. This is a collective;
        # every rank runs this method, and the base class saves rank 0's state dict inside the `with`. The full
        # model must fit in one rank's memory (notebook-sized models do).
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return lightning_private.collect_rank_zero_results_above(UlyssesForkLauncher, self, trainer, results)
