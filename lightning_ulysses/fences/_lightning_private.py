"""Every private Lightning name lightning_ulysses relies on, in one place.

Private names change without deprecation on any Lightning release, so nothing else in the package touches one:
it calls the accessor here. Each entry says why no public API serves. All were checked against lightning
`LIGHTNING_CHECKED`; `tests/unit/test_lightning_private.py` fails when the installed Lightning removes, renames
or re-signs any of them (re-check the reason given here before changing an accessor to follow it).

Overridden private methods are listed in `OVERRIDDEN`: Lightning calls them by name, so a rename would silently
stop calling ours (the test checks that each still exists with the same parameters). Lightning methods whose body
the strategy re-states are listed in `MIRRORED` with a digest of their source, so any change to them shows.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any, Callable, Optional

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from lightning.fabric.utilities import imports as _fabric_imports
from lightning.fabric.utilities import seed as _fabric_seed
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks as _remove_module_hooks
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, Sampler

LIGHTNING_CHECKED = "2.6.6"

# -- launch ------------------------------------------------------------------------------------------------------
# Lightning's fork launch (`strategy="ddp_notebook"`) exists only as this class, and Lightning has no launcher plug-in
# API; `notebook.UlyssesForkLauncher` subclasses it (overriding `_wrapping_function` and
# `_collect_rank_zero_results`, see `OVERRIDDEN`) and returns its results as `_WorkerOutput`.
MultiProcessingLauncher = _MultiProcessingLauncher
WorkerOutput = _WorkerOutput


def launcher_strategy(launcher: _MultiProcessingLauncher) -> "pl.strategies.Strategy":
    """`_MultiProcessingLauncher._strategy`: the strategy a launcher starts (no public accessor)."""
    return launcher._strategy


def forget_main_port(environment: LightningEnvironment) -> None:
    """`LightningEnvironment._main_port = -1`: the environment caches the free port it picked on first use and has
    no reset; a second launch from the same process must pick a free port again."""
    environment._main_port = -1


def set_launcher(strategy: Strategy, launcher: Any) -> None:
    """`Strategy._launcher`: `Strategy.launcher` is a read-only property, and `_configure_launcher` (overridden) is
    the only place Lightning asks a strategy for its launcher."""
    strategy._launcher = launcher


def is_interactive() -> bool:
    """`lightning.fabric.utilities.imports._IS_INTERACTIVE`: how Lightning decides it runs in a notebook (it refuses
    script launchers there); there is no public query. Read at each call, as Lightning's own checks read it."""
    return bool(_fabric_imports._IS_INTERACTIVE)


# -- DeepSpeedStrategy internals -----------------------------------------------------------------------------------
def validate_device_index_selection(devices: list["torch.device"]) -> None:
    """`lightning.fabric.strategies.deepspeed._validate_device_index_selection`: DeepSpeedStrategy's
    `setup_distributed` runs it unconditionally and it fails for CPU devices (no index); the strategy re-states
    `setup_distributed` to skip it on CPU and keeps Lightning's check on CUDA."""
    _validate_device_index_selection(devices)


def init_deepspeed_distributed(strategy: DeepSpeedStrategy) -> None:
    """`DeepSpeedStrategy._init_deepspeed_distributed`: the rest of Lightning's `setup_distributed` (environment
    variables, `deepspeed.init_distributed` with Lightning's backend, port and timeout)."""
    strategy._init_deepspeed_distributed()


def load_deepspeed_config(strategy: DeepSpeedStrategy, config: Any) -> Optional[dict[str, Any]]:
    """`DeepSpeedStrategy._load_config`: the config as Lightning reads it (a path, a dict, or the
    `PL_DEEPSPEED_CONFIG_PATH` variable); needed before `DeepSpeedStrategy.__init__`, which would otherwise see
    the `"ulysses"` block."""
    return strategy._load_config(config)


def restore_zero_state(strategy: DeepSpeedStrategy, checkpoint: Any, strict: bool) -> None:
    """`DeepSpeedStrategy._restore_zero_state`: copies a full state dict into ZeRO-3's partitioned parameters, one
    module at a time, from global rank 0 (Lightning's `load_full_weights` path; there is no public entry to it)."""
    strategy._restore_zero_state(checkpoint, strict=strict)


def init_model_parallel_distributed(strategy: ModelParallelStrategy) -> None:
    """`ModelParallelStrategy._setup_distributed`: the accelerator's environment, `reset_seed`, the world's ranks
    and the process group, without its two-dimensional (data × tensor parallel) mesh, which the FSDP2 strategy
    replaces by its DP × SP one (`setup_environment` does all four at once; no public method does the first three)."""
    strategy._setup_distributed()


def materialize_distributed_module(module: "torch.nn.Module", device: "torch.device") -> None:
    """`lightning.fabric.utilities.init._materialize_distributed_module`: what `ModelParallelStrategy.setup` runs on
    a module built on the meta device (its `reset_parameters` after `to_empty`)."""
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: list, device: "torch.device") -> None:
    """`lightning.fabric.utilities.optimizer._optimizers_to_device`, as `ModelParallelStrategy.setup` calls it."""
    _optimizers_to_device(optimizers, device)


def remove_module_hooks(model: "torch.nn.Module") -> None:
    """`lightning.pytorch.strategies.deepspeed.remove_module_hooks`: an undocumented helper Lightning runs before
    its inference engine; the strategy's `_initialize_deepspeed_inference` mirrors Lightning's and runs it too."""
    _remove_module_hooks(model)


# -- data and random state -----------------------------------------------------------------------------------------
def update_dataloader(dataloader: "DataLoader", sampler: "Sampler", mode: RunningStage) -> "DataLoader":
    """`lightning.pytorch.utilities.data._update_dataloader`: re-creates a DataLoader (also a subclass, with its own
    arguments) around another sampler, as Lightning does when it adds its DistributedSampler; no public function."""
    return _update_dataloader(dataloader, sampler, mode=mode)


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """`lightning.fabric.utilities.seed._collect_rng_states`: every generator Lightning tracks (torch, CUDA, numpy,
    Python) in the form Lightning restores; the public API only seeds."""
    return _fabric_seed._collect_rng_states(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """`lightning.fabric.utilities.seed._set_rng_states`: the inverse of `collect_rng_states`."""
    _fabric_seed._set_rng_states(states)


# -- the fit loop's position ----------------------------------------------------------------------------------------
def should_accumulate(trainer: "pl.Trainer") -> bool:
    """`trainer.fit_loop._should_accumulate()`: whether the current batch ends inside a gradient-accumulation window
    (no optimizer step after it). No public property; recomputing it from `accumulate_grad_batches` would have to
    repeat Lightning's rules (the epoch's last batch always steps — for a strategy whose `handles_gradient_accumulation`
    is False, as ours)."""
    return trainer.fit_loop._should_accumulate()


def epoch_batch_progress(trainer: "pl.Trainer") -> tuple[int, bool]:
    """`trainer.fit_loop.epoch_loop.batch_progress` (`_BatchProgress`): batches of the current epoch processed, and
    `is_last_batch`. The loops and their progress classes are private; no public "position in the epoch"."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.current.processed, progress.is_last_batch


def count_epoch_batches_as(trainer: "pl.Trainer", batches: int) -> None:
    """`trainer.fit_loop.epoch_loop.batch_progress` (`_BatchProgress`) restored from a checkpoint, moved so that its
    current epoch's `processed` counter is `batches`: every counter, current and total, shifted by as much (their
    differences, which tell the epoch loop where in a step the save happened, are kept). The same position in the
    epoch counted in batches of another size. Read by the epoch loop (`batch_idx`, the accumulation window:
    `current.ready % accumulate_grad_batches`, the epoch's end) after `setup_data`; private, with no public setter."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    shift = batches - progress.current.processed
    for counter in PROGRESS_COUNTERS:
        setattr(progress.current, counter, getattr(progress.current, counter) + shift)
        setattr(progress.total, counter, getattr(progress.total, counter) + shift)


def epochs_processed(trainer: "pl.Trainer") -> int:
    """`trainer.fit_loop.epoch_progress.current.processed` (`_Progress`): the counter Lightning sets the sampler's
    epoch from when an epoch begins (`trainer.current_epoch` reads `completed`, which differs inside `fit`)."""
    return trainer.fit_loop.epoch_progress.current.processed


# The layout of `checkpoint["loops"]["fit_loop"]` (the fit loop's `state_dict`) that `checkpoint.resumable_loops`
# rewrites: progress entries, each with `total` and `current` counters of these names.
FIT_LOOP_EPOCH_PROGRESS = "epoch_progress"
FIT_LOOP_BATCH_PROGRESS = "epoch_loop.batch_progress"
PROGRESS_COUNTERS = ("ready", "started", "processed", "completed")


# -- signals and the HPC checkpoint ---------------------------------------------------------------------------------
def flag_sigterm(trainer: "pl.Trainer") -> None:
    """`trainer._signal_connector.received_sigterm = True`: the flag Lightning's end-of-batch check reads;
    `Trainer.received_sigterm` is a read-only property."""
    trainer._signal_connector.received_sigterm = True


def collective_signal_handlers(trainer: "pl.Trainer") -> tuple[Callable, ...]:
    """Lightning's signal handlers that run collectives inside the handler (`_SignalConnector._sigterm_notifier_fn`
    broadcasts, `_slurm_sigusr_handler_fn` saves a checkpoint), as functions, to recognise them among the bound
    methods installed for a signal. There is no switch to install only the others."""
    connector = type(trainer._signal_connector)
    return connector._sigterm_notifier_fn, connector._slurm_sigusr_handler_fn


def composed_signal_handlers(signum: int) -> Optional[list]:
    """The handlers Lightning composed for `signum` (`_HandlersCompose.signal_handlers`), or None when the installed
    handler is not Lightning's composition."""
    return getattr(signal.getsignal(signum), "signal_handlers", None)


def hpc_save_path(trainer: "pl.Trainer") -> str:
    """`trainer._checkpoint_connector.hpc_save_path(folder)`: the next `hpc_ckpt_<n>.ckpt` name, the one
    `ckpt_path="hpc"` finds on resume."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


# -- ModelParallelStrategy's device mesh -------------------------------------------------------------------------
# `ModelParallelStrategy.setup_environment` builds its mesh into `_device_mesh` and hands it to the LightningModule's
# `_device_mesh` (read by its public `device_mesh` property); neither has a setter. The FSDP2 strategy builds its own
# DP × SP mesh in its place (`init_model_parallel_distributed` above) and hands it over the same way.
def device_mesh_of(strategy: ModelParallelStrategy) -> Any:
    """`ModelParallelStrategy._device_mesh` (None before it is built; the public property raises then)."""
    return strategy._device_mesh


def set_device_mesh(strategy: ModelParallelStrategy, mesh: Any) -> None:
    """`ModelParallelStrategy._device_mesh = mesh`."""
    strategy._device_mesh = mesh


def hand_device_mesh(lightning_module: "pl.LightningModule", mesh: Any) -> None:
    """`LightningModule._device_mesh = mesh`, as `ModelParallelStrategy.setup_environment` does."""
    lightning_module._device_mesh = mesh


# -- the base implementations of the overridden methods below ------------------------------------------------------
# An override (`OVERRIDDEN`) that adds to Lightning's behaviour calls the next class's method in the MRO: each of these
# is `super(owner, instance).<name>(...)`, from a method of class `owner`.
def configure_launcher_above(owner: type, strategy: Strategy) -> None:
    """`super(owner, strategy)._configure_launcher()`."""
    super(owner, strategy)._configure_launcher()


def wrapping_function_above(owner: type, launcher: _MultiProcessingLauncher, *args: Any, **kwargs: Any) -> None:
    """`super(owner, launcher)._wrapping_function(*args, **kwargs)`."""
    super(owner, launcher)._wrapping_function(*args, **kwargs)


def collect_rank_zero_results_above(owner: type, launcher: _MultiProcessingLauncher, trainer: "pl.Trainer",
                                    results: Any) -> Optional[_WorkerOutput]:
    """`super(owner, launcher)._collect_rank_zero_results(trainer, results)`."""
    return super(owner, launcher)._collect_rank_zero_results(trainer, results)


# -- private methods the package overrides (Lightning calls them by name) -----------------------------------------
# (owner, name, parameters): checked by the unit test; a change here means Lightning's caller changed too.
OVERRIDDEN: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    # The only point where a strategy chooses its launcher (fork launch, the one-rank notebook case).
    (DeepSpeedStrategy, "_configure_launcher", ("self",)),
    # ... and of the FSDP2 strategy, where the ranks Lightning's script launcher starts are marked (`faults.py`).
    (ModelParallelStrategy, "_configure_launcher", ("self",)),
    # Lightning's two `deepspeed.initialize` call sites; neither passes an `mpu`, and both pass `device_rank=None`
    # on CPU. The strategy re-states both with the same arguments plus those two.
    (DeepSpeedStrategy, "_setup_model_and_optimizer", ("self", "model", "optimizer", "lr_scheduler")),
    (DeepSpeedStrategy, "_initialize_deepspeed_inference", ("self", "model")),
    # The forked ranks' entry point and rank 0's result collection of the fork launch (notebook.py).
    (_MultiProcessingLauncher, "_wrapping_function",
     ("self", "process_idx", "trainer", "function", "args", "kwargs", "return_queue", "global_states")),
    (_MultiProcessingLauncher, "_collect_rank_zero_results", ("self", "trainer", "results")),
    # The epoch line of the rich progress bar (`callbacks.TrainingProgressBar`): no public hook sets the epoch total,
    # and Lightning's prints `max_epochs - 1` (`Epoch 0/-2` for a `max_steps` run).
    (RichProgressBar, "_get_train_description", ("self", "current_epoch")),
)


# Lightning methods whose bodies the strategy re-states with its changes (rather than calling them): the first 16
# hex digits of the sha256 of their `inspect.getsource` text, dedented, as checked. A different source means
# Lightning changed what the copy mirrors: compare, update the strategy's copy, then the digest.
MIRRORED: dict[tuple[type, str], str] = {
    # + skips `_validate_device_index_selection` on CPU, then builds the SP groups and the rank watchdog.
    (DeepSpeedStrategy, "setup_distributed"): "a7764dfde5c363d9",
    # + `mpu` and a CPU device rank (both `deepspeed.initialize` call sites).
    (DeepSpeedStrategy, "_setup_model_and_optimizer"): "d5b228d023b53b92",
    (DeepSpeedStrategy, "_initialize_deepspeed_inference"): "44374170d2e2a741",
    # UlyssesFSDPStrategy.setup: - the demand that configure_model be overridden (the strategy shards the models
    # itself) + the module pipeline and `fully_shard` before the optimizers exist.
    (ModelParallelStrategy, "setup"): "7a79a2378fefc19c",
}
