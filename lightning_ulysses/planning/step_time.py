"""Step-time model: seconds of one training step, term by term, next to the memory planner's bytes.

`predict_step_time(shape, setup, kernel)` returns every term (the step's matmuls, each recompute a memory feature
adds, attention forward and backward with the chosen SDPA kernel, host transfers of offloaded activations, the CPU
Adam share of an offloaded optimizer, the GPU optimizer, a fixed cost) so that `memory="auto"` can say *why* it
chose what it chose. The constants (`H200`, `H100`; `speeds_for` picks them by device) are calibrated from the
measurements committed under `benchmarks/results/`, listed in `calibration.py` (`CALIBRATION`, `H100_CALIBRATION`;
`python -m lightning_ulysses.planning.calibration` prints prediction against measurement). What the model counts:

- matmuls: 2 FLOPs per parameter and token forward, 4 backward (the linear layers and the output head), at one
  effective rate (`matmul_flops`, which also absorbs ZeRO-3's gathers and the elementwise kernels);
- causal attention: `2·s²·hidden` FLOPs per layer forward over the whole row (`s` tokens; Ulysses gives each rank
  `heads / sp` heads), twice that backward, at the measured rate of each SDPA kernel;
- recompute: a checkpointed layer runs its forward once more in backward, and `checkpoint_interval` k adds
  `(k − 1) / k` forwards per layer (the stretch's inputs); the attention forward is recomputed unless
  `keep_attention_outputs` replays it; a tiled MLP recomputes its forward once more in its own backward, which
  costs nothing more under layer checkpointing (the layer's recompute leaves the MLP's forward out: `tiled_mlp.py`;
  measured before 2026-12-02 it ran there too: `calibration.Measured.deferred_mlp`);
- host transfers: offloaded layer inputs (and kept attention outputs) go to the host in forward and come back in
  backward (`host_link_bytes`); the copies overlap with compute (`HostActivationStore.overlap_transfers`), leaving
  `overlapped_transfer_factor` of that time on the critical path (`calibration.OVERLAP_PAIRS`: measured with the copies on the
  compute stream and beside it, one run each);
- optimizer: GPU Adam per element kept on the GPU; CPU Adam per offloaded element (with its gradient and parameter
  copies); with any offload, ZeRO-3's 16-bit gradients of every element cross the host link;
- hybrids (`layer_kinds`): each layer's parts' matmuls (an expert MLP: the experts a token reaches), causal attention
  only in attention layers (`heads · head_dim` wide), and the recurrences' own FLOPs (`scan_flops`, forward ×3 with
  backward, once more per recompute, and once more for our blockwise Mamba2 scan, which recomputes its blocks in its
  backward) at `DeviceSpeeds.scan_flops`, the rate of our PyTorch delta rule on the H200;
  the Qwen3-Next-like shape's measured forward + backward steps are within 15% (`tests/unit/test_hybrid_shapes.py`);
- a fixed cost per step (the hooks and launches that do not grow with the sequence);
- the host: ZeRO-3's hooks and Python cost a fixed part per step and a part per decoder layer and pass (forward,
  backward, recompute); where that is longer than everything above, the step waits for the host (1B at 4K). On a
  CPU device (tests, notebooks) it adds up with the rest instead.
`fused_elementwise` scales the elementwise term (and its recomputed third) by `fused_elementwise_factor`, fit to
the whole steps measured with and without it in one run (`calibration.FUSED_PAIRS`: the saving, not the step, is what they pin;
the 8B 32K step itself is over-predicted by ~10%, fused or not).
Tiled logits + loss and low-memory norms cost no modelled time (measured within noise); on equal predicted times
`memory="auto"` takes the configuration with fewer features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lightning_ulysses.planning.planner import ModelShape, TrainingSetup, optimizer_sub_groups
from lightning_ulysses.planning.selective import layer_costs, uses_layer_costs


@dataclass(frozen=True)
class DeviceSpeeds:
    """The step-time model's constants for one device (rates in FLOP/s, bytes/s, elements/s)."""

    name: str
    matmul_flops: float
    attention_forward_flops: dict
    attention_backward_flops: dict
    host_link_bytes: float
    gpu_adam_elements: float
    cpu_adam_elements: float
    step_overhead_s: float
    elementwise_s: float  # per layer, token and hidden value, forward + backward (norms, RoPE, SiLU, residuals)
    # The elementwise term's share left with `fused_elementwise` (compiled norms and gated activations).
    fused_elementwise_factor: float = 1.0
    # The offloaded activations' transfer time left on the critical path when the copies overlap with compute.
    overlapped_transfer_factor: float = 1.0
    # The host's own work per step: a fixed part and one per decoder layer and pass (ZeRO-3's hooks, Python). A step
    # waits on the host when this is longer than the device's work (short sequences: the 1B shape at 4K).
    host_step_s: float = 0.0
    host_layer_pass_s: float = 0.0
    # A hybrid's token-mixer recurrences (chunked delta rule, SSD scan; `layer_kinds.LayerPart.scan_flops`), forward
    # and backward, in PyTorch: many small matmuls per chunk, far below the matmul rate.
    scan_flops: float = 1.2e12
    # What a recurrence's recompute still costs when its products are kept (`keep_token_mixer_outputs`): the
    # elementwise ops between them (per chunk: the state's decay and update, the corrections' subtraction). Not
    # measured yet: 3 of the 8 per-chunk operations, on the same small tensors (launch-bound), taken as a quarter.
    kept_scan_share: float = 0.25


# Attention rates: `benchmarks/results/2026-11-29-h200-long-sequence/attention-kernels.jsonl` (causal, 32 heads,
# 8 KV heads, d 128; mean of 32K and 128K): forward = 2·s²·h / forward time, backward = 4·s²·h / (forward+backward
# time − forward time). "flash" is torch's default order on Hopper; "efficient" was measured without GQA; "math"
# is not an exact fused kernel and is taken as a quarter of "efficient". Matmul rate, link, Adam and overhead: fit
# to `calibration.CALIBRATION` (see `tests/unit/test_auto_memory.py`).
H200 = DeviceSpeeds(
    name="NVIDIA H200",
    matmul_flops=720e12,
    # "fa4": FlashAttention-4's CuTe kernels at 128K (`benchmarks/results/2026-12-04-h200-attention-kernels/`)
    attention_forward_flops={"fa4": 644e12, "cudnn": 620e12, "flash": 339e12, "efficient": 177e12, "math": 44e12},
    attention_backward_flops={"fa4": 468e12, "cudnn": 413e12, "flash": 256e12, "efficient": 108e12, "math": 27e12},
    host_link_bytes=100e9,
    gpu_adam_elements=60e9,
    cpu_adam_elements=1.2e9,
    step_overhead_s=0.05,
    elementwise_s=3.5e-10,
    # 8B shape, with and without it in one run: 0.480 s saved of 6.41 at 32K, 2.02 s of 53.7 at 128K; both give
    # 0.75 (1 - saving / the elementwise term with its recomputed third): `calibration.FUSED_PAIRS`
    fused_elementwise_factor=0.75,
    # 8B shape, the copies on the compute stream and overlapped in one run: 0.262 s saved of the 0.344 s term at 32K
    # (0.24 left), 1.366 s of 1.374 s at 128K (0.01 left): 0.1 predicts both savings within 20% (`calibration.OVERLAP_PAIRS`)
    overlapped_transfer_factor=0.1,
    # 1B shape at 4K, with and without layer checkpointing in one run (0.214 / 0.242 s, GPU work ~0.16 / 0.18 s):
    # each layer pass (forward, backward, recompute) ~1.7 ms of host time, plus ~0.16 s per step (the 1B 4K pair of
    # `AUTO_VS_HAND_PAIRS`). A rough fit: two identical 1B 8K steps measured 12% apart in the same call.
    host_step_s=0.158,
    host_layer_pass_s=1.73e-3,
    # Our chunked delta rule alone at Qwen3-Next's widths (32 value heads of 128), forward + backward: 0.320 s at 32K,
    # 2.106 s at 128K, 3.627 s at 256K (`benchmarks/results/2026-12-03-h200-delta-rule/delta_rule.jsonl`), i.e. 1.6,
    # 1.0 and 1.1e12 FLOP/s of `gated_deltanet`'s scan FLOPs; Mamba2's PyTorch SSD not measured (taken alike).
    scan_flops=1.2e12,
)

# The H100 (SXM, 80 GB HBM3), measured on the lent `nvidia-h100-x1` (benchmarks/results/2026-12-07-h100-calibration/
# and -h100-memory-auto/): the attention rates as the H200's (`attention_kernels.py`, mean of 32K and 128K); the
# matmul rate the H200's fit times the two cards' measured 8192³ products (762.5 against 772 TFLOP/s); the
# elementwise term fit to the 1B shape's whole steps at 32K and CPU Adam to memory="auto"'s 8B steps at 8K, 32K and
# 128K (`calibration.H100_CALIBRATION`, least squares, one constant each, the rest held fixed); GPU Adam and the host
# link measured (`device_speeds.py`). The fixed and host terms and the fused and overlap factors are the H200's (fit
# to savings measured there, not here).
H100 = DeviceSpeeds(
    name="NVIDIA H100 80GB HBM3",
    matmul_flops=711e12,
    # "fa4" not measured on the H100 (no FlashAttention-4 wheel carried): the H200's; "efficient" and "math" as there
    attention_forward_flops={**H200.attention_forward_flops, "cudnn": 592e12, "flash": 340e12},
    attention_backward_flops={**H200.attention_backward_flops, "cudnn": 431e12, "flash": 258e12},
    host_link_bytes=88e9,  # pinned, both directions at once (55 GB/s each alone)
    gpu_adam_elements=33e9,  # torch AdamW's foreach step over 5e8 fp32 elements
    # DeepSpeed's offloaded step per host element (its copies included): 1.32e9 fit; the optimizer step timed alone
    # gives 1.34e9 (8K) and 1.32e9 (32K); the bare CPU Adam update ran 4.2e9 elements/s on the same host
    cpu_adam_elements=1.32e9,
    step_overhead_s=H200.step_overhead_s,
    elementwise_s=3.67e-10,
    fused_elementwise_factor=H200.fused_elementwise_factor,
    overlapped_transfer_factor=H200.overlapped_transfer_factor,
    host_step_s=H200.host_step_s,
    host_layer_pass_s=H200.host_layer_pass_s,
    scan_flops=H200.scan_flops,
)

# The devices whose speeds are measured, each with the properties `speeds_for` matches an unknown card by.
KNOWN_DEVICES = {
    H200.name: (H200, {"capability": (9, 0), "memory_gib": 139.8, "multiprocessors": 132}),
    H100.name: (H100, {"capability": (9, 0), "memory_gib": 79.2, "multiprocessors": 132}),
}


def speeds_for(name: str, capability: tuple = (0, 0), memory_bytes: float = 0.0,
               multiprocessors: int = 0) -> tuple[DeviceSpeeds, Optional[str]]:
    """The step-time constants for a device (`torch.cuda.get_device_name` and properties): a measured one's own, or
    the nearest measured one's (same compute capability first, then the closest memory size, then multiprocessor
    count), with one line saying so (None for a known device)."""
    if name in KNOWN_DEVICES:
        return KNOWN_DEVICES[name][0], None

    def distance(item) -> tuple:
        known = item[1][1]
        size = abs(math.log(max(memory_bytes, 1.0) / (known["memory_gib"] * 2**30)))
        return (tuple(capability) != known["capability"], size, abs(multiprocessors - known["multiprocessors"]))

    speeds = min(KNOWN_DEVICES.items(), key=distance)[1][0]
    return speeds, (f'lightning_ulysses memory="auto": no step-time constants measured for {name!r} (compute'
                    f" capability {capability[0]}.{capability[1]}, {memory_bytes / 2**30:.0f} GiB); predicting with"
                    f" the nearest measured device's, {speeds.name}")


def _attention_width(shape: ModelShape) -> float:
    """Σ over the softmax-attention layers of `heads · head_dim` (a Llama-style shape: layers × hidden size)."""
    if shape.layers:
        return sum(part.attention_width for layer in shape.layers for part in layer.parts)
    return shape.hidden_size * shape.num_layers


def model_flops_per_step(shape: ModelShape, seq_len: int, micro_batch: int = 1) -> float:
    """The model's FLOPs of one forward + backward over `micro_batch` rows of `seq_len` tokens (no recompute): the
    matmuls (6 per weight a token multiplies), causal attention (`2·s²·width` forward, twice that backward) and a
    hybrid's recurrences (3 × their forward FLOPs)."""
    layers, _, head = _matmul_parameters(shape)
    tokens = micro_batch * seq_len
    scans = sum(part.scan_flops for layer in shape.layers for part in layer.parts)
    return (6 * (layers + head) * tokens + 3 * micro_batch * 2 * seq_len ** 2 * _attention_width(shape)
            + 3 * scans * tokens)


@dataclass
class StepTime:
    terms: dict  # seconds, by term

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def summary(self, top: int = 5) -> str:
        largest = sorted(self.terms.items(), key=lambda item: -item[1])[:top]
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in largest if seconds >= 0.005)


def _matmul_parameters(shape: ModelShape) -> tuple[float, float, float]:
    """Per token: (parameters of all decoder layers' linears, of one layer's MLP (a hybrid: its tiled MLPs' over the
    layers, per layer), of the output head)."""
    if shape.layers:  # a hybrid: the weights each token multiplies, part by part (an expert MLP: those it reaches)
        tiled = sum(layer.mlp.matmul_parameters for layer in shape.layers if layer.mlp is not None and layer.mlp.tiles)
        return (sum(part.matmul_parameters for layer in shape.layers for part in layer.parts),
                tiled / shape.num_layers, shape.vocab_size * shape.hidden_size)
    h, kv, inter = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    attention = 2 * h * h + 2 * h * kv
    mlp = (3 if shape.gated_mlp else 2) * h * inter
    return shape.num_layers * (attention + mlp), mlp, shape.vocab_size * h


def layer_recompute_seconds(shape: ModelShape, setup: TrainingSetup, kernel: Optional[str] = "cudnn",
                            speeds: DeviceSpeeds = H200) -> list[float]:
    """Per decoder layer, the seconds its recompute takes under `setup` (0 for a layer not checkpointed): its
    matmuls, its share of the elementwise work (a third of it is forward), its attention forward unless kept, its
    recurrence (the elementwise rest of it, `kept_scan_share`, where its products are kept)."""
    m = setup.memory
    tokens = setup.local_tokens
    costs = layer_costs(shape, setup.compute_bytes, m, [0.0] * shape.num_layers)
    attention = setup.micro_batch * 2 * setup.seq_len ** 2 / setup.sequence_parallel_size
    elementwise = (speeds.elementwise_s * tokens * shape.hidden_size
                   * (speeds.fused_elementwise_factor if m.fused_elementwise else 1.0))
    forwards = 1 + (m.checkpoint_interval - 1) / m.checkpoint_interval  # a stretch's inputs, recomputed once more
    seconds = []
    for cost in costs:
        time = (2 * cost.recompute_matmul_parameters * tokens / speeds.matmul_flops
                + (cost.recompute_scan_flops + speeds.kept_scan_share * cost.kept_scan_flops) * tokens
                / speeds.scan_flops)
        if cost.checkpointed:
            time += (elementwise / 3 + attention * cost.recompute_attention_width
                     / speeds.attention_forward_flops[kernel or "flash"])
        seconds.append(time * (forwards if cost.checkpointed else 1.0))
    return seconds


def _layer_by_layer_recompute(shape: ModelShape, setup: TrainingSetup, kernel: Optional[str], speeds: DeviceSpeeds,
                              terms: dict, overlapped_copies: bool) -> float:
    """The recompute and offload terms of `setup` layer by layer (`selective.layer_costs`), into `terms`; returns
    the extra layer passes per layer (for the host's per-layer work)."""
    m, tokens = setup.memory, setup.local_tokens
    costs = layer_costs(shape, setup.compute_bytes, m, [0.0] * shape.num_layers)
    seconds = layer_recompute_seconds(shape, setup, kernel, speeds)
    terms["recompute: checkpointed layers" if m.checkpoint_layers is None else
          f"recompute: {sum(c.checkpointed for c in costs)} of {len(costs)} layers"] = sum(seconds)
    if m.offload_activations:
        kept = sum(cost.input_bytes + cost.kept_beside_input for cost in costs)
        share = speeds.overlapped_transfer_factor if overlapped_copies else 1.0
        terms["host transfers: offloaded activations"] = 2 * kept * tokens * share / speeds.host_link_bytes
    forwards = 1 + (m.checkpoint_interval - 1) / m.checkpoint_interval
    return forwards * sum(cost.checkpointed for cost in costs) / len(costs)


def predict_step_time(shape: ModelShape, setup: TrainingSetup, kernel: Optional[str] = "cudnn",
                      speeds: DeviceSpeeds = H200, overlapped_copies: bool = True,
                      deferred_mlp: bool = True, host_beside_device: bool = True) -> StepTime:
    """Seconds of one training step on one rank, by term. `kernel`: the SDPA kernel attention runs with (None:
    torch's default order, i.e. flash on Hopper); `overlapped_copies`: whether offloaded activations are copied
    beside compute (the default; False: on the compute stream, as measured before 2026-12-02); `deferred_mlp`:
    whether a checkpointed layer's recompute leaves its tiled MLP's forward out (the default; False: as measured
    before it did); `host_beside_device`: the host's work runs beside the device's, so the longer bounds the step
    (a GPU; False: the device is the host's own CPU, where the two add up)."""
    m, kernel = setup.memory, kernel or "flash"
    tokens = setup.local_tokens
    layers, mlp, head = _matmul_parameters(shape)
    # ZeRO-3 shards; every rank still computes its own tokens with whole weights, so FLOPs do not shrink with ZeRO.
    forward = 2 * (layers + head) * tokens
    attention_forward = (setup.micro_batch * 2 * setup.seq_len ** 2 * _attention_width(shape)
                         / setup.sequence_parallel_size)
    scan_forward = tokens * sum(part.scan_flops for layer in shape.layers for part in layer.parts)
    terms = {"matmuls (forward + backward)": 3 * forward / speeds.matmul_flops,
             "attention forward": attention_forward / speeds.attention_forward_flops[kernel],
             "attention backward": 2 * attention_forward / speeds.attention_backward_flops[kernel],
             "elementwise kernels": speeds.elementwise_s * shape.num_layers * tokens * shape.hidden_size
                                    * (speeds.fused_elementwise_factor if m.fused_elementwise else 1.0)}
    if scan_forward:
        terms["token-mixer scans (forward + backward)"] = 3 * scan_forward / speeds.scan_flops
    # (our blockwise Mamba2 scan runs each block's forward again in its backward: mixers/ssd.py)
    scan_again = tokens * sum(part.scan_flops for layer in shape.layers for part in layer.parts
                              if part.scan_recomputed_in_backward)
    if scan_again:
        terms["token-mixer scans: blocks recomputed in backward"] = scan_again / speeds.scan_flops
    extra_forwards = 0.0
    if uses_layer_costs(m):  # some layers checkpointed, or products kept: layer by layer (selective.py)
        extra_forwards = _layer_by_layer_recompute(shape, setup, kernel, speeds, terms, overlapped_copies)
    elif m.activation_checkpointing:
        extra_forwards = 1 + (m.checkpoint_interval - 1) / m.checkpoint_interval
        # a third of the matmuls and of the elementwise work is forward
        terms["recompute: layer forwards"] = extra_forwards * (2 * layers * tokens / speeds.matmul_flops
                                                               + terms["elementwise kernels"] / 3)
        if not m.keep_attention_outputs:
            terms["recompute: attention forward"] = extra_forwards * terms["attention forward"]
        if scan_forward:
            terms["recompute: token-mixer scans"] = extra_forwards * scan_forward / speeds.scan_flops
    if m.tiled_mlp and not (m.activation_checkpointing and deferred_mlp) and not uses_layer_costs(m):
        terms["recompute: tiled MLP forward"] = 2 * shape.num_layers * mlp * tokens / speeds.matmul_flops
    if m.offload_activations and not uses_layer_costs(m):
        kept = shape.hidden_size * math.ceil(shape.num_layers / m.checkpoint_interval)
        if m.keep_attention_outputs:
            kept += shape.hidden_size * shape.num_layers
        share = speeds.overlapped_transfer_factor if overlapped_copies else 1.0
        terms["host transfers: offloaded activations"] = (2 * setup.compute_bytes * kept * tokens * share
                                                          / speeds.host_link_bytes)
    groups = optimizer_sub_groups(shape, setup)
    first_on_host = int((1 - setup.offload_optimizer) * len(groups)) if setup.offload_optimizer else len(groups)
    on_gpu, on_host = sum(groups[:first_on_host]), sum(groups[first_on_host:])
    terms["optimizer: GPU Adam"] = on_gpu / speeds.gpu_adam_elements
    if on_host:
        terms["optimizer: CPU Adam (offloaded share)"] = on_host / speeds.cpu_adam_elements
        terms["host transfers: 16-bit gradients"] = setup.compute_bytes * sum(groups) / speeds.host_link_bytes
    terms["fixed per step"] = speeds.step_overhead_s
    host = speeds.host_step_s + speeds.host_layer_pass_s * shape.num_layers * (2 + extra_forwards)
    if not host_beside_device:
        terms["host work (per-layer hooks)"] = host
    elif host > sum(terms.values()):
        terms["waiting on the host (per-layer hooks)"] = host - sum(terms.values())
    return StepTime(terms)
