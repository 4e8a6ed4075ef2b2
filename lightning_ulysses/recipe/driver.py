"""What `recipes/train.py` does besides instantiating: runtime environment, early checks, the hardware-free plan."""

from __future__ import annotations

import dataclasses
import importlib.util
from contextlib import contextmanager
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_ulysses.attention.core import validate_head_counts
from lightning_ulysses.integration.checkpoint.protocol import PREVIOUS_SUFFIX, resolve_checkpoint, saved_global_step
from lightning_ulysses.integration.console import quiet_third_party  # noqa: F401  (recipes/train.py: before anything is built)
from lightning_ulysses.integration.export import ExportPretrained
from lightning_ulysses.integration.faults import EXIT_PREEMPTED
from lightning_ulysses.integration.pretrained import check_pretrained_folder
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.parallel.layout import ParallelLayout
from lightning_ulysses.parallel.run_spec import LIGHTNING_SUB_GROUP_SIZE, RunSpec, split_ulysses_block
from lightning_ulysses.planning import auto
from lightning_ulysses.planning.layer_kinds import features_the_layers_refuse
from lightning_ulysses.planning.planner import ModelShape, TrainingSetup, plan_memory

_RUNTIME_ENVIRONMENT = {
    "pytorch_cuda_alloc_conf": "PYTORCH_CUDA_ALLOC_CONF",
    "nccl_algo": "NCCL_ALGO",
    "nccl_buffsize": "NCCL_BUFFSIZE",
}


def apply_runtime_environment(runtime: DictConfig) -> None:
    """Export the runtime knobs that are set; a variable already in the environment wins over the config."""
    for key, variable in _RUNTIME_ENVIRONMENT.items():
        value = runtime.get(key)
        if value is not None:
            os.environ.setdefault(variable, str(value))


def _world_size(trainer: DictConfig) -> int:
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise ValueError(f"trainer.devices must be a number of devices for sequence parallelism, got {devices!r}")
    return devices * int(trainer.get("num_nodes", 1))


def _heads(spec: Any) -> tuple[int, int]:
    config = getattr(spec, "config", spec)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = getattr(config, "num_heads", None) or config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


class RecipeError(ValueError):
    """A setting the run cannot start with. `recipes/train.py` prints the message alone (no traceback) and exits 1,
    before Hydra makes the run folder (`CheckBeforeRunFolder`)."""


# What a missing (`???`) setting is, for the message that asks for it.
MISSING_SETTINGS = {
    "model.pretrained": "the model folder to fine-tune, one `save_pretrained` wrote (config.json, weights,"
                        " tokenizer): model.pretrained=<folder>. No folder yet? `python -m lightning_ulysses"
                        " example-finetune <folder>` writes a tiny model and data files, offline, and prints the"
                        " command that fine-tunes it",
    "data.files": "the data to train on (json, jsonl, parquet, arrow or txt; a file, a glob or a list):"
                  " data.files=<file>",
}


def check_before_run(cfg: DictConfig) -> None:
    """Everything the launching process can refuse from the config and the files it names, as `RecipeError`s:
    settings left `???`, a model folder that does not exist, bad layouts (`check_recipe`), and what the data module
    refuses when it is built (data files that match nothing, fields that do not hold what they are set for, a chat
    template that marks no assistant turns). `plan=true` needs the model only (and with `strategy.memory=auto` the
    free memory auto decides from, see `auto_choice`)."""
    _refuse_missing_settings(cfg)
    pretrained = cfg.model.get("pretrained")
    if pretrained is not None:
        try:
            check_pretrained_folder(str(pretrained), setting="model.pretrained")
        except OSError as error:
            raise RecipeError(str(error)) from error
    spec = _instantiate_settings(cfg.model, "model").spec
    try:
        layout = check_recipe(cfg, spec)
    except ValueError as error:
        raise RecipeError(str(error)) from error
    requested = strategy_memory(cfg)
    if cfg.plan and isinstance(requested, dict) and requested.get("auto"):
        auto_choice(cfg, spec, layout)
    if not cfg.plan:
        _instantiate_settings(cfg.data, "data")


def _refuse_missing_settings(cfg: DictConfig) -> None:
    settings = OmegaConf.to_container(cfg, resolve=False)  # some interpolations need a running Hydra job
    settings.pop("hydra", None)
    missing = [key for key in _missing(settings) if not cfg.plan or key.startswith("model.")]
    if not missing:
        return
    experiment = OmegaConf.select(cfg, "hydra.runtime.choices.experiment", default=None)
    needs = f"experiment={experiment} needs" if experiment else "the run needs"
    details = "".join(f"\n  {key}: {MISSING_SETTINGS.get(key, f'set it: {key}=...')}" for key in missing)
    raise RecipeError(f"{needs} {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not set"
                      f" (???):{details}")


def _missing(settings: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose value is `???` in `settings` (a config as plain containers)."""
    found = []
    for key, value in settings.items():
        if isinstance(value, dict):
            found += _missing(value, f"{prefix}{key}.")
        elif value == "???":
            found.append(f"{prefix}{key}")
    return found


def _instantiate_settings(node: DictConfig, group: str) -> Any:
    """`instantiate(node)`, the messages of what its constructor refuses (a missing file, a field, a value) as
    `RecipeError`s; anything else keeps its traceback."""
    from hydra.errors import InstantiationException

    try:
        return instantiate(node)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, (ValueError, KeyError, OSError)):
            raise RecipeError(str(cause.args[0]) if cause.args else f"{group}: {cause!r}") from cause
        raise


class CheckBeforeRunFolder(Callback):
    """Hydra callback (`hydra.callbacks` in conf/train.yaml): `check_before_run` before Hydra makes the run folder,
    so that a refused run leaves none behind and prints its message without a traceback (exit status 1). In a sweep
    (`-m`) every job is checked when it starts, after Hydra made its folder, which is removed again when the job is
    refused and holds nothing but Hydra's own files."""

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_or_exit(config, job_folder=None)

    @override
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            _check_or_exit(config, job_folder=Path(config.hydra.runtime.output_dir))


def _check_or_exit(config: DictConfig, job_folder: Optional[Path]) -> None:
    try:
        check_before_run(config)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        if job_folder is not None:
            _remove_if_only_hydras(job_folder, config)
        raise SystemExit(1) from None


def _remove_if_only_hydras(folder: Path, config: DictConfig) -> None:
    """Remove the job folder Hydra just made when it holds only what Hydra writes there (its `.hydra` subfolder and
    the job's log file): a folder with anything else in it (a named run's checkpoints) stays."""
    hydras = {config.hydra.output_subdir, f"{config.hydra.job.name}.log"}
    if folder.is_dir() and all(entry.name in hydras for entry in folder.iterdir()):
        shutil.rmtree(folder)


def check_recipe(cfg: DictConfig, spec: Any) -> ParallelLayout:
    """Reject bad combinations of overrides in the launching process, before any rank starts."""
    world = _world_size(cfg.trainer)
    size = cfg.strategy.get("sequence_parallel_size")
    if size is None and isinstance(cfg.strategy.get("config"), DictConfig):  # a DeepSpeed-Ulysses "ulysses" block
        _, size = split_ulysses_block(OmegaConf.to_container(cfg.strategy.config))
    size = size or int(cfg.trainer.get("devices", 1))
    layout = ParallelLayout(world_size=world, sequence_parallel_size=size)
    validate_head_counts(*_heads(spec), size)
    _check_schedule_applies(cfg)
    seq_len = cfg.data.get("seq_len")
    if seq_len and seq_len % size and cfg.strategy.get("sequence_padding", "pad") == "error":
        raise ValueError(
            f"data.seq_len={seq_len} is not divisible by strategy.sequence_parallel_size={size}: use a multiple of"
            f" {size} or strategy.sequence_padding=pad"
        )
    return layout


def export_callbacks(export: DictConfig, spec: Any, run_dir: Path) -> list:
    """The `export:` block as callbacks: `ExportPretrained` when enabled, with the tokenizer of the model's pretrained
    folder when it has one."""
    if not export.enabled:
        return []
    folder = getattr(spec, "pretrained", None)
    tokenizer = folder if folder and (Path(folder) / "tokenizer_config.json").exists() else None
    return [ExportPretrained(export.dir or str(run_dir / "export"), merged=export.merged, tokenizer=tokenizer)]


def strategy_memory(cfg: DictConfig) -> Any:
    """`strategy.memory` as the strategy takes it; `auto` (or `{auto: true, ...}`) gets the recipe's training length
    and micro-batch (`data.seq_len`, `data.batch_size`) unless given."""
    memory = cfg.strategy.get("memory")
    memory = OmegaConf.to_container(memory) if isinstance(memory, DictConfig) else memory
    if memory == "auto" or (isinstance(memory, dict) and memory.get("auto")):
        request = {"auto": True} if memory == "auto" else dict(memory)
        request.setdefault("seq_len", cfg.data.get("seq_len"))
        request.setdefault("micro_batch", int(cfg.data.get("batch_size", 1)))
        return request
    return memory


def _check_schedule_applies(cfg: DictConfig) -> None:
    """An optimizer in the DeepSpeed config replaces `configure_optimizers` (Lightning then never calls it), and
    with it `model.schedule`: refuse a schedule that would be dropped."""
    schedule = cfg.model.get("schedule")
    configs = [cfg.strategy.get("config_overrides"), cfg.strategy.get("config")]
    if schedule is None or (schedule.get("kind") == "constant" and not schedule.get("warmup_steps")):
        return
    if any(isinstance(config, DictConfig) and "optimizer" in config for config in configs):
        raise ValueError(
            f"schedule {schedule.get('kind')} (warmup {schedule.get('warmup_steps')}) would not apply: the DeepSpeed"
            " optimizer in the strategy's config replaces configure_optimizers. Use schedule=constant with a"
            " DeepSpeed `scheduler` block in strategy.config_overrides, or remove the DeepSpeed optimizer."
        )


def _shape(spec: Any, strict: bool = True) -> ModelShape:
    """A spec that knows its planner shape says it (`GPTConfig.planner_shape`); the Hugging Face specs carry a
    Llama-style or hybrid config. Asked of the spec, not of its class: the package does not import its example models.
    `strict=False`: a hybrid whose mixers have no declared costs is counted as attention layers (the plan's table, as
    before hybrids were declared) rather than refused (what `memory=auto` does)."""
    planner_shape = getattr(spec, "planner_shape", None)
    if callable(planner_shape):
        return planner_shape()
    try:
        return ModelShape.from_hf_config(spec.config)
    except ValueError:
        if strict:
            raise
        return ModelShape.from_hf_config(spec.config, hybrid=False)


# The strategy arguments that describe the run besides its layout (`RunSpec.of_strategy_arguments`).
_RUN_ARGUMENTS = ("config", "config_overrides", "stage", "offload_optimizer", "offload_optimizer_device",
                  "offload_parameters", "offload_params_device", "sub_group_size", "pin_memory", "reduce_scatter")


def described_run(cfg: DictConfig, layout: ParallelLayout, on_cuda: bool) -> RunSpec:
    """The run the recipe's strategy will describe at start-up: its layout, ZeRO stage and optimizer offload (the
    `strategy` block's arguments, its DeepSpeed `config` and `config_overrides`), precision and device; for the FSDP2
    strategy (`strategy=ulysses_fsdp`) its arguments as `UlyssesFSDPStrategy` reads them (what FSDP2 refuses is
    refused here too, before any process starts)."""
    facts = dict(layout=layout, device="cuda" if on_cuda else "cpu",
                 precision=str(cfg.trainer.get("precision", "32-true")))
    if str(cfg.strategy.get("_target_", "")).endswith("UlyssesFSDPStrategy"):
        arguments = OmegaConf.to_container(cfg.strategy, resolve=True)
        arguments.pop("_target_")
        return RunSpec.of_fsdp_arguments(arguments, **facts)
    arguments = {key: cfg.strategy.get(key) for key in _RUN_ARGUMENTS if cfg.strategy.get(key) is not None}
    arguments = {key: OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value
                 for key, value in arguments.items()}
    return RunSpec.of_strategy_arguments(arguments, **facts)


def plan(cfg: DictConfig) -> str:
    """Parameter count, layout, batch and the memory planner's per-GPU terms, from the config alone (meta device);
    with `strategy.memory=auto`, what auto would choose for this run (`auto_choice`) and the plan of that choice."""
    spec = instantiate(cfg.model).spec  # the module only keeps its spec: nothing is built (nor loaded)
    layout = check_recipe(cfg, spec)
    params = spec.num_parameters()
    nodes, devices = int(cfg.trainer.get("num_nodes", 1)), int(cfg.trainer.devices)
    micro, accumulate = int(cfg.data.get("batch_size", 1)), int(cfg.trainer.get("accumulate_grad_batches", 1))
    seq_len = int(cfg.data.get("seq_len", 0))
    global_batch = micro * accumulate * layout.data_parallel_size
    run = described_run(cfg, layout, on_cuda=False)  # the device matters to auto only (`auto_choice`)
    offload, sub_group_size = run.optimizer_share_on_host, run.sub_group_size or LIGHTNING_SUB_GROUP_SIZE
    requested = strategy_memory(cfg)
    choice = None
    if isinstance(requested, dict) and requested.get("auto"):
        choice, free_from = auto_choice(cfg, spec, layout)
        memory = choice.memory
        offload, sub_group_size = choice.offload_optimizer, choice.sub_group_size
    else:
        memory = MemoryOptions.coerce(requested)
    if cfg.model.get("activation_checkpointing") and not memory.activation_checkpointing:
        memory = dataclasses.replace(memory, activation_checkpointing=True)  # the model's own: same bytes
    setup = TrainingSetup(seq_len=seq_len, micro_batch=micro, sequence_parallel_size=layout.sequence_parallel_size,
                          data_parallel_size=layout.data_parallel_size, zero_stage=run.zero_stage,
                          offload_optimizer=offload, memory=memory, sub_group_size=sub_group_size,
                          backend=run.backend, reshard_after_forward=run.reshard_after_forward)
    memory_plan = plan_memory(_shape(spec, strict=False), setup)
    gib = 2**30
    lines = [
        f"model:        {type(spec).__name__}, {params / 1e9:.2f}B parameters",
        f"layout:       {nodes} node(s) × {devices} GPUs = {layout.world_size} ranks; {layout}",
        f"              SP groups (first): {layout.sequence_parallel_groups()[:2]}",
        f"sequence:     {seq_len} tokens, {seq_len // layout.sequence_parallel_size} per rank",
        f"batch:        micro {micro} × accumulation {accumulate} × DP {layout.data_parallel_size}"
        f" = {global_batch} sequences = {global_batch * seq_len / 1e6:.1f}M tokens per optimizer step",
    ]
    if choice is not None:
        lines += [f"memory=auto:  free memory {free_from}; what the strategy would choose at start-up:",
                  choice.report()]
    planned = "lightning_ulysses.planning.planner, of auto's choice" if choice is not None else "lightning_ulysses.planning.planner"
    lines += [
        f"memory/GPU:   {memory_plan.gpu_total / gib:.1f} GiB, optimizer states"
        f" {f'({offload:.0%} offloaded to CPU)' if offload else '(on GPU)'}; terms ({planned}):",
        memory_plan.table(),
    ]
    if offload or memory.offload_activations:
        lines.append(f"CPU/node:     {memory_plan.host_total * devices / gib:.0f} GiB host memory")
    return "\n".join(lines)


def auto_choice(cfg: DictConfig, spec: Any, layout: ParallelLayout) -> tuple[Any, str]:
    """What `strategy.memory=auto` would choose for this run (`lightning_ulysses.planning.auto.choose`, as the strategy calls
    it in its setup) and where the free memory it decides from came from: `strategy.memory.free_memory` when given
    (bytes per rank: `[device, host]`), else this machine's (a CPU run: its available memory over the node's ranks;
    a GPU run: GPU 0's free memory, where this machine has one). A GPU run planned on a machine without one is
    refused, naming `free_memory`, as is a run nothing fits (auto's own message)."""
    import torch

    request = auto.coerce_memory(strategy_memory(cfg))
    devices = int(cfg.trainer.devices)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    on_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    here = torch.device("cuda", 0) if on_cuda and torch.cuda.is_available() else None
    if request.free_memory is not None:
        free, free_from = request.free_bytes(here), "given (strategy.memory.free_memory)"
    elif not on_cuda:
        free, free_from = auto.measure_free_memory(torch.device("cpu"), devices), "of this machine's host"
    elif here is not None:
        free, free_from = auto.measure_free_memory(here, devices), f"of this machine's {torch.cuda.get_device_name(0)}"
    else:
        raise RecipeError(
            "plan=true with strategy.memory=auto shows what auto would choose from the free memory of the GPUs the"
            " run gets, and this machine has no GPU to measure: give it per rank, in bytes,"
            " ~strategy.memory +strategy.memory='{auto: true, free_memory: [<device>, <host>]}' (one H200 with 120"
            " GiB of host memory per rank: [1.48e11, 1.29e11]); or plan on a machine with the run's GPU.")
    priority = cfg.strategy.get("sdpa_kernel_priority")
    if not on_cuda:
        kernel = None
    elif priority == "auto":  # cuDNN on Hopper (auto_sdpa_kernel); with no GPU here to ask, Hopper is assumed
        kernel = "cudnn" if here is None or auto.auto_sdpa_kernel(here) == ("cudnn",) else None  # (the report says)
    else:
        kernel = list(priority)[0] if priority else None
    try:
        shape = _shape(spec)
        # fused_elementwise as `python -m lightning_ulysses plan --auto`: a GPU with Triton, and Llama-style (gated)
        # MLPs it fuses; a hybrid's layers refuse what `layer_kinds` says they refuse
        refused = features_the_layers_refuse(shape.layers)
        return auto.choose(shape, request, described_run(cfg, layout, on_cuda), free, kernel=kernel,
                           fused_elementwise=on_cuda and shape.gated_mlp and "fused_elementwise" not in refused,
                           refused=refused), free_from
    except ValueError as error:
        raise RecipeError(str(error)) from error


# -- the training run's callbacks, loggers, resume and console -----------------------------------------------------
def build_callbacks(cfg: DictConfig) -> list:
    """The `callbacks` block (by name, `null` entries skipped) and the checkpoint callback when the trainer
    checkpoints. (The strategy gives Lightning's default progress bar a max_steps run's totals.)"""
    callbacks = [instantiate(callback) for callback in (cfg.get("callbacks") or {}).values() if callback is not None]
    if cfg.trainer.get("enable_checkpointing", True) and cfg.get("checkpoint") is not None:
        callbacks.append(instantiate(cfg.checkpoint))
    return callbacks


def build_loggers(loggers: DictConfig, run_dir: Path, run_name: str) -> list:
    """CSV always; TensorBoard and W&B as `loggers` asks, each only when its package is installed (a one-line note
    when one is asked for by name and missing: training goes on with the others)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

    built = [CSVLogger(save_dir=run_dir, name="logs")]
    tensorboard = loggers.get("tensorboard", "auto")
    if tensorboard and _installed("tensorboard", "tensorboardX", asked=tensorboard is True, key="loggers.tensorboard"):
        built.append(TensorBoardLogger(save_dir=run_dir, name="tensorboard"))
    if loggers.get("wandb") and _installed("wandb", asked=True, key="loggers.wandb"):
        built.append(WandbLogger(save_dir=run_dir, name=run_name, project="lightning-ulysses"))
    return built


def _installed(*packages: str, asked: bool, key: str) -> bool:
    if any(importlib.util.find_spec(package) is not None for package in packages):
        return True
    if asked:
        rank_zero_info(f"lightning_ulysses: {key}=true but {' or '.join(packages)} is not installed: not logging"
                       f" there (pip install {packages[0]}, or {key}=false).")
    return False


class SavedCheckpoint(NamedTuple):
    """A complete checkpoint of the run and the global step it resumes at."""

    path: Path  # as `fit(ckpt_path=...)` takes it: `<name>.ckpt`, also when only its `.previous` copy is complete
    global_step: int


def checkpoint_folders(callbacks: list, run_dir: Optional[Path]) -> list[Path]:
    """Where a run's checkpoints are saved: every `ModelCheckpoint`'s folder (every n steps, epoch ends,
    `last.ckpt`) and the run folder, the Trainer's `default_root_dir`, where a scheduler's signal saves
    `hpc_ckpt_<n>.ckpt` (`faults.SchedulerSignals`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = [Path(c.dirpath) for c in callbacks if isinstance(c, ModelCheckpoint) and c.dirpath is not None]
    return list(dict.fromkeys(folders + ([Path(run_dir)] if run_dir is not None else [])))


def newest_checkpoint(folders: list[Path]) -> tuple[Optional[SavedCheckpoint], list[Path]]:
    """The complete checkpoint in `folders` (not their subfolders) that resumes furthest: the highest global step,
    the latest save among equal steps, whichever callback or handler saved it; and the checkpoints passed over as
    incomplete or unreadable. A save interrupted between its renames counts by its complete `.previous` copy;
    staging folders (`.partial`) are not checkpoints."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found: list[tuple[int, float, Path]] = []
    passed_over: list[Path] = []
    for folder in folders:
        names = {entry.name for entry in folder.iterdir()} if folder.is_dir() else set()
        for name in sorted(names):
            logical = name.removesuffix(PREVIOUS_SUFFIX)
            if not logical.endswith(ModelCheckpoint.FILE_EXTENSION) or (logical != name and logical in names):
                continue  # not a checkpoint; or the `.previous` copy beside a completed save (`commit` deletes it)
            try:
                complete = resolve_checkpoint(folder / logical) if (folder / name).is_dir() else folder / name
                found.append((saved_global_step(complete), complete.stat().st_mtime, folder / logical))
            except Exception:  # an interrupted save, a truncated file: nothing to resume from
                passed_over.append(folder / logical)
    newest = max(found, key=lambda candidate: candidate[:2], default=None)
    return (None if newest is None else SavedCheckpoint(newest[2], newest[0])), passed_over


def resume_from(resume: Optional[str], callbacks: list, run_dir: Optional[Path] = None) -> tuple[Optional[str], str]:
    """The checkpoint `trainer.fit` continues from, and the one line that says so: `auto` is the newest complete
    checkpoint of the run (`newest_checkpoint` over `checkpoint_folders`), else none; `None` starts afresh; anything
    else is a path."""

    if resume is None:
        _refuse_slurm_hpc_resume(run_dir)
        return None, "resume=null: starting afresh"
    if resume != "auto":
        try:
            given = Path(resume)
            step = saved_global_step(given if given.is_file() else resolve_checkpoint(given))
        except Exception:  # Lightning's load says what is wrong with the path
            return resume, f"resume: continuing from {resume}"
        return resume, f"resume: continuing from {resume} at step {step}"
    folders = checkpoint_folders(callbacks, run_dir)
    newest, passed_over = newest_checkpoint(folders)
    skipped = f" (passed over as incomplete: {', '.join(map(str, passed_over))})" if passed_over else ""
    if newest is None:
        searched = ", ".join(map(str, folders)) or "(checkpointing off)"
        return None, f"resume=auto: no complete checkpoint in {searched}: starting afresh{skipped}"
    return str(newest.path), f"resume=auto: continuing from {newest.path} at step {newest.global_step}{skipped}"


def _refuse_slurm_hpc_resume(run_dir: Optional[Path]) -> None:
    """Under SLURM, Lightning resumes `fit(ckpt_path=None)` from the highest `hpc_ckpt_<n>.ckpt` in
    `default_root_dir` whatever it is told: `resume=null` cannot start afresh in a run folder that has one."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    saved = sorted(Path(run_dir).glob("hpc_ckpt_*.ckpt")) if run_dir is not None else []
    if saved and SLURMEnvironment.detect():
        raise ValueError(
            f"resume=null, but {saved[-1]} is in the run folder, and under SLURM Lightning resumes from it whatever the"
            " recipe asks: remove the run folder's hpc_ckpt_*.ckpt, or start the run under a new name (run_name=...)."
        )


_RESUME_VARIABLE = "LIGHTNING_ULYSSES_RESUME_FROM"


@dataclasses.dataclass(frozen=True)
class ResumeDecision:
    """Where this process's `fit` starts, and whether it took that from the launching process."""

    path: Optional[str]  # what `trainer.fit(ckpt_path=...)` gets
    # This process is a rank the launching process started (Lightning's script launcher): it took the decision from
    # the environment, and its exit status is read by that launcher (see `end_preempted_run`).
    started_by_launching_process: bool


@contextmanager
def resume_decision(resume: Optional[str], callbacks: list, run_dir: Optional[Path] = None,
                    announce: Callable[[str], None] = print) -> Iterator[ResumeDecision]:
    """`resume_from`, decided once by the launching process, which `announce`s it in one line: the ranks Lightning
    starts from it inherit the decision through the environment (under `-m` their run folder is not rank 0's, so
    they would decide otherwise)."""
    inherited = os.environ.get(_RESUME_VARIABLE)
    if inherited is not None:
        path = inherited or None
    else:
        path, line = resume_from(resume, callbacks, run_dir)
        announce(line)
    os.environ[_RESUME_VARIABLE] = path or ""
    try:
        yield ResumeDecision(path, started_by_launching_process=inherited is not None)
    finally:
        if inherited is None:
            os.environ.pop(_RESUME_VARIABLE, None)


# -- a scheduler's signal -------------------------------------------------------------------------------------------
_RUN_OVERRIDES = re.compile(r"^\+{0,2}(run_name|resume|hydra\.sweep\.dir)=")
_HYDRA_PLAIN = re.compile(r"^[\w\-./:]+$")


def continue_command(argv: Sequence[str], run_name: str, executable: str = sys.executable,
                     sweep_dir: Optional[str] = None) -> str:
    """The command that continues this run after a preemption: the recipe's own command line (`argv`, as
    `sys.argv`) with the run named (the user's own `run_name=` kept as typed), `resume=auto`, and for a sweep (`-m`)
    its folder (`sweep_dir`) pinned, so that every job resumes its own folder."""
    given = {match.group(1): argument for argument in argv[1:] if (match := _RUN_OVERRIDES.match(argument))}
    kept = [argument for argument in argv[1:] if not _RUN_OVERRIDES.match(argument)]
    if sweep_dir is not None:
        pinned = [f"hydra.sweep.dir={_hydra_value(sweep_dir)}", *([given["run_name"]] if "run_name" in given else [])]
    else:
        pinned = [given.get("run_name", f"run_name={_hydra_value(run_name)}")]
    return shlex.join([executable, argv[0], *kept, *pinned, "resume=auto"])


def _hydra_value(value: str) -> str:
    """`value` as a Hydra override's value: as is when Hydra reads it back unchanged, else quoted."""
    if _HYDRA_PLAIN.match(value):
        return value
    # Hydra's quoted strings: backslashes escape only a quote or the closing quote that follow them.
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped) + "'"


def end_preempted_run(trainer: Any, decision: ResumeDecision, command: str, callbacks: list,
                      run_dir: Optional[Path], wait_for_ranks: float = 120.0) -> int:
    """After a scheduler's signal stopped `fit` (every rank saved one checkpoint together, `SchedulerSignals`): the
    exit status of this process, with the command that continues the run printed by global rank 0.

    `EXIT_PREEMPTED`, so that no scheduler or script takes the job for finished; except on the ranks the launching
    process started (Lightning's script launcher), which exit 0: the launcher reads their status and SIGKILLs every
    process, itself included, when one is not 0. The launching process waits (up to `wait_for_ranks` seconds) for
    them to end first, so that its own exit means the whole job has ended."""
    if decision.started_by_launching_process:
        return 0
    for process in getattr(trainer.strategy.launcher, "procs", None) or []:
        try:
            process.wait(timeout=wait_for_ranks)
        except subprocess.TimeoutExpired:
            pass  # its save is complete (collective): leaving it to end on its own loses nothing
    if trainer.is_global_zero:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        newest, _ = newest_checkpoint(checkpoint_folders(callbacks, run_dir))
        saved = f"is {newest.path} (step {newest.global_step})" if newest is not None else "is missing"
        environment = trainer.strategy.cluster_environment
        requeued = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        print(f"\nPreempted at step {trainer.global_step} by a scheduler's signal: the newest checkpoint of the run"
              f" {saved}; exit status {EXIT_PREEMPTED} (not finished).", flush=True)
        if requeued:
            print("SLURM requeues the job (Lightning's auto-requeue): the requeued job runs the same command, whose"
                  f" run folder is this one ({run_dir}: named by run_name=..., or else by the job's id and the"
                  " command), and continues from its newest checkpoint.", flush=True)
        print(f"Continue it with the same command, the run named and resume=auto:\n  {command}", flush=True)
    return EXIT_PREEMPTED
