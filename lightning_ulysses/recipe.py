"""What `recipes/train.py` does besides instantiating: runtime environment, early checks, the hardware-free plan."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_ulysses.attention.core import validate_head_counts
from lightning_ulysses.layout import ParallelLayout
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.planner import ModelShape, TrainingSetup, plan_memory
from lightning_ulysses.deepspeed_config import split_ulysses_block

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


def check_recipe(cfg: DictConfig, spec: Any) -> ParallelLayout:
    """Reject bad combinations of overrides in the launching process, before any rank starts."""
    world = _world_size(cfg.trainer)
    size = cfg.strategy.get("sequence_parallel_size")
    if size is None and isinstance(cfg.strategy.get("config"), DictConfig):  # a DeepSpeed-Ulysses "ulysses" block
        _, size = split_ulysses_block(OmegaConf.to_container(cfg.strategy.config))
    size = size or int(cfg.trainer.get("devices", 1))
    layout = ParallelLayout(world_size=world, sequence_parallel_size=size)
    validate_head_counts(*_heads(spec), size)
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
    from lightning_ulysses.export import ExportPretrained

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


def _shape(spec: Any) -> ModelShape:
    from lightning_ulysses.models.gpt import GPTConfig

    if isinstance(spec, GPTConfig):
        return ModelShape.from_gpt_config(spec)
    return ModelShape.from_hf_config(spec.config)


def plan(cfg: DictConfig) -> str:
    """Parameter count, layout, batch and the memory planner's per-GPU terms, from the config alone (meta device)."""
    spec = instantiate(cfg.model).spec  # the module only keeps its spec: nothing is built (nor loaded)
    layout = check_recipe(cfg, spec)
    params = spec.num_parameters()
    nodes, devices = int(cfg.trainer.get("num_nodes", 1)), int(cfg.trainer.devices)
    micro, accumulate = int(cfg.data.get("batch_size", 1)), int(cfg.trainer.get("accumulate_grad_batches", 1))
    seq_len = int(cfg.data.get("seq_len", 0))
    global_batch = micro * accumulate * layout.data_parallel_size
    stage = int(cfg.strategy.get("stage", 3))
    offload = bool(cfg.strategy.get("offload_optimizer", False))
    # DeepSpeed's partial offload (`offload_optimizer.ratio`, set through config_overrides) splits by sub-group count;
    # Lightning's sub_group_size default (1e12) makes one sub-group.
    overrides = OmegaConf.to_container(cfg.strategy.get("config_overrides") or {})
    ratio = ((overrides.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("ratio")
    offload_fraction = (1.0 if ratio is None else float(ratio)) if offload else 0.0
    requested = strategy_memory(cfg)
    # memory=auto is decided at start-up from the free memory: plan without features (`plan --auto` shows a choice)
    memory = MemoryOptions() if isinstance(requested, dict) and requested.get("auto") else MemoryOptions.coerce(requested)
    if cfg.model.get("activation_checkpointing") and not memory.activation_checkpointing:
        memory = dataclasses.replace(memory, activation_checkpointing=True)  # the model's own: same bytes
    setup = TrainingSetup(seq_len=seq_len, micro_batch=micro, sequence_parallel_size=layout.sequence_parallel_size,
                          data_parallel_size=layout.data_parallel_size, zero_stage=stage,
                          offload_optimizer=offload_fraction, memory=memory,
                          sub_group_size=int(float(cfg.strategy.get("sub_group_size", 10**12))))
    memory_plan = plan_memory(_shape(spec), setup)
    gib = 2**30
    lines = [
        f"model:        {type(spec).__name__}, {params / 1e9:.2f}B parameters",
        f"layout:       {nodes} node(s) × {devices} GPUs = {layout.world_size} ranks; {layout}",
        f"              SP groups (first): {layout.sequence_parallel_groups()[:2]}",
        f"sequence:     {seq_len} tokens, {seq_len // layout.sequence_parallel_size} per rank",
        f"batch:        micro {micro} × accumulation {accumulate} × DP {layout.data_parallel_size}"
        f" = {global_batch} sequences = {global_batch * seq_len / 1e6:.1f}M tokens per optimizer step",
        f"memory/GPU:   {memory_plan.gpu_total / gib:.1f} GiB, optimizer states"
        f" {f'({offload_fraction:.0%} offloaded to CPU)' if offload else '(on GPU)'}; terms (lightning_ulysses.planner):",
        memory_plan.table(),
    ]
    if offload or memory.offload_activations:
        lines.append(f"CPU/node:     {memory_plan.host_total * devices / gib:.0f} GiB host memory")
    return "\n".join(lines)
