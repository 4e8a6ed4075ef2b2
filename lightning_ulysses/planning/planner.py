"""Memory planner: per-GPU and per-host bytes of a training step, term by term, from first principles.

`plan_memory(shape, setup)` returns every term (parameters, gradients, optimizer states, saved activations, the
largest transient of the step, logits, communication buffers, host-offloaded bytes); `longest_sequence(...)`
answers "what is the longest sequence that fits on N GPUs of M bytes (plus host RAM)". The command is
`python -m lightning_ulysses plan --help`.

Accounting conventions (the ones a reader can check by hand):
- mixed precision: 16-bit weights and gradients, fp32 master weights and Adam's two moments (12 bytes/parameter);
- ZeRO shards over all `dp × sp` ranks: stage ≥1 the optimizer, ≥2 the gradients, 3 the weights;
- host memory (per GPU, i.e. per rank's process), as DeepSpeed 0.19.8 allocates it (`_optimizer_offload_terms` cites
  the source lines); with `offload_optimizer` = r > 0 (DeepSpeed's `offload_optimizer: {device: cpu, ratio: r}`):
  - *process baseline*: interpreter, torch, CUDA context and kernel libraries (`host_process_bytes`, 2.3 GiB measured);
  - *optimizer: fp32 master + Adam m, v*: 12 bytes per element of the offloaded sub-groups — the last
    `count − int((1 − r) · count)` of `optimizer_sub_groups` (by count, not by elements);
  - *fp32 gradients of offloaded sub-groups*: 4 bytes per element, one pinned block per sub-group;
  - *16-bit gradient partitions* (ZeRO-3): 2 bytes per element of *all* sub-groups, one pinned block — with any
    offload these leave the GPU, which keeps instead *fp32 gradients of GPU-side sub-groups* (4 bytes per element);
  - *pinned staging blocks left in the allocator's cache*: the GPU-side sub-groups' gradient buffers are staged in
    pinned host blocks that stay cached unless a later pinned buffer of the same size reuses them;
  - *largest host transient: engine start*: unpinned zeros next to their pinned copy while DeepSpeed starts, less
    what exists only later (CPU Adam's m, v; offloaded activations).
  Pinned blocks are rounded up to a power of two (PyTorch's caching host allocator; `offload_pin_memory=False`: none);
- activations are what autograd keeps per token and layer with an exact (flash/SDPA memory-efficient) attention,
  i.e. no `seq²` score matrix: see `_layer_saved_bytes_per_token`. Ulysses leaves every rank `seq / sp` tokens of
  every saved tensor (attention's gathered q, k, v hold all tokens of `heads / sp` heads: the same bytes);
- the step's peak = model states + buffers + all saved activations + the largest transient (loss/logits, or one
  layer's recompute and backward).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning.layer_kinds import LayerKind, attention_layers, hybrid_layers
from lightning_ulysses.planning.selective import activation_terms as layer_activation_terms, layer_costs

GIB = 2**30
GB = 10**9


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (enough to count its parameters and activations)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_key_value_heads: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs GELU (2)
    bias: bool = False
    tie_word_embeddings: bool = False
    # Hugging Face's RMSNorm upcasts its input to fp32 and autograd keeps that copy (4 bytes/value) besides the
    # 16-bit normalised values; the native GPT's LayerNorm keeps only its 16-bit input.
    fp32_norm_inputs: bool = False
    # Hybrid models: every decoder layer's kind (`layer_kinds.LayerKind`: its token mixer, MLP and norms, each with
    # its declared costs), which then replace the Llama-style layer the fields above describe; () for those.
    layers: tuple[LayerKind, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def attention_layers(self) -> int:
        """Layers with a softmax attention (all of a Llama-style shape's)."""
        return attention_layers(self.layers) if self.layers else self.num_layers

    @property
    def layer_parameters(self) -> int:
        """One decoder layer's parameters (a hybrid's largest layer: what ZeRO-3 gathers at once)."""
        if self.layers:
            return max(layer.parameters for layer in self.layers)
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if self.bias else 0)
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        mlp += (self.intermediate_size + h) if self.bias else 0
        norms = 2 * h * (2 if self.bias else 1)  # LayerNorm has a bias, RMSNorm none
        return attention + mlp + norms

    @property
    def num_parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        final_norm = self.hidden_size * (2 if self.bias else 1)
        if self.layers:
            return sum(layer.parameters for layer in self.layers) + embeddings + final_norm
        return self.num_layers * self.layer_parameters + embeddings + final_norm

    @property
    def root_parameters(self) -> int:
        """The parameters outside the decoder layers (embeddings, untied head, final norm): FSDP2's root unit."""
        return self.num_parameters - (sum(layer.parameters for layer in self.layers) if self.layers
                                      else self.num_layers * self.layer_parameters)

    def parameter_numels(self) -> list[int]:
        """Every parameter tensor's size in Hugging Face Llama's registration order: embedding; per layer q, k, v, o
        (each followed by its bias), the MLP matrices (gate, up, down; up and down followed by their biases), the two
        norms (weight, then bias); final norm; untied head. DeepSpeed ZeRO-3 cuts optimizer sub-groups in this order
        (`optimizer_sub_groups`); a model that registers its tensors in another order moves a cut by one tensor."""
        h, kv, inter = self.hidden_size, self.num_key_value_heads * self.head_dim, self.intermediate_size
        head = [] if self.tie_word_embeddings else [self.vocab_size * h]
        if self.layers:  # a hybrid: each part as one tensor (a sub-group cut may fall a tensor away from DeepSpeed's)
            layers = [numel for layer in self.layers for numel in
                      [part.parameters for part in layer.parts] + [h] * layer.norms]
            return [self.vocab_size * h] + layers + [h] + head

        def linear(inputs: int, outputs: int) -> list[int]:
            return [inputs * outputs] + ([outputs] if self.bias else [])

        norm = [h, h] if self.bias else [h]  # LayerNorm has a bias, RMSNorm none
        attention = linear(h, h) + linear(h, kv) + linear(h, kv) + linear(h, h)
        mlp = ([h * inter] if self.gated_mlp else []) + linear(h, inter) + linear(inter, h)
        return [self.vocab_size * h] + (attention + mlp + norm + norm) * self.num_layers + norm + head

    @classmethod
    def from_gpt_config(cls, config, name: str = "gpt") -> "ModelShape":
        return cls(name, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                   config.num_key_value_heads, config.vocab_size, gated_mlp=False, bias=config.bias,
                   tie_word_embeddings=config.tie_word_embeddings)

    @classmethod
    def from_hf_config(cls, config, name: Optional[str] = None, hybrid: bool = True) -> "ModelShape":
        """Llama-style configs (SwiGLU MLP, RMSNorm, no biases), and hybrids whose layer kinds `layer_kinds` declares
        (Gated DeltaNet and Mamba2 mixers, attention, dense and expert MLPs; another hybrid raises `ValueError`).
        `hybrid=False`: every layer taken as a Llama-style one (a rough count, for throughput logging)."""
        layers = hybrid_layers(config) if hybrid else None
        if layers:
            return cls(name or config.model_type, len(layers), config.hidden_size,
                       getattr(config, "intermediate_size", None) or 0, config.num_attention_heads,
                       getattr(config, "num_key_value_heads", None) or config.num_attention_heads, config.vocab_size,
                       tie_word_embeddings=bool(config.tie_word_embeddings), fp32_norm_inputs=True, layers=layers)
        return cls(name or config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                   config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads,
                   config.vocab_size, gated_mlp=True, bias=bool(getattr(config, "attention_bias", False)),
                   tie_word_embeddings=bool(config.tie_word_embeddings), fp32_norm_inputs=True)


MODELS = {
    "llama3-8b": ModelShape("Llama 3 8B", 32, 4096, 14336, 32, 8, 128256, fp32_norm_inputs=True),
    "llama3.2-1b": ModelShape("Llama 3.2 1B", 16, 2048, 8192, 32, 8, 128256, tie_word_embeddings=True,
                              fp32_norm_inputs=True),
    "gpt3-175b": ModelShape("GPT-3 175B", 96, 12288, 4 * 12288, 96, 96, 50257, gated_mlp=False, bias=True,
                            tie_word_embeddings=True),
    "bloom-176b": ModelShape("BLOOM 176B", 70, 14336, 4 * 14336, 112, 112, 250880, gated_mlp=False, bias=True,
                             tie_word_embeddings=True),
}


@dataclass(frozen=True)
class TrainingSetup:
    seq_len: int
    micro_batch: int = 1
    sequence_parallel_size: int = 1
    data_parallel_size: int = 1
    zero_stage: int = 3
    offload_optimizer: float = 0.0  # fraction of optimizer states (and their fp32 gradients) in host memory
    compute_bytes: int = 2  # bf16/fp16 weights, gradients, activations
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    # DeepSpeed ZeRO-3: parameters gathered at once (the current and the prefetched layer) and the optimizer's
    # sub-group (`sub_group_size`; DeepSpeed's default is 1e9 elements, Lightning's 1e12, i.e. one group).
    prefetched_layers: int = 2
    sub_group_size: int = 10**9
    reduce_bucket_size: int = 5 * 10**8  # DeepSpeed's default; ZeRO-2/3 keep one 16-bit bucket of this many values
    # `offload_optimizer.pin_memory` (DeepSpeed 0.19.8's default: true). Pinned blocks come from PyTorch's caching
    # host allocator, which rounds each one up to a power of two (`ATen/core/CachingHostAllocator.h`, `PowerOf2Ceil`).
    offload_pin_memory: bool = True
    # Host memory of each rank's process before any model state: the Python interpreter, torch, the CUDA context and
    # the kernel libraries loaded by the first step. Measured on the H200 (torch 2.11, cu130): 1.6 GiB RSS after
    # `deepspeed.initialize` with every state on the GPU, 0.66 GiB more after the first step.
    host_process_bytes: float = 2.3 * GIB
    # What shards the parameters: DeepSpeed ZeRO ("deepspeed") or torch's FSDP2 ("fsdp2", `plan_memory`'s
    # `_fsdp2_states`), and FSDP2's `reshard_after_forward`.
    backend: str = "deepspeed"
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("deepspeed", "fsdp2"):
            raise ValueError(f"backend is 'deepspeed' or 'fsdp2', got {self.backend!r}")
        if self.backend == "fsdp2" and (self.zero_stage != 3 or self.offload_optimizer):
            raise ValueError("FSDP2 shards parameters, gradients and optimizer states over all ranks (zero_stage=3)"
                             " and keeps the optimizer on the device (offload_optimizer=0)")
        if not 0.0 <= self.offload_optimizer <= 1.0:
            raise ValueError(f"offload_optimizer is a fraction in [0, 1], got {self.offload_optimizer}")
        if 0.0 < self.offload_optimizer < 1.0 and self.zero_stage != 3:
            raise ValueError(f"offload_optimizer={self.offload_optimizer}: DeepSpeed offloads part of the optimizer"
                             " (offload_optimizer.ratio) only with ZeRO-3; use zero_stage=3, or offload 0 or 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {self.zero_stage}")

    @classmethod
    def of_run(cls, run: RunSpec, seq_len: int, **choices: Any) -> "TrainingSetup":
        """A step of `run` at `seq_len`, as the planner sees it: the run's layout, ZeRO stage, optimizer share on the
        host, compute precision, pinning and (where configured) sub-group size; `choices` (memory options, a share or
        sub-group size being tried, the micro-batch, ...) replace or add to them."""
        described = dict(sequence_parallel_size=run.sequence_parallel_size, data_parallel_size=run.data_parallel_size,
                         zero_stage=run.zero_stage, offload_optimizer=run.optimizer_share_on_host,
                         compute_bytes=run.compute_bytes, offload_pin_memory=run.optimizer_offload_pin_memory,
                         backend=run.backend, reshard_after_forward=run.reshard_after_forward)
        if run.sub_group_size is not None:
            described["sub_group_size"] = run.sub_group_size
        return cls(seq_len=seq_len, **{**described, **choices})

    @property
    def world_size(self) -> int:
        return self.sequence_parallel_size * self.data_parallel_size

    @property
    def local_tokens(self) -> int:
        return self.micro_batch * math.ceil(self.seq_len / self.sequence_parallel_size)


@dataclass
class MemoryPlan:
    shape: ModelShape
    setup: TrainingSetup
    gpu: dict[str, float]  # bytes per GPU, by term
    host: dict[str, float]  # bytes per GPU's share of host memory, by term

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def fits(self, gpu_bytes: float, host_bytes_per_gpu: float = math.inf) -> bool:
        return self.gpu_total <= gpu_bytes and self.host_total <= host_bytes_per_gpu

    def table(self, unit: float = GIB, unit_name: str = "GiB") -> str:
        s = self.setup
        lines = [f"{self.shape.name}: {self.shape.num_parameters / 1e9:.2f}B parameters; seq {s.seq_len} × micro-batch"
                 f" {s.micro_batch}; sp {s.sequence_parallel_size} × dp {s.data_parallel_size};"
                 f" {'FSDP2' if s.backend == 'fsdp2' else f'ZeRO-{s.zero_stage}'};"
                 f" optimizer on host {s.offload_optimizer:.0%}; {self._features()}",
                 f"  {'per GPU':<44}{unit_name:>10}"]
        lines += [f"  {name:<44}{value / unit:>10.2f}" for name, value in self.gpu.items()]
        lines.append(f"  {'GPU total':<44}{self.gpu_total / unit:>10.2f}")
        if self.host_total:
            lines.append(f"  {'host memory per GPU':<44}{unit_name:>10}")
            lines += [f"  {name:<44}{value / unit:>10.2f}" for name, value in self.host.items() if value]
            lines.append(f"  {'host total per GPU':<44}{self.host_total / unit:>10.2f}")
        return "\n".join(lines)

    def _features(self) -> str:
        m = self.setup.memory
        names = [n for n in ("tiled_mlp", "tiled_logits_loss", "activation_checkpointing", "offload_activations",
                             "keep_attention_outputs", "low_memory_norms", "fused_elementwise") if getattr(m, n)]
        if m.checkpoint_interval > 1:
            names.append(f"checkpoint_interval={m.checkpoint_interval}")
        return "features: " + (", ".join(names) if names else "none")

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": dict(self.gpu), "host": dict(self.host), "gpu_total": self.gpu_total,
                "host_total": self.host_total}


def optimizer_sub_groups(shape: ModelShape, setup: TrainingSetup) -> list[int]:
    """Elements of each optimizer sub-group that one rank updates, in DeepSpeed's order (`sub_groups_of` the
    shape's parameter tensors)."""
    return sub_groups_of(shape.parameter_numels(), setup)


def sub_groups_of(parameter_numels: Sequence[int], setup: TrainingSetup) -> list[int]:
    """Elements of each optimizer sub-group that one rank updates, for parameter tensors of these sizes (in the
    model's registration order), in DeepSpeed's order.

    ZeRO-3 partitions every parameter tensor over the `dp × sp` ranks (`ceil(numel / ranks)` elements each) and cuts
    the local partitions, in parameter order, into sub-groups, each closed as soon as it holds `sub_group_size`
    elements or more (`runtime/zero/stage3.py` `_create_fp16_sub_groups`, ~1210). One optimizer parameter group is
    assumed (several are cut separately). ZeRO-0/1/2 update one flat partition.
    """
    ranks = setup.world_size if setup.zero_stage >= 1 else 1
    if setup.zero_stage < 3:
        return [math.ceil(sum(parameter_numels) / ranks)]
    groups, current = [], 0
    for numel in parameter_numels:
        current += math.ceil(numel / ranks)
        if current >= setup.sub_group_size:
            groups, current = groups + [current], 0
    return groups + [current] if current else groups


def _pinned_block_bytes(nbytes: int) -> int:
    """Bytes a pinned host tensor of `nbytes` occupies: the caching host allocator's power-of-two block."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def optimizer_offload_host_bytes(parameter_numels: Sequence[int], setup: TrainingSetup) -> dict[str, float]:
    """Host bytes, by term, that one rank's process holds for DeepSpeed's optimizer offload of a model with parameter
    tensors of these sizes (registration order) once training runs: the terms `plan_memory` counts for it, without
    the process baseline and the activations (what preflight checks against the free RAM before training)."""
    _, host, _, _ = _optimizer_offload_terms(parameter_numels, setup)
    return host


def _optimizer_offload_terms(parameter_numels: Sequence[int], setup: TrainingSetup) -> tuple[dict, dict, float, float]:
    """GPU and host bytes of DeepSpeed's optimizer offload (`offload_optimizer: {device: cpu, ratio}`), its largest
    host transient at engine start, and the largest sub-group left on the GPU.

    Evidence, DeepSpeed 0.19.8 `runtime/zero/stage3.py` (ZeRO-3; line numbers approximate):
    - ~1100: sub-groups `i >= int((1 - ratio) · count)` go to the host (CPU Adam), the others stay on the GPU (torch
      AdamW): the split is by sub-group *count*, so one sub-group (Lightning's `sub_group_size` 1e12) offloads all of
      it at any ratio > 0, and the head, last, is always on the host;
    - ~1157: fp32 master of each sub-group on its device (host: plain memory); CPU Adam adds fp32 m and v at its
      first step (`ops/adam/cpu_adam.py` ~161, no other copies), torch AdamW on the GPU likewise;
    - ~1338: an fp32 gradient buffer for *every* sub-group, made as host zeros, pinned, then moved to the sub-group's
      device: the GPU-side sub-groups keep theirs on the GPU, and their pinned staging block returns to the caching
      host allocator, where a later pinned buffer of the same power-of-two size reuses it (else it stays cached);
      `gradient_buffer` (~1306): host fp32 zeros of the largest sub-group while this runs;
    - ~791: with any optimizer offload `self.device` is the CPU (~333), so the 16-bit gradient partitions of *all*
      parameters (`grad_partitions_flat_buffer`, grad-accumulation dtype = the model's by default) live in one pinned
      host buffer, made as zeros then pinned (both alive at once), and leave the GPU.
    ZeRO-1/2 (`stage_1_and_2.py`) offload whole: their single partition is treated as one sub-group.
    """
    e, pinned = setup.compute_bytes, setup.offload_pin_memory
    block = _pinned_block_bytes if pinned else (lambda nbytes: nbytes)
    groups = sub_groups_of(parameter_numels, setup)
    first_on_host = int((1 - setup.offload_optimizer) * len(groups)) if setup.offload_optimizer else len(groups)
    on_gpu, on_host = groups[:first_on_host], groups[first_on_host:]
    gpu = {"optimizer: fp32 master + Adam m, v": 12.0 * sum(on_gpu)}
    host: dict[str, float] = {}
    if not on_host:
        return gpu, host, 0.0, max(on_gpu)
    gpu["fp32 gradients of GPU-side sub-groups"] = 4.0 * sum(on_gpu)
    host["optimizer: fp32 master + Adam m, v"] = 12.0 * sum(on_host)
    # Replay the pinned allocations in DeepSpeed's order through the allocator's free list (block size → count).
    cached: dict[int, int] = {}

    def take_pinned(size: int) -> None:  # a cached block of this size if there is one, else a new block
        if cached.get(size):
            cached[size] -= 1

    if pinned:
        for elements in on_gpu:
            take_pinned(block(4 * elements))
            cached[block(4 * elements)] = cached.get(block(4 * elements), 0) + 1  # freed after its copy to the GPU
        for elements in on_host:
            take_pinned(block(4 * elements))
        if setup.zero_stage == 3:
            take_pinned(block(e * sum(groups)))
    host_gradients = sum(block(4 * elements) for elements in on_host)
    host["fp32 gradients of offloaded sub-groups"] = host_gradients
    if setup.zero_stage == 3:
        host["16-bit gradient partitions"] = block(e * sum(groups))
    host["pinned staging blocks left in the allocator's cache"] = sum(size * count for size, count in cached.items())
    # Engine start: host zeros of the largest sub-group (`gradient_buffer`) with the next buffer's zeros before it is
    # pinned; then the 16-bit gradient buffer's zeros next to its pinned copy.
    start_transient = max(4 * max(groups) * (2 if pinned else 1), e * sum(groups) if pinned and setup.zero_stage == 3
                          else 0)
    return gpu, host, float(start_transient), max(on_gpu, default=0)


def _fsdp2_terms(shape: ModelShape, setup: TrainingSetup) -> tuple[dict[str, float], float, float]:
    """Device bytes of torch's FSDP2 (`fully_shard` of every decoder layer, then of the model: the root unit holding
    the embeddings, final norm and head) over all `dp × sp` ranks, `MixedPrecisionPolicy(param_dtype=the compute
    dtype, reduce_dtype=fp32)`; and the two transients that come after the activations are freed (the optimizer step,
    the root unit's gradient reduction at the end of backward).

    Verified on torch 2.13 (CPU, gloo, docs/internals.md): the sharded parameters are fp32 (no separate master copy),
    and so are their sharded gradients and AdamW's m and v: 4 + 4 + 8 bytes per parameter over the ranks (DeepSpeed's
    split is 2 + 2 + 12). The unsharded copies are in the compute dtype: the root unit's stay gathered from its
    forward to the end of the forward and from the first to the end of backward (it wraps every layer), each layer's
    from its forward (or backward) to its end, with the next layer's all-gather issued during a layer's backward
    (FSDP2's backward prefetch; in forward on a GPU its implicit prefetch overlaps the next all-gather the same way).
    A stretch of `checkpoint_interval` > 1 gathers one more layer to recompute its inputs (`memory/checkpointing.py`).
    `reshard_after_forward=False` keeps every layer gathered from its forward to its backward. The output head's
    gradient (the embedding's, when tied) is made at the head's backward and reduced only with the root unit's at
    the end. One layer's reduce-scatter holds its unsharded gradients, their fp32 flat copy and the fp32 shard
    (`foreach_reduce`). torch's AdamW (foreach, the default on CUDA) makes one fp32 temporary of the whole local
    state (`sqrt(v)`); `fused=True` makes none."""
    e, params, n = setup.compute_bytes, shape.num_parameters, setup.world_size
    layer, root, head = shape.layer_parameters, shape.root_parameters, shape.vocab_size * shape.hidden_size
    m = setup.memory
    stretch = 1 if m.activation_checkpointing and m.checkpoint_interval > 1 else 0
    gathered = root + (setup.prefetched_layers + stretch) * layer if setup.reshard_after_forward else params
    reduce_scatter = (e + 4 + 4 / n)
    gpu = {"parameters (fp32 shards, FSDP2)": 4 * params / n,
           "gradients (fp32 shards)": 4 * params / n,
           "optimizer: Adam m, v (fp32 shards)": 8 * params / n,
           "gathered parameters (FSDP2: root unit + layers)": e * gathered,
           "output head's gradient (until the end of backward)": e * head,
           "reduce-scatter of one layer's gradients": reduce_scatter * layer}
    return gpu, 4 * params / n, e * (root - head) + reduce_scatter * root


def _layer_saved_bytes_per_token(shape: ModelShape, e: int, tiled_mlp: bool, low_memory_norms: bool = False,
                                 fused_elementwise: bool = False) -> float:
    """What autograd keeps of one decoder layer, per local token, without checkpointing.

    Each norm: its input (LayerNorm: 16-bit; HF RMSNorm: an fp32 copy plus the 16-bit normalised values; with
    `low_memory_norms` or `fused_elementwise` the 16-bit input and an fp32 rstd per token, what their compiled or
    hand-written backward reads) and its output (read by the next projections).
    Attention: q, k, v as the attention kernel saves them (h + 2·kv), the attention output (kernel) and the
    o-projection's input (the all-to-all's copy of it): 2h; fp32 log-sum-exp per head: 4·heads bytes. MLP: gated:
    gate, up, activation and product (4·I; `fused_elementwise` recomputes the activation in backward: 3·I), GELU: up
    and activation (2·I); a tiled MLP keeps none of these (only its input, the norm output, already counted). The
    final norm is not counted (one norm beside the layer stack).
    """
    h, kv, inter = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    if not shape.fp32_norm_inputs:
        norm = 2 * e * h
    elif low_memory_norms or fused_elementwise:
        norm = 2 * e * h + 4
    else:
        norm = (4 + e + e) * h
    attention = norm + e * (h + 2 * kv + 2 * h) + 4 * shape.num_heads
    kept_per_intermediate = (3 if fused_elementwise else 4) if shape.gated_mlp else 2
    mlp = norm + (0 if tiled_mlp else e * kept_per_intermediate * inter)
    return attention + mlp


def _layers_saved_bytes_per_token(shape: ModelShape, e: int, m: MemoryOptions) -> tuple[float, float]:
    """(all decoder layers', the largest layer's) saved bytes per local token without checkpointing."""
    if shape.layers:  # a hybrid: its norms and parts as declared (layer_kinds.py)
        per_layer = [layer.saved_bytes(m.tiled_mlp) for layer in shape.layers]
        return sum(per_layer), max(per_layer)
    layer = _layer_saved_bytes_per_token(shape, e, m.tiled_mlp, m.low_memory_norms, m.fused_elementwise)
    return layer * shape.num_layers, layer


def _saved_bytes_by_layer(shape: ModelShape, e: int, m: MemoryOptions) -> list[float]:
    """Each decoder layer's saved bytes per local token without checkpointing."""
    if shape.layers:
        return [layer.saved_bytes(m.tiled_mlp) for layer in shape.layers]
    return [_layer_saved_bytes_per_token(shape, e, m.tiled_mlp, m.low_memory_norms, m.fused_elementwise)] * shape.num_layers


def _layer_backward_transient_per_token(shape: ModelShape, e: int) -> float:
    """Gradients alive while one layer runs backward: d(hidden) in and out, d(q, k, v), d(attention output); in a
    hybrid, d(hidden) in and out and 15% of what its largest part keeps: backward frees the saved chunks as it goes
    (Qwen3-Next-like shape at 256K with layer checkpointing and a tiled MLP on the H200: 125.4 GiB peak, i.e. ~460 kB
    per token for one Gated DeltaNet layer's recompute and backward, whose saved bytes are ~400 kB;
    `benchmarks/results/2026-12-03-h200-delta-rule/qwen3_next.jsonl`)."""
    if shape.layers:
        return 4 * e * shape.hidden_size + 0.15 * max(part.saved_bytes for layer in shape.layers
                                                      for part in layer.parts)
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    return e * (2 * h + h + 2 * kv + h)


_ACTIVATION_TERMS = ("checkpointed layer inputs", "kept attention outputs", "kept products",
                     "saved activations (layers not checkpointed)", "saved activations (all layers)",
                     "tiled loss: stored gradients")


def plan_memory(shape: ModelShape, setup: TrainingSetup) -> MemoryPlan:
    e, params, n = setup.compute_bytes, shape.num_parameters, setup.world_size
    m = setup.memory
    tokens = setup.local_tokens
    stage = setup.zero_stage
    gpu: dict[str, float] = {}
    host: dict[str, float] = {}

    # -- model states ------------------------------------------------------------------------------------------
    host["process baseline (torch, CUDA libraries)"] = setup.host_process_bytes
    offload_host, host_start_transient, end_of_backward = {}, 0.0, None
    if setup.backend == "fsdp2":
        fsdp2_gpu, optimizer_transient, end_of_backward = _fsdp2_terms(shape, setup)
        gpu.update(fsdp2_gpu)
    else:
        gpu["weights (16-bit)"] = e * params / (n if stage == 3 else 1)
        # ZeRO-3 with an offloaded optimizer keeps the 16-bit gradient partitions on the host (`_optimizer_offload_terms`)
        gradients_on_host = stage == 3 and setup.offload_optimizer > 0
        gpu["gradients (16-bit)"] = 0.0 if gradients_on_host else e * params / (n if stage >= 2 else 1)
        offload_gpu, offload_host, host_start_transient, largest_gpu_sub_group = _optimizer_offload_terms(
            shape.parameter_numels(), setup)
        gpu.update(offload_gpu)
        host.update(offload_host)

        # -- buffers -------------------------------------------------------------------------------------------
        if stage == 3:
            # full 16-bit copies of the layers being computed and prefetched; at the output head, the head and a layer
            head = shape.vocab_size * shape.hidden_size
            gpu["gathered parameters (ZeRO-3)"] = e * max(setup.prefetched_layers * shape.layer_parameters,
                                                          head + shape.layer_parameters)
        if stage >= 2:
            gpu["gradient reduce bucket"] = e * min(setup.reduce_bucket_size, params)
        # The optimizer step runs after backward has freed the activations: its transient competes with theirs.
        # DeepSpeed makes an fp32 copy of one sub-group's gradients, and Adam one fp32 temporary of that size.
        optimizer_transient = 2 * 4 * largest_gpu_sub_group

    # -- activations -------------------------------------------------------------------------------------------
    layers_full, _ = _layers_saved_bytes_per_token(shape, e, m)
    embedding_output = e * shape.hidden_size * tokens
    if m.activation_checkpointing:
        # per layer (selective.py): every `checkpoint_interval`-th checkpointed layer keeps its input, and what the
        # options keep for its recompute (attention outputs, products), where the inputs go; the layers
        # `checkpoint_layers` leaves out keep what autograd saves of them
        costs = layer_costs(shape, e, m, _saved_bytes_by_layer(shape, e, m))
        kept_gpu, kept_host, layer_transient = layer_activation_terms(
            costs, tokens, e, shape.hidden_size, m.offload_activations, _layer_backward_transient_per_token(shape, e),
            embedding_output / tokens, m.checkpoint_interval)
        gpu.update(kept_gpu)
        host.update(kept_host)
    else:
        gpu["saved activations (all layers)"] = layers_full * tokens + embedding_output
        layer_transient = _layer_backward_transient_per_token(shape, e) * tokens
    if m.tiled_mlp:
        # one tile's MLP recompute and its gradients: (gate, up, act, product) and their gradients
        tile = min(m.mlp_tile_tokens, tokens)
        layer_transient += (max(layer.tile_transient_bytes(tile) for layer in shape.layers) if shape.layers
                            else e * tile * shape.intermediate_size * (8 if shape.gated_mlp else 4))
    elif m.activation_checkpointing:
        pass  # the untiled MLP's activations are part of layer_full already
    vocab = shape.vocab_size
    if m.tiled_logits_loss:
        tile = min(m.logits_tile_tokens, tokens)
        # kept from forward to backward: d(hidden) and the output weight's fp32 gradient
        gpu["tiled loss: stored gradients"] = e * tokens * shape.hidden_size + 4 * vocab * shape.hidden_size
        logits_transient = tile * vocab * (4 + 4 + e)  # one tile's fp32 logits, softmax and 16-bit gradient
    else:
        # 16-bit logits (kept in the output), fp32 log-softmax (kept by the loss), and in backward the fp32
        # gradient of the log-softmax and its 16-bit cast: 2 + 4 + 4 + 2 bytes per token and vocabulary entry
        logits_transient = tokens * vocab * (e + 4 + 4 + e)
    activation_terms = sum(v for k, v in gpu.items() if k in _ACTIVATION_TERMS)
    candidates = {"logits + loss": logits_transient, "one layer's backward": layer_transient,
                  "optimizer step (activations freed)": optimizer_transient - activation_terms}
    if end_of_backward is not None:
        candidates["end of backward: the root unit's gradients reduced"] = end_of_backward - activation_terms
    largest = max(candidates, key=candidates.get)
    gpu[f"largest transient: {largest}"] = max(0.0, candidates[largest])
    if offload_host:
        # At engine start neither the offloaded activations nor CPU Adam's moments (made at its first step) exist.
        later = 8 * host["optimizer: fp32 master + Adam m, v"] / 12 + host.get("checkpointed layer inputs (offloaded)", 0)
        host["largest host transient: engine start"] = max(0.0, host_start_transient - later)
    return MemoryPlan(shape, setup, gpu, host)


def longest_sequence(shape: ModelShape, setup: TrainingSetup, gpu_bytes: float, host_bytes_per_gpu: float = math.inf,
                     multiple_of: int = 1024, limit: int = 1 << 26) -> int:
    """Longest `seq_len` (a multiple of `multiple_of` and of the SP size) whose plan fits; 0 if none does."""
    step = math.lcm(multiple_of, setup.sequence_parallel_size)

    def fits(seq: int) -> bool:
        return plan_memory(shape, dataclasses.replace(setup, seq_len=seq)).fits(gpu_bytes, host_bytes_per_gpu)

    if not fits(step):
        return 0
    low, high = 1, 2
    while high * step <= limit and fits(high * step):
        low, high = high, high * 2
    while high - low > 1:  # fits(low) and not fits(high); memory grows with the sequence
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step


def full_activation_bytes_korthikanti(shape: ModelShape, seq_len: int, micro_batch: int = 1) -> float:
    """Activations of a GPT layer stack without recomputation and *with* the `seq²` attention scores
    (Korthikanti et al. 2022: `s·b·h·(34 + 5·a·s/h)` bytes per layer): the accounting the published 176B numbers use."""
    s, b, h, a = seq_len, micro_batch, shape.hidden_size, shape.num_heads
    return shape.num_layers * s * b * h * (34 + 5 * a * s / h)


def published_176b_comparison(sequence_parallel_size: int = 8, world_size: int = 8) -> str:
    """The quoted 176B figures, term by term: what reproduces and what does not (GB = 10⁹ bytes)."""
    shape = MODELS["gpt3-175b"]
    params = shape.num_parameters
    weights = 2 * params
    activations = full_activation_bytes_korthikanti(shape, 2048)
    lines = [
        f"{shape.name} ({params / 1e9:.1f}B parameters), the quoted '176B' figures, GB = 1e9 bytes:",
        f"  parameters, 16-bit:                  {weights / GB:7.0f} GB whole → {weights / world_size / GB:5.0f} GB per GPU"
        f" (ZeRO-3 over {world_size})   [quoted 352 → 44: reproduced; 176B × 2 bytes = 352]",
        f"  activations, seq 2048, no recompute: {activations / GB:7.0f} GB whole → "
        f"{activations / sequence_parallel_size / GB:5.0f} GB per GPU (SP {sequence_parallel_size})   [quoted 280 → 23]",
        "    280 GB is Korthikanti's s·b·h·(34 + 5·a·s/h)·L at s = 2048, b = 1 (incl. the seq² attention scores).",
        f"    Ulysses gives every rank seq/{sequence_parallel_size} tokens of every activation (the scores: heads/"
        f"{sequence_parallel_size} heads over all tokens), so the honest division is by {sequence_parallel_size}:"
        f" {activations / sequence_parallel_size / GB:.0f} GB, not 23 (280 / 23 = 12.2, not the SP size).",
        f"  total quoted 632 → 67 GB = parameters + activations only; the per-GPU sum of the two terms above is"
        f" {(weights / world_size + activations / sequence_parallel_size) / GB:.0f} GB.",
        "  Missing from the quote, per GPU with ZeRO-3 over 8:",
        f"    16-bit gradients                   {weights / world_size / GB:7.0f} GB",
        f"    fp32 master + Adam m, v            {12 * params / world_size / GB:7.0f} GB  (2112 GB whole)",
        "  so one 8-GPU node holds no 176B training step: model states alone are 16 bytes × 175B / 8 ="
        f" {16 * params / world_size / GB:.0f} GB per GPU. With flash attention (no seq² scores) and layer"
        " checkpointing the activations are far smaller than quoted (see plan_memory).",
    ]
    return "\n".join(lines)


# The feature names of `python -m lightning_ulysses plan --features` and of the step-time calibration rows
# (`calibration.Measured.features`): here, below both, so that neither imports the other.
FEATURES = {"ac": "activation_checkpointing", "offload": "offload_activations", "mlp": "tiled_mlp",
            "logits": "tiled_logits_loss", "attn": "keep_attention_outputs", "norms": "low_memory_norms",
            "fused": "fused_elementwise"}


def memory_options(features: str, mlp_tile_tokens: int = 8192, logits_tile_tokens: int = 4096) -> MemoryOptions:
    """`"ac,offload,mlp,logits,norms"` (or `+`-joined, or `none`) → `MemoryOptions`; `everyK` sets
    checkpoint_interval=K."""
    names, interval = [], 1
    for name in features.replace("+", ",").split(","):
        if name.startswith("every") and name[5:].isdigit():
            interval = int(name[5:])  # the last one counts
        elif name and name != "none":
            names.append(name)
    unknown = [name for name in names if name not in FEATURES]
    if unknown:
        raise ValueError(f"Unknown feature(s) {unknown}; choose from {sorted(FEATURES)}, everyK or none")
    return MemoryOptions(mlp_tile_tokens=mlp_tile_tokens, logits_tile_tokens=logits_tile_tokens,
                         checkpoint_interval=interval,
                         **{FEATURES[name]: True for name in names})
