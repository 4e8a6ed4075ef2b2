"""Memory planner (hand-computed terms, monotonic, the published 176B case, longest sequence) and the throughput
callback on a tiny CPU run."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ulysses.callbacks import ThroughputCallback, model_flops_per_sequence
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.models.gpt import GPTConfig
from lightning_ulysses.planner import (GIB, MODELS, ModelShape, TrainingSetup, longest_sequence, plan_memory,
                                       published_176b_comparison)
from lightning_ulysses.plan import main as plan_command

TINY = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_key_value_heads=1,
                  vocab_size=10)


def test_parameter_counts():
    # per layer: q 64 + k,v 2·8·4 + o 64 + MLP 3·8·16 + norms 16 = 592; embeddings 2·80; final norm 8
    assert TINY.layer_parameters == 592 and TINY.num_parameters == 2 * 592 + 160 + 8
    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_key_value_heads=2)
    assert ModelShape.from_gpt_config(config).num_parameters == config.num_parameters()
    assert abs(MODELS["llama3-8b"].num_parameters - 8.030e9) < 1e6


def test_hand_computed_plan():
    setup = TrainingSetup(seq_len=100, sequence_parallel_size=2, data_parallel_size=2, zero_stage=3,
                          offload_optimizer=0.5, memory=MemoryOptions(activation_checkpointing=True,
                                                                      offload_activations=True))
    plan = plan_memory(TINY, setup)
    params = 1352
    assert plan.gpu["weights (16-bit)"] == 2 * params / 4
    assert plan.gpu["gradients (16-bit)"] == 2 * params / 4
    assert plan.gpu["optimizer: fp32 master + Adam m, v"] == 0.5 * 12 * params / 4
    assert plan.host["optimizer: fp32 master + Adam m, v"] == 0.5 * 12 * params / 4
    assert plan.host["fp32 gradients of offloaded partitions"] == 0.5 * 4 * params / 4
    # 50 local tokens × 8 hidden × 2 bytes × 2 layers, on the host
    assert plan.host["checkpointed layer inputs (offloaded)"] == 50 * 8 * 2 * 2
    assert plan.gpu["checkpointed layer inputs"] == 0
    # One layer recomputed and run backward, per token: norms 2 × (2·8·2) + q,k,v 2·(8+4+4) + attention output and
    # o-projection input 2·16 + lse 4·2 + MLP 2·4·16 + gradients 2·(16+8+8+8) = 344 bytes; × 50 tokens = 17200 >
    # untiled logits 50 × 10 × (2+4+4+2) = 6000 > optimizer step 2·4·338 = 2704.
    assert plan.gpu["largest transient: one layer's backward"] == 17200
    assert plan.gpu_total == sum(plan.gpu.values()) and plan.fits(plan.gpu_total, plan.host_total)
    assert not plan.fits(plan.gpu_total - 1)


def test_low_memory_norms_term():
    """Per token and layer (no checkpointing, e = 2): Hugging Face's RMSNorm keeps an fp32 copy of its input, the
    16-bit normalised values and its output: (4 + 2 + 2)·8 = 64 bytes; low-memory norms keep the 16-bit input, an
    fp32 rstd and the output: 2·2·8 + 4 = 36. Attention 2·(8 + 2·4 + 2·8) + lse 4·2 = 72, MLP 2·4·16 = 128:
    2·64 + 72 + 128 = 328 → 2·36 + 72 + 128 = 272 bytes. A LayerNorm model (16-bit input and output, 2·2·8 = 32
    per norm: 264 bytes) is unchanged."""
    hugging_face = dataclasses.replace(TINY, fp32_norm_inputs=True)
    plain = TrainingSetup(seq_len=100, zero_stage=0)
    norms = dataclasses.replace(plain, memory=MemoryOptions(low_memory_norms=True))
    for shape, setup, per_token in ((hugging_face, plain, 328), (hugging_face, norms, 272), (TINY, plain, 264),
                                    (TINY, norms, 264)):
        embedding = 2 * 100 * 8
        assert plan_memory(shape, setup).gpu["saved activations (all layers)"] == per_token * 100 * 2 + embedding
    assert "features: low_memory_norms" in plan_memory(hugging_face, norms).table()


@pytest.mark.parametrize("features", ["none", "ac", "ac+offload+mlp+logits", "ac+offload+mlp+logits+norms"])
def test_monotonic_in_sequence_length(features):
    from lightning_ulysses.plan import memory_options

    setup = TrainingSetup(seq_len=1, memory=memory_options(features))
    totals = [plan_memory(MODELS["llama3-8b"], dataclasses.replace(setup, seq_len=s)).gpu_total
              for s in (1024, 8192, 32768, 131072, 262144)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


def test_longest_sequence_is_the_boundary():
    setup = TrainingSetup(seq_len=1, offload_optimizer=0.3, memory=MemoryOptions(
        tiled_mlp=True, tiled_logits_loss=True, activation_checkpointing=True, offload_activations=True))
    shape = MODELS["llama3-8b"]
    seq = longest_sequence(shape, setup, 134 * GIB, 112 * GIB)
    assert seq % 1024 == 0 and 131072 < seq < 360000
    assert plan_memory(shape, dataclasses.replace(setup, seq_len=seq)).fits(134 * GIB, 112 * GIB)
    assert not plan_memory(shape, dataclasses.replace(setup, seq_len=seq + 1024)).fits(134 * GIB, 112 * GIB)
    # SP 8 over 8 GPUs: each holds an eighth of the tokens, so far longer sequences fit
    sp8 = dataclasses.replace(setup, sequence_parallel_size=8)
    assert longest_sequence(shape, sp8, 134 * GIB, 112 * GIB) > 4 * seq


def test_published_176b_case(capsys):
    shape = MODELS["gpt3-175b"]
    assert abs(2 * shape.num_parameters / 1e9 - 352) < 4  # 16-bit parameters ≈ 352 GB
    assert abs(2 * shape.num_parameters / 8 / 1e9 - 44) < 0.5  # ZeRO-3 over 8 → 44 GB
    text = published_176b_comparison()
    assert "275 GB whole →    34 GB per GPU" in text  # activations: 280 GB quoted, /8 (not 23)
    plan_command(["--published-176b"])
    assert "fp32 master + Adam m, v" in capsys.readouterr().out


class _TinyLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPTConfig(vocab_size=16, hidden_size=16, num_layers=2, num_heads=2).build()

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_throughput_callback_on_cpu():
    batches = [{"input_ids": torch.randint(0, 16, (2, 32)), "labels": torch.randint(0, 16, (2, 32))}
               for _ in range(3)]
    callback = ThroughputCallback(peak_flops=1e12)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(_TinyLM(), DataLoader(batches, batch_size=None))
    assert callback.total_tokens == 3 * 2 * 32  # every token counted once
    last = callback.last_metrics
    shape = callback.model_shape
    assert last["flops"] == 2 * model_flops_per_sequence(shape, 32)
    assert shape.num_parameters == sum(p.numel() for p in _TinyLM().parameters())
    assert last["throughput/tokens_per_s"] == pytest.approx(64 / last["seconds"])
    assert last["throughput/mfu"] == pytest.approx(last["flops"] / last["seconds"] / 1e12)
    assert 0 < last["throughput/mfu"] < 1 and last["memory/peak_gib"] > 0.01
    assert set(trainer.callback_metrics) >= {"throughput/tokens_per_s", "throughput/tflops", "throughput/mfu",
                                             "memory/peak_gib"}
