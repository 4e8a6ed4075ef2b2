"""memory="auto" on hybrid models: the planner's per-layer kinds against the activations autograd keeps in tiny CPU
models prepared as the strategy prepares them, and auto's choice for a Qwen3-Next-like shape at 128K on an H200."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers

from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import prepare_hf_model
from lightning_ulysses.memory import MemoryOptions, features_refused_by
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning.auto import AutoMemory, choose
from lightning_ulysses.planning.planner import GIB, ModelShape, TrainingSetup, plan_memory
from lightning_ulysses.planning.step_time import model_flops_per_step, predict_step_time
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss

TOKENS = 512


def _tiny(family: str):
    if family == "qwen3_next":  # 3 Gated DeltaNet layers and a gated attention; experts in two layers, dense in two
        return transformers.Qwen3NextConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            intermediate_size=96, num_hidden_layers=4, vocab_size=128, mlp_only_layers=[0, 2],
            layer_types=["linear_attention"] * 3 + ["full_attention"])
    return transformers.NemotronHConfig(  # Mamba2, MLP, attention and expert blocks
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=32, intermediate_size=96,
        vocab_size=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, layers_block_type=["mamba", "mlp", "mamba", "attention", "moe"])


def _saved_by_layers(model, batch) -> float:
    """Bytes autograd keeps for backward inside the decoder layers (each storage once), during one forward."""
    layers = [m for m in model.modules() if isinstance(m, transformers.modeling_layers.GradientCheckpointingLayer)]
    inside, seen, saved = [False], set(), collections.Counter()
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and not isinstance(tensor, torch.nn.Parameter):
            seen.add(storage.data_ptr())
            saved[inside[0]] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch)
    return saved[True]


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_planned_activations_of_a_hybrid_match_what_autograd_keeps(family):
    """The planner's saved activations (all layers, no checkpointing, bf16) within 5% of what autograd keeps in the
    layers of the model as the strategy runs it at SP 1 (our linear-time delta rule for Gated DeltaNet); the layers
    are of every kind the shape reads from the config."""
    config = _tiny(family)
    shape = ModelShape.from_hf_config(config)
    kinds = {(layer.mixer.kind if layer.mixer else None, layer.mlp.kind if layer.mlp else None) for layer in shape.layers}
    assert kinds == ({("gated_deltanet", "mlp"), ("gated_deltanet", "moe"), ("attention", "moe")}
                     if family == "qwen3_next" else
                     {("mamba2", None), (None, "mlp"), ("attention", None), (None, "moe")})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16)
    assert shape.num_parameters == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.01)
    slot = BatchRowsSlot()
    prepare_hf_model(model.train(), None, SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot), batch_rows=slot)
    tokens = torch.randint(0, config.vocab_size, (1, TOKENS))
    measured = _saved_by_layers(model, SequenceSharder(1, 0, batch_rows=slot)({"input_ids": tokens, "labels": tokens}))
    plan = plan_memory(shape, TrainingSetup(seq_len=TOKENS, zero_stage=0))
    planned = plan.gpu["saved activations (all layers)"] - 2 * config.hidden_size * TOKENS  # less the embedding output
    assert planned == pytest.approx(measured, rel=0.05)
    # checkpointed: only each layer's 16-bit input stays, and the largest layer is recomputed in backward
    checkpointed = plan_memory(shape, TrainingSetup(seq_len=TOKENS, zero_stage=0,
                                                    memory=MemoryOptions(activation_checkpointing=True)))
    assert checkpointed.gpu["checkpointed layer inputs"] == 2 * config.hidden_size * TOKENS * len(shape.layers)
    assert checkpointed.gpu_total < plan.gpu_total
    # what the memory engine would refuse on this model, auto leaves off (Qwen3-Next's norms are `1 + weight`;
    # Nemotron-H's blocks hold their MLP as `mixer`, and its Mamba2 mixer has a grouped gated norm)
    assert features_refused_by(model) == ({"low_memory_norms"} if family == "qwen3_next"
                                          else {"low_memory_norms", "tiled_mlp"})


def _qwen3_next_like(layers: int = 4):
    """benchmarks/token_mixers_sp1.py's shape: Qwen3-Next-80B-A3B's layer widths, 64 experts of which 8 routed."""
    return transformers.Qwen3NextConfig(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        intermediate_size=5120, num_hidden_layers=layers, vocab_size=151936,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))


def test_planned_peaks_of_the_qwen3_next_like_shape_against_the_h200():
    """The committed H200 runs of this shape (bf16 weights and gradients, forward + backward, no optimizer; plain and
    with layer checkpointing + tiled MLP + tiled logits at 32K-256K): the plan, less its optimizer term, is never under
    the measured peak and at most 12% over it (32K plain: +1%; 256K: +5%)."""
    import json
    from pathlib import Path

    from lightning_ulysses.planning.planner import memory_options

    results = Path(__file__).resolve().parents[2] / "benchmarks/results/2026-12-03-h200-delta-rule/qwen3_next.jsonl"
    runs = [json.loads(line) for line in results.read_text().splitlines()]
    runs = [run for run in runs if run["variant"] != "hf"]
    assert len(runs) == 8
    shape = ModelShape.from_hf_config(_qwen3_next_like())
    for run in runs:
        plan = plan_memory(shape, TrainingSetup(seq_len=run["length"], zero_stage=0,
                                                memory=memory_options(run["memory"] or "none")))
        planned = (plan.gpu_total - plan.gpu["optimizer: fp32 master + Adam m, v"]) / GIB
        assert 1.0 <= planned / run["peak_gib"] <= 1.12, run


def test_step_time_model_against_the_qwen3_next_like_steps_on_the_h200():
    """The same runs' forward + backward (no optimizer; torch's SDPA order): predicted within 15% (+7% plain at 32K,
    -1%, -6% and -12% with checkpointing at 32K, 128K, 256K), mostly the delta rule's scan term; the step grows less
    than the model's FLOPs from 32K to 128K, as measured (4.9x against 6.3x)."""
    import json
    from pathlib import Path

    from lightning_ulysses.planning.planner import memory_options

    results = Path(__file__).resolve().parents[2] / "benchmarks/results/2026-12-03-h200-delta-rule/qwen3_next.jsonl"
    runs = [json.loads(line) for line in results.read_text().splitlines()]
    shape = ModelShape.from_hf_config(_qwen3_next_like())
    predicted = {}
    for run in [run for run in runs if run["variant"] != "hf"]:
        terms = predict_step_time(shape, TrainingSetup(seq_len=run["length"],
                                                       memory=memory_options(run["memory"] or "none")), None).terms
        seconds = sum(value for name, value in terms.items() if name not in ("optimizer: GPU Adam", "fixed per step"))
        predicted[run["length"], run["memory"]] = seconds
        assert seconds == pytest.approx(run["median_s"], rel=0.15), run
    growth = predicted[131072, "ac+mlp+logits"] / predicted[32768, "ac+mlp+logits"]
    assert growth < model_flops_per_step(shape, 131072) / model_flops_per_step(shape, 32768)


def test_auto_plans_a_qwen3_next_like_shape_at_128k_on_an_h200():
    """128K on one H200 (141 GB, ~139 GiB free): auto's choice fits by the model, and it needs memory features (the
    plain step's activations alone are ~3x the device). The plan counts the delta rule's per-chunk states: a
    Gated DeltaNet layer keeps more per token than the attention layer of the same model. Its step time is mostly the
    delta rule's scan, whose time grows linearly with the row while the attention's grows with its square."""
    shape = ModelShape.from_hf_config(_qwen3_next_like())
    deltanet, attention = shape.layers[0].saved_bytes(False), shape.layers[3].saved_bytes(False)
    assert deltanet > attention
    free = (139 * GIB, 120 * GIB)
    request = AutoMemory(seq_len=131072)
    gpu = RunSpec(precision="bf16-mixed", device="cuda")
    choice = choose(shape, request, gpu, free, kernel="cudnn", refused=frozenset({"low_memory_norms"}))
    assert choice.best.plan.gpu_total <= free[0] * (1 - request.device_margin)
    assert choice.memory.activation_checkpointing and not choice.memory.low_memory_norms
    plain = plan_memory(shape, TrainingSetup(seq_len=131072))
    assert plain.gpu["saved activations (all layers)"] > 1.5 * free[0]
    assert "token-mixer scans" in choice.report()
    # FLOPs and predicted step from 32K to 128K: the scans grow ×4, attention ×16
    flops = [model_flops_per_step(shape, seq) for seq in (32768, 131072)]
    assert 4 < flops[1] / flops[0] < 16
    steps = [predict_step_time(shape, TrainingSetup(seq_len=seq, memory=choice.memory)).total for seq in (32768, 131072)]
    assert 4 < steps[1] / steps[0] < 16


def test_a_hybrid_without_declared_costs_is_refused_by_auto_and_counted_roughly_by_the_throughput_log():
    """LFM2's short-convolution layers have no declared costs: auto refuses to plan them (naming the fix) rather than
    plan them as attention layers; the throughput log still counts its FLOPs, as attention layers. A declared
    hybrid's FLOPs count the experts a token reaches, not all of them."""
    from lightning_ulysses.integration.callbacks import infer_model_shape, model_flops_per_sequence

    config = transformers.Lfm2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=2, vocab_size=128, layer_types=["conv", "full_attention"])
    with pytest.raises(ValueError, match="no costs declared for the token mixers of lfm2.*set the memory features"):
        ModelShape.from_hf_config(config)
    # Bamba's layers hold a Mamba2 mixer *and* an MLP: not Nemotron-H's one-part blocks, so not planned as them
    with pytest.raises(ValueError, match="no costs declared for the token mixers of bamba"):
        ModelShape.from_hf_config(transformers.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1]))
    # nor Qwen3.5's Gated DeltaNet layers (other projections and attention, not measured) as Qwen3-Next's
    with pytest.raises(ValueError, match="no costs declared for the token mixers of qwen3_5_text"):
        ModelShape.from_hf_config(transformers.Qwen3_5TextConfig(num_hidden_layers=4))
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert not infer_model_shape(model).layers
    qwen = ModelShape.from_hf_config(_qwen3_next_like())
    assert model_flops_per_sequence(qwen, 4096) == model_flops_per_step(qwen, 4096) < 6 * qwen.num_parameters * 4096
