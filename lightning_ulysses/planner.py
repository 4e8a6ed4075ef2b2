"""Memory planner: per-GPU and per-host bytes of a training step, term by term, from first principles.

`plan_memory(shape, setup)` returns every term (parameters, gradients, optimizer states, saved activations, the
largest transient of the step, logits, communication buffers, host-offloaded bytes); `longest_sequence(...)`
answers "what is the longest sequence that fits on N GPUs of M bytes (plus host RAM)". The command is
`python -m lightning_ulysses.plan --help`.

Accounting conventions (the ones a reader can check by hand):
- mixed precision: 16-bit weights and gradients, fp32 master weights and Adam's two moments (12 bytes/parameter);
- ZeRO shards over all `dp × sp` ranks: stage ≥1 the optimizer, ≥2 the gradients, 3 the weights;
  `offload_optimizer` moves that fraction of the optimizer states (and their fp32 gradient buffers) to the host;
- activations are what autograd keeps per token and layer with an exact (flash/SDPA memory-efficient) attention,
  i.e. no `seq²` score matrix: see `_layer_saved_bytes_per_token`. Ulysses leaves every rank `seq / sp` tokens of
  every saved tensor (attention's gathered q, k, v hold all tokens of `heads / sp` heads: the same bytes);
- the step's peak = model states + buffers + all saved activations + the largest transient (loss/logits, or one
  layer's recompute and backward).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_ulysses.memory import MemoryOptions

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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_parameters(self) -> int:
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
        return self.num_layers * self.layer_parameters + embeddings + final_norm

    @classmethod
    def from_gpt_config(cls, config, name: str = "gpt") -> "ModelShape":
        return cls(name, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                   config.num_key_value_heads, config.vocab_size, gated_mlp=False, bias=config.bias,
                   tie_word_embeddings=config.tie_word_embeddings)

    @classmethod
    def from_hf_config(cls, config, name: Optional[str] = None) -> "ModelShape":
        """Llama-style configs (SwiGLU MLP, RMSNorm, no biases)."""
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

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload_optimizer <= 1.0:
            raise ValueError(f"offload_optimizer is a fraction in [0, 1], got {self.offload_optimizer}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0-3, got {self.zero_stage}")

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
                 f" {s.micro_batch}; sp {s.sequence_parallel_size} × dp {s.data_parallel_size}; ZeRO-{s.zero_stage};"
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
                             "keep_attention_outputs", "low_memory_norms") if getattr(m, n)]
        if m.checkpoint_interval > 1:
            names.append(f"checkpoint_interval={m.checkpoint_interval}")
        return "features: " + (", ".join(names) if names else "none")

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": dict(self.gpu), "host": dict(self.host), "gpu_total": self.gpu_total,
                "host_total": self.host_total}


def _layer_saved_bytes_per_token(shape: ModelShape, e: int, tiled_mlp: bool, low_memory_norms: bool = False) -> float:
    """What autograd keeps of one decoder layer, per local token, without checkpointing.

    Each norm: its input (LayerNorm: 16-bit; HF RMSNorm: an fp32 copy plus the 16-bit normalised values; with
    `low_memory_norms` the 16-bit input and an fp32 rstd per token) and its output (read by the next projections).
    Attention: q, k, v as the attention kernel saves them (h + 2·kv), the attention output (kernel) and the
    o-projection's input (the all-to-all's copy of it): 2h; fp32 log-sum-exp per head: 4·heads bytes. MLP: gated:
    gate, up, activation and product (4·I), GELU: up and activation (2·I); a tiled MLP keeps none of these (only its
    input, the norm output, already counted). The final norm is not counted (one norm beside the layer stack).
    """
    h, kv, inter = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    if not shape.fp32_norm_inputs:
        norm = 2 * e * h
    elif low_memory_norms:
        norm = 2 * e * h + 4
    else:
        norm = (4 + e + e) * h
    attention = norm + e * (h + 2 * kv + 2 * h) + 4 * shape.num_heads
    mlp = norm + (0 if tiled_mlp else e * (4 if shape.gated_mlp else 2) * inter)
    return attention + mlp


def _layer_backward_transient_per_token(shape: ModelShape, e: int) -> float:
    """Gradients alive while one layer runs backward: d(hidden) in and out, d(q, k, v), d(attention output)."""
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    return e * (2 * h + h + 2 * kv + h)


_ACTIVATION_TERMS = ("checkpointed layer inputs", "kept attention outputs", "saved activations (all layers)",
                     "tiled loss: stored gradients")


def plan_memory(shape: ModelShape, setup: TrainingSetup) -> MemoryPlan:
    e, params, n = setup.compute_bytes, shape.num_parameters, setup.world_size
    m = setup.memory
    tokens = setup.local_tokens
    stage = setup.zero_stage
    gpu: dict[str, float] = {}
    host: dict[str, float] = {}

    # -- model states ------------------------------------------------------------------------------------------
    gpu["weights (16-bit)"] = e * params / (n if stage == 3 else 1)
    gpu["gradients (16-bit)"] = e * params / (n if stage >= 2 else 1)
    optimizer = 12 * params / (n if stage >= 1 else 1)  # fp32 master + Adam m + v
    offloaded = setup.offload_optimizer
    gpu["optimizer: fp32 master + Adam m, v"] = (1 - offloaded) * optimizer
    host["optimizer: fp32 master + Adam m, v"] = offloaded * optimizer
    # DeepSpeed keeps an fp32 gradient buffer next to every host-side optimizer partition.
    host["fp32 gradients of offloaded partitions"] = offloaded * 4 * params / (n if stage >= 1 else 1)

    # -- buffers -----------------------------------------------------------------------------------------------
    if stage == 3:
        # full 16-bit copies of the layers being computed and prefetched; at the output head, the head and a layer
        head = shape.vocab_size * shape.hidden_size
        gpu["gathered parameters (ZeRO-3)"] = e * max(setup.prefetched_layers * shape.layer_parameters,
                                                      head + shape.layer_parameters)
    if stage >= 2:
        gpu["gradient reduce bucket"] = e * min(setup.reduce_bucket_size, params)
    # The optimizer step runs after backward has freed the activations: its transient competes with theirs.
    # DeepSpeed makes an fp32 copy of one sub-group's gradients, and Adam one fp32 temporary of that size.
    optimizer_transient = 2 * 4 * min(setup.sub_group_size, params / (n if stage >= 1 else 1))

    # -- activations -------------------------------------------------------------------------------------------
    layer_full = _layer_saved_bytes_per_token(shape, e, m.tiled_mlp, m.low_memory_norms)
    embedding_output = e * shape.hidden_size * tokens
    if m.activation_checkpointing:
        # every `checkpoint_interval`-th layer keeps its input; with keep_attention_outputs every layer also keeps
        # its attention output (16-bit, all heads of its tokens) and fp32 log-sum-exp per head, where inputs go
        kept = {"checkpointed layer inputs": e * shape.hidden_size * tokens
                * math.ceil(shape.num_layers / m.checkpoint_interval)}
        if m.keep_attention_outputs:
            kept["kept attention outputs"] = (e * shape.hidden_size + 4 * shape.num_heads) * tokens * shape.num_layers
        for name, value in kept.items():
            if m.offload_activations:
                host[f"{name} (offloaded)"] = value
                gpu[name] = 0.0
            else:
                gpu[name] = value
        # a stretch's recomputed inputs stay on the device until their own layer's backward (k − 1 at most)
        recomputed_inputs = (m.checkpoint_interval - 1) * e * shape.hidden_size
        layer_transient = (layer_full + _layer_backward_transient_per_token(shape, e) + recomputed_inputs) * tokens
    else:
        gpu["saved activations (all layers)"] = layer_full * tokens * shape.num_layers + embedding_output
        layer_transient = _layer_backward_transient_per_token(shape, e) * tokens
    if m.tiled_mlp:
        # one tile's MLP recompute and its gradients: (gate, up, act, product) and their gradients
        tile = min(m.mlp_tile_tokens, tokens)
        layer_transient += e * tile * shape.intermediate_size * (8 if shape.gated_mlp else 4)
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
    largest = max(candidates, key=candidates.get)
    gpu[f"largest transient: {largest}"] = max(0.0, candidates[largest])
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
