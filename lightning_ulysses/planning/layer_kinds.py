"""Hybrid decoder layers for the planner: per-layer kinds, each part declared by what it costs.

A Llama-style shape (`planner.ModelShape` without `layers`) has one kind of layer: softmax attention and an MLP.
Hybrid models (Qwen3-Next: Gated DeltaNet in three layers of four, a gated attention in the fourth, a mixture of
experts everywhere; Nemotron-H: blocks that are each one of Mamba2, attention, an MLP or a mixture of experts) have
several, and their token mixers cost what no attention layer does: a chunked recurrence whose activations are per
chunk (C×C matrices per head, one state per head and chunk), a short convolution, wider projections. Each part of a
layer is a `LayerPart` — parameters, the weights a token multiplies, the bytes autograd keeps per token, the
recurrence's own FLOPs per token, and the softmax attention in it if any — and a layer is a `LayerKind` (a token
mixer, an MLP, its norms). The parts' costs are here, one function per kind of part; which parts a family's
layers hold, read from its config (`layer_types`, `layers_block_type` or `hybrid_override_pattern`, and each
mixer's widths), is declared by the family (`Family.planner_layers`, lightning_ulysses/families/), and
`hybrid_layers(config)` asks it; the planner and the step-time model sum them layer by layer.

The saved bytes are linear forms in the widths, fit to what autograd keeps in the layers as the strategy runs them
(bf16, our linear-time delta rule for Gated DeltaNet, our blockwise SSD scan for Mamba2, transformers' PyTorch paths
elsewhere: its eager experts loop for the mixtures of experts), measured per part on tiny CPU models of many widths
(`tests/unit/test_hybrid_shapes.py` holds whole models to them). They assume 16-bit compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_ulysses.adapters.registry import planner_layers_of

# Gated DeltaNet's chunk (ours and flash-linear-attention's), in tokens.
DELTA_RULE_CHUNK = 64
# Our Mamba2 scan's block, in tokens (mixers/ssd.py; the planner does not import the mixers).
SSD_BLOCK_TOKENS = 4096


@dataclass(frozen=True)
class LayerPart:
    """One part of a hybrid decoder layer (a token mixer or an MLP), by what it costs.

    `saved_bytes`: what autograd keeps of it per local token for backward, its input (the norm's output) included;
    `matmul_parameters`: the weights each token multiplies (2 FLOPs each forward; a mixture of experts: the routed and
    shared experts a token reaches, and the router); `scan_flops`: the recurrence's and the convolution's forward
    FLOPs per token beyond those (chunked: they do not grow with the row); `attention_width` and `attention_heads`:
    a causal softmax attention's `heads · head_dim` and heads (its `s²` FLOPs; 0: none); `tiles`: whether the
    memory engine's tiled MLP applies to it (an MLP whose module is the layer's `mlp`).

    What a checkpointed layer keeps of it per token with the kept products (`memory/checkpointing.py`, fit to the
    outputs its kept-outputs mode records in tiny bf16 models: `tests/unit/test_selective_recompute.py`):
    `product_bytes`, its linear layers' outputs (`keep_matmul_outputs`; None: not declared, so the option is left
    off); `mixer_product_bytes`, the fp32 products of its chunked recurrence (`keep_token_mixer_outputs`; 0: none
    marked). `scan_recomputed_in_backward`: its recurrence runs its forward once more in its own backward (our
    blockwise Mamba2 scan: `scan_flops` a fourth time per step)."""

    kind: str
    parameters: int
    matmul_parameters: int
    saved_bytes: float
    scan_flops: float = 0.0
    attention_width: int = 0
    attention_heads: int = 0
    tiles: bool = False
    product_bytes: Optional[float] = None
    mixer_product_bytes: float = 0.0
    scan_recomputed_in_backward: bool = False


@dataclass(frozen=True)
class LayerKind:
    """A decoder layer: its token mixer and its MLP (either may be absent: Nemotron-H's blocks hold one of them) and
    how many norms it has; `norm_bytes`: what each norm keeps per token (Hugging Face's RMSNorms keep an fp32 copy of
    their input and the fp32 (Gemma-style, `1 + weight`) or 16-bit normalised values)."""

    mixer: Optional[LayerPart]
    mlp: Optional[LayerPart]
    norms: int
    norm_bytes: float
    hidden_norm_size: int  # the hidden size: each norm's weight, and a tiled MLP's kept input

    @property
    def parts(self) -> tuple[LayerPart, ...]:
        return tuple(part for part in (self.mixer, self.mlp) if part is not None)

    @property
    def parameters(self) -> int:
        return sum(part.parameters for part in self.parts) + self.norms * self.hidden_norm_size

    def saved_bytes(self, tiled_mlp: bool) -> float:
        """Per local token, without checkpointing: the norms and the parts; a tiled MLP keeps its input only."""
        mlp = 0.0 if self.mlp is None else (self.mlp.saved_bytes if not (tiled_mlp and self.mlp.tiles)
                                            else 2.0 * self.hidden_norm_size)
        return self.norms * self.norm_bytes + (0.0 if self.mixer is None else self.mixer.saved_bytes) + mlp

    def tile_transient_bytes(self, tile_tokens: int) -> float:
        """A tiled MLP's one tile recomputed with its gradients in its backward (twice what it keeps per token)."""
        if self.mlp is None or not self.mlp.tiles:
            return 0.0
        return 2.0 * self.mlp.saved_bytes * tile_tokens


def gated_deltanet(h: int, key_heads: int, key_dim: int, value_heads: int, value_dim: int, kernel: int) -> LayerPart:
    """Gated DeltaNet (Qwen3-Next): `in_proj_qkvz`, `in_proj_ba`, a depthwise convolution over [q | k | v], the
    chunked delta rule, a gated norm per value head, `out_proj`. Kept per token (fit, within 0.4%): 5 fp32 C×C
    matrices per value head (20·C bytes), fp32 copies of the repeated query/key (32 per value-head key channel) and
    the values, gates and outputs (36 per value channel), 8 per key channel, the state entering each chunk
    (fp32, `dk·dv / C` per value head) and the 16-bit input."""
    key, value = key_heads * key_dim, value_heads * value_dim
    conv = 2 * key + value
    projections = h * (2 * key + 2 * value) + h * 2 * value_heads + value * h
    parameters = projections + conv * kernel + 2 * value_heads + value_dim
    chunk = DELTA_RULE_CHUNK
    saved = (20 * value_heads * chunk + 32 * value_heads * key_dim + 36 * value + 8 * key
             + 4 * value_heads * key_dim * value_dim / chunk + 2 * h)
    # per value head and token: the chunk's products (q·kᵀ, k·kᵀ, the triangular solves on C columns, the read of
    # the within-chunk values: ~4·C·(dk + dv)) and the state's reads and update (3·dk·dv), 2 FLOPs per multiply-add
    scan = 2 * value_heads * (4 * chunk * (key_dim + value_dim) / 2 + 3 * key_dim * value_dim) + 2 * conv * kernel
    # kept products: the projections' 16-bit outputs ([q | k | v | z], [b | a], the output); the delta rule's fp32
    # products per value head: q·kᵀ and k·kᵀ within the chunk (C each), its two triangular solves (dv, dk), and per
    # chunk the state's reads and the outputs (3·dv) and its update (dk·dv / C)
    products = 2 * (2 * key + 2 * value + 2 * value_heads + h)
    mixer_products = 4 * value_heads * (2 * chunk + 4 * value_dim + key_dim + key_dim * value_dim / chunk)
    return LayerPart("gated_deltanet", parameters, projections, saved, scan_flops=scan, product_bytes=products,
                     mixer_product_bytes=mixer_products)


def mamba2(h: int, heads: int, head_dim: int, state: int, groups: int, kernel: int, chunk: int) -> LayerPart:
    """Mamba2 (Nemotron-H): `in_proj` to [z | x | B | C | dt], a depthwise convolution over [x | B | C], the chunked
    SSD scan (ours, `mixers/ssd.py`: blocks of `SSD_BLOCK_TOKENS` recomputed in backward), a gated group norm,
    `out_proj`. Kept per token (fit within 0.3%): 30 bytes per inner channel (the projection's 16-bit z and x, the
    convolution's output and activation, the norm's fp32 gate, scan output and products, its 16-bit output), 12 per
    group state entry (B and C: projected, convolved, activated), 2 per head (the step), the 16-bit input, and the
    fp32 state entering each block of the scan. (transformers' own PyTorch scan kept about 1 MB per token at
    Nemotron-H-8B's widths: 12 bytes per head and chunk position, 21.5 per head and state entry, ...)"""
    inner = heads * head_dim
    conv = inner + 2 * groups * state
    projections = h * (inner + conv + heads) + inner * h
    parameters = projections + conv * (kernel + 1) + 3 * heads + inner
    block = max(1, SSD_BLOCK_TOKENS // chunk) * chunk
    saved = 30 * inner + 12 * groups * state + 2 * heads + 2 * h + 4 * inner * state / block
    # per token: C×C scores per group (C·N), their use per head (C·P), the states in and out per head (2·P·N), 2 FLOPs
    # each multiply-add
    scan = 2 * (2 * chunk * (groups * state + heads * head_dim) + 2 * heads * head_dim * state) + 2 * conv * kernel
    # kept products: the projections' 16-bit outputs ([z | x | B | C | dt], the output); the scan's fp32 products:
    # C·Bᵀ per group and chunk position, the within-chunk and the carried outputs (an inner channel each), each
    # chunk's state contribution and the states entering the chunks (per chunk: `inner · state / chunk` each; one
    # more per block: the state leaving it)
    products = 2 * (inner + conv + heads + h)
    mixer_products = 4 * (groups * chunk + 2 * inner + 2 * inner * state / chunk + inner * state / block)
    return LayerPart("mamba2", parameters, projections, saved, scan_flops=scan, product_bytes=products,
                     mixer_product_bytes=mixer_products, scan_recomputed_in_backward=True)


def softmax_attention(h: int, heads: int, kv_heads: int, head_dim: int, gated: bool, e: int = 2) -> LayerPart:
    """Causal softmax attention with `heads · head_dim` query channels. Gated (Qwen3-Next: `q_proj` also gives a
    sigmoid gate of the output; RMSNorms on the query and key heads): kept per token, fit within 2%: 18 bytes per
    query channel, 12.5 per key-value channel, 24 per head, 4 per hidden value. Plain: q, k, v, the output and the
    o-projection's input (16-bit), fp32 log-sum-exp per head, and the input."""
    q, kv = heads * head_dim, kv_heads * head_dim
    projections = h * q * (2 if gated else 1) + 2 * h * kv + q * h
    parameters = projections + (2 * head_dim if gated else 0)
    saved = (18 * q + 12.5 * kv + 24 * heads + 4 * h) if gated else e * (h + 3 * q + 2 * kv) + 4 * heads
    products = e * (q * (2 if gated else 1) + 2 * kv + h)  # q (and its gate), k, v, the output projection
    return LayerPart("attention", parameters, projections, saved, attention_width=q, attention_heads=heads,
                     product_bytes=products)


def dense_mlp(h: int, intermediate: int, gated: bool) -> LayerPart:
    """SwiGLU (gate, up, their product and activation: 8 bytes per channel) or a plain MLP (up and its activation:
    4), plus the 16-bit input."""
    matrices = 3 if gated else 2
    return LayerPart("mlp", matrices * h * intermediate, matrices * h * intermediate,
                     (8 if gated else 4) * intermediate + 2 * h, tiles=True,
                     product_bytes=2 * ((matrices - 1) * intermediate + h))


def experts(h: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int, gated: bool,
            tiles: bool) -> LayerPart:
    """A mixture of experts run by transformers' eager loop over experts: each token's `top_k` routed copies and their
    expert activations (fit on Qwen3-Next within 1%: 11 bytes per expert channel and 3 per hidden value per routed
    copy), the router's probabilities (28 bytes per expert, less 340), a shared expert (as a dense MLP of its width)
    and the 16-bit input and gates (9.4 per hidden value). Non-gated experts keep 2 of their 3 gated values."""
    matrices = 3 if gated else 2
    expert = matrices * h * intermediate
    shared = matrices * h * shared_intermediate
    parameters = num_experts * expert + shared + num_experts * h + (h if shared_intermediate and gated else 0)
    routed = (11 if gated else 22 / 3) * intermediate + 3 * h
    saved = (max(0.0, 28.25 * num_experts - 340) + top_k * routed + (8.75 if gated else 35 / 6) * shared_intermediate
             + 9.4 * h)
    # kept products: the router's logits, each routed copy's gate/up and down outputs, the shared expert's and its
    # one-value gate
    products = 2 * (num_experts + top_k * ((matrices - 1) * intermediate + h)
                    + ((matrices - 1) * shared_intermediate + h + 1 if shared_intermediate else 0))
    return LayerPart("moe", parameters, top_k * expert + shared + num_experts * h, saved, tiles=tiles,
                     product_bytes=products)


def setting(config: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` the config sets (families spell the same width differently), else `default`."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def layer_types(config: Any) -> Optional[list[str]]:
    """The config's kind of each layer (`layers_block_type` or `layer_types`; None: it declares none)."""
    return setting(config, "layers_block_type", "layer_types")


def attention_only(types: Optional[list[str]]) -> bool:
    """Whether layers of these kinds are all softmax attention (a Llama-style shape: no `LayerKind`s needed)."""
    return types is None or all(t in ("full_attention", "attention", "sliding_attention") for t in types)


def attention_shape(config: Any) -> tuple[int, int, int, int]:
    """(hidden size, heads, KV heads, head dim) of a config's attention."""
    h, heads = config.hidden_size, config.num_attention_heads
    return h, heads, setting(config, "num_key_value_heads", default=heads), setting(config, "head_dim",
                                                                                     default=h // heads)


def undeclared(config: Any, types: list[str]) -> ValueError:
    """The refusal of a hybrid whose layers' costs are not declared (measured): planning it as something else would
    be silently wrong."""
    return ValueError(f"memory=\"auto\" has no costs declared for the token mixers of {config.model_type} (layer"
                      f" types {sorted(set(types))}); set the memory features by hand (memory={{...}}).")


def hybrid_layers(config: Any) -> Optional[tuple[LayerKind, ...]]:
    """The layer kinds of a Hugging Face hybrid config, as its family declares them (`Family.planner_layers`, in
    lightning_ulysses/families/: Gated DeltaNet + gated attention with dense or expert MLPs, Qwen3-Next; Mamba2 /
    attention / MLP / expert blocks, Nemotron-H), or None for a config with attention layers only (a Llama-style
    shape). Raises `ValueError` for any other hybrid: its costs are not declared (measured) here, and planning it as
    something else would be silently wrong."""
    planner_layers = planner_layers_of(config)
    if planner_layers is not None:
        return planner_layers(config)
    types = layer_types(config)
    pattern = getattr(config, "hybrid_override_pattern", None)
    if types is None and pattern is not None:  # a pattern of characters per layer ("*": attention)
        types = ["attention" if character == "*" else character for character in pattern]
    if attention_only(types):
        return None
    raise undeclared(config, types)


def attention_layers(layers: tuple[LayerKind, ...]) -> int:
    """How many of `layers` hold a softmax attention."""
    return sum(1 for layer in layers if layer.mixer is not None and layer.mixer.attention_heads)


def features_the_layers_refuse(layers: tuple[LayerKind, ...]) -> frozenset[str]:
    """What the memory engine refuses on a hybrid of these layers, from its config alone (`plan=true`; a built model
    is asked directly: `memory.features_refused_by`): the tiled MLP unless every layer has an `mlp` it tiles, the
    low-memory norms and the fused elementwise kernels (the hybrids declared here have norms that are not
    Llama-style: Qwen3-Next's `1 + weight`, Mamba2's grouped gated norm)."""
    if not layers:
        return frozenset()
    refused = {"low_memory_norms", "fused_elementwise"}
    if not all(layer.mlp is not None and layer.mlp.tiles for layer in layers):
        refused.add("tiled_mlp")
    return frozenset(refused)
