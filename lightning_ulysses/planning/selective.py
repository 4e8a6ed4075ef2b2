"""Partial layer checkpointing and selective recompute, layer by layer, for the planner and the step-time model.

With `MemoryOptions.checkpoint_layers` only some decoder layers are checkpointed: each of the others keeps what
autograd saves of it (`planner._layer_saved_bytes_per_token`, `layer_kinds.LayerKind.saved_bytes`) and is not
recomputed. A checkpointed layer keeps its input and, by option, the outputs its recompute then replays instead of
computing again (`memory/checkpointing.py`): the attention kernels' (`keep_attention_outputs`), its linear layers'
products (`keep_matmul_outputs`), its token mixer's recurrence products (`keep_token_mixer_outputs`). `layer_costs`
lists, per layer, what it keeps per local token and what its recompute runs, for the planner's bytes and the step-time
model's seconds alike; `uncheckpoint_order` is the order in which `memory="auto"` stops checkpointing layers as
memory allows (most recompute time saved per byte kept first; the last layers first among equals, see `which`).

Where the kept bytes come from (bf16, per local token), each checked against what the kept-outputs mode records in
tiny models (`tests/unit/test_selective_recompute.py`):
- Llama-style layer: q, k, v and o projections (`h + 2·kv + h`), the MLP's gate and up (or up) and down
  (`2·I + h`, `I + h`), 2 bytes each; a tiled MLP's products are never kept (it is tiled not to keep them);
- hybrids: `LayerPart.product_bytes` and `mixer_product_bytes` (layer_kinds.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_ulysses.memory import MemoryOptions

ModelShape = Any  # `planner.ModelShape` (the planner imports this module, so it is not imported here)


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer under the memory options, per local token: bytes it keeps from forward to backward, and
    what its recompute runs (none when it is not checkpointed)."""

    checkpointed: bool
    full_bytes: float  # what autograd saves of it without checkpointing
    input_bytes: float  # its kept input (checkpointed)
    attention_bytes: float  # kept attention outputs (checkpointed, keep_attention_outputs)
    product_bytes: float  # kept products (checkpointed, keep_matmul_outputs / keep_token_mixer_outputs)
    recompute_matmul_parameters: float  # weights its recomputes multiply again (2 FLOPs each per token)
    recompute_attention_width: float  # `heads · head_dim` of attention the recompute runs again
    recompute_scan_flops: float  # the recurrence's FLOPs the recompute runs again (all of them)
    kept_scan_flops: float  # the recurrence's FLOPs whose products are replayed (their elementwise rest runs again)

    @property
    def kept_bytes(self) -> float:
        if not self.checkpointed:
            return self.full_bytes
        return self.input_bytes + self.attention_bytes + self.product_bytes

    @property
    def kept_beside_input(self) -> float:
        """What a checkpointed layer keeps besides its input (host transfers when offloaded)."""
        return self.attention_bytes + self.product_bytes if self.checkpointed else 0.0


def uses_layer_costs(m: MemoryOptions) -> bool:
    """Whether the options need the per-layer accounting (else the planner's uniform one, identical for them)."""
    return m.activation_checkpointing and (m.checkpoint_layers is not None or m.keep_matmul_outputs
                                           or m.keep_token_mixer_outputs)


def which(num_layers: int, checkpoint_layers) -> tuple[bool, ...]:
    """Per layer, whether `checkpoint_layers` checkpoints it (as `memory.checkpointed_layers` picks them)."""
    if checkpoint_layers is None:
        return (True,) * num_layers
    chosen = set(range(checkpoint_layers)) if isinstance(checkpoint_layers, int) else set(checkpoint_layers)
    return tuple(index in chosen for index in range(num_layers))


def _llama_products(shape: ModelShape, e: int, tiled_mlp: bool) -> tuple[float, float]:
    """(attention projections', MLP's) kept product bytes per token of a Llama-style (or native GPT) layer."""
    h, kv, inter = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    mlp = 0.0 if tiled_mlp else e * ((2 if shape.gated_mlp else 1) * inter + h)
    return e * (2 * h + 2 * kv), mlp


def layer_costs(shape: ModelShape, e: int, m: MemoryOptions, full_per_layer: Sequence[float]) -> list[LayerCost]:
    """Every decoder layer's `LayerCost` under `m` (`full_per_layer`: the planner's saved bytes per layer)."""
    checkpointed = which(shape.num_layers, m.checkpoint_layers) if m.activation_checkpointing else \
        (False,) * shape.num_layers
    costs = []
    for index, (ckpt, full) in enumerate(zip(checkpointed, full_per_layer)):
        keeps_input = ckpt and index % m.checkpoint_interval == 0  # (every layer is checkpointed with k > 1)
        if shape.layers:
            layer = shape.layers[index]
            parts = layer.parts
            tiled = {id(layer.mlp)} if (m.tiled_mlp and layer.mlp is not None and layer.mlp.tiles) else set()
            attention = sum(e * p.attention_width + 4 * p.attention_heads for p in parts if p.attention_heads)
            products = sum(p.product_bytes or 0.0 for p in parts if id(p) not in tiled)
            mixer_products = sum(p.mixer_product_bytes for p in parts)
            matmuls = sum(p.matmul_parameters for p in parts)
            tiled_matmuls = sum(p.matmul_parameters for p in parts if id(p) in tiled)
            width = sum(p.attention_width for p in parts)
            scan = sum(p.scan_flops for p in parts)
            mixer_scan = sum(p.scan_flops for p in parts if p.mixer_product_bytes)
        else:
            attention = e * shape.hidden_size + 4 * shape.num_heads
            projections, mlp = _llama_products(shape, e, m.tiled_mlp)
            products, mixer_products, scan, mixer_scan = projections + mlp, 0.0, 0.0, 0.0
            h, kv, inter = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
            mlp_matmuls = (3 if shape.gated_mlp else 2) * h * inter
            matmuls, tiled_matmuls = 2 * h * h + 2 * h * kv + mlp_matmuls, mlp_matmuls if m.tiled_mlp else 0
            width = shape.hidden_size
        keep_attention, keep_products = ckpt and m.keep_attention_outputs, ckpt and m.keep_matmul_outputs
        keep_mixer = ckpt and m.keep_token_mixer_outputs
        costs.append(LayerCost(
            checkpointed=ckpt, full_bytes=full, input_bytes=e * shape.hidden_size if keeps_input else 0.0,
            attention_bytes=attention if keep_attention else 0.0,
            product_bytes=(products if keep_products else 0.0) + (mixer_products if keep_mixer else 0.0),
            # a tiled MLP runs its forward again in its own backward, checkpointed or not, and keeps no product
            # (a checkpointed layer's recompute leaves it out: memory/tiled_mlp.py)
            recompute_matmul_parameters=tiled_matmuls if not ckpt or keep_products else matmuls,
            recompute_attention_width=0.0 if not ckpt or keep_attention else width,
            recompute_scan_flops=(scan - (mixer_scan if keep_mixer else 0.0)) if ckpt else 0.0,
            kept_scan_flops=mixer_scan if keep_mixer else 0.0))
    return costs


def activation_terms(costs: Sequence[LayerCost], tokens: int, e: int, hidden: int, offload: bool,
                     backward_transient: float, first_layer_input: float,
                     interval: int = 1) -> tuple[dict, dict, float]:
    """(device terms, host terms, one layer's largest backward transient in bytes) of the layers' activations.

    A layer's backward needs, besides what every layer before it keeps: a checkpointed one, its recompute (what it
    saves without checkpointing, with the kept tensors replayed into it) and the gradients (`backward_transient`, per
    token), plus the next kept input coming back when offloaded; one that is not checkpointed, the gradients only.
    What the layers after it kept is freed by then, so a layer's transient is counted less what the un-checkpointed
    layers after it kept (nothing when every layer is checkpointed). With `checkpoint_interval` k, a stretch's
    recomputed inputs (k − 1) stay on the device until their own layer's backward."""
    device, host = {}, {}
    inputs = sum(c.input_bytes for c in costs) * tokens
    attention = sum(c.attention_bytes for c in costs) * tokens
    products = sum(c.product_bytes for c in costs) * tokens
    for name, value in (("checkpointed layer inputs", inputs), ("kept attention outputs", attention),
                        ("kept products", products)):
        if not value and name != "checkpointed layer inputs":
            continue
        if offload:
            host[f"{name} (offloaded)"] = value
            device[name] = 0.0
        else:
            device[name] = value
    plain = [c for c in costs if not c.checkpointed]
    if plain:
        device["saved activations (layers not checkpointed)"] = (
            sum(c.full_bytes for c in plain) + (first_layer_input if not costs[0].checkpointed else 0.0)) * tokens
    # offloaded: the next layer's kept input comes back while this one runs backward (`prefetch_input`)
    prefetched = (e * hidden if offload else 0.0) + (interval - 1) * e * hidden
    largest, freed = 0.0, 0.0
    for cost in reversed(costs):  # backward order
        own = (cost.full_bytes + backward_transient + prefetched) if cost.checkpointed else backward_transient
        largest = max(largest, own - freed)
        if not cost.checkpointed:
            freed += cost.full_bytes
    return device, host, largest * tokens


def uncheckpoint_order(costs: Sequence[LayerCost], seconds_saved: Sequence[float]) -> list[int]:
    """The layers in the order `memory="auto"` leaves them un-checkpointed: most recompute seconds saved per byte
    more kept first; among equals (a Llama-style shape's layers are all equal) the last layers first, which run
    backward first: what they keep is freed before any checkpointed layer's recompute peaks."""
    def extra(index: int) -> float:
        return max(costs[index].full_bytes - costs[index].kept_bytes, 1e-9)

    return sorted(range(len(costs)), key=lambda i: (-round(seconds_saved[i] / extra(i), 12), -i))


def describe(checkpoint_layers, num_layers: int) -> Optional[str]:
    """`checkpoint_layers` for a report: None when every layer is checkpointed."""
    if checkpoint_layers is None:
        return None
    chosen = which(num_layers, checkpoint_layers)
    return f"{sum(chosen)} of {num_layers} (layers {[i for i, c in enumerate(chosen) if c]})"
