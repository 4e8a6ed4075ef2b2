"""Packed rows (several documents per row) under sequence parallelism equal every document run alone, unsharded.

One 4-rank launch:
- the strategy (Trainer, SGD, 3 steps) on packed rows from the recipes' `PackedTokenRows`: HF Llama with 1 KV
  head at SP 2 × DP 2 (ZeRO-2) and the native GPT at SP 4 (ZeRO-3), and hybrids whose mixers are split by heads
  (Nemotron-H's Mamba2 at SP 4 on ZeRO-3, Qwen3.5's Gated DeltaNet at SP 2 × DP 2 on ZeRO-2); losses within 1e-5
  and weights within 1e-4 of the update of a single-process fp32 reference that runs every document alone;
- at SP 2 (two groups inside the world) and SP 4: the attention core's output and q/k/v gradients (sdpa, MHA and
  GQA, packed rows with and without padding; flex_attention forward), and HF Llama (MHA, MQA) and native GPT
  loss, logits and gradients on a batch of two differently packed rows, within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import collate
from tests.distributed.harness import ROOT
from tests.distributed.packed import PackedDocuments, document_spans, per_document_forward
from tests.distributed.pool import shared
from tests.distributed.reference import assert_training_matches, reference_training

WORKER = ROOT / "tests" / "distributed" / "workers" / "packed_sequences.py"
WORLD_SIZE, STEPS, BATCH_SIZE, SEQ_LEN, LR = 4, 3, 2, 16, 0.5
STRATEGY_CASES = [
    {"name": "llama-mqa-zero2-sp2-dp2", "model": "llama", "kv_heads": 1, "sp": 2, "stage": 2},
    {"name": "gpt-gqa-zero3-sp4", "model": "gpt", "kv_heads": 2, "sp": 4, "stage": 3},
    # SP 1 keeps documents apart like SP N (Hugging Face's sdpa alone attends across them: its default
    # use_cache=True creates a cache in training, which turns its packed-row detection off).
    {"name": "llama-gqa-zero2-sp1-dp4", "model": "llama", "kv_heads": 2, "sp": 1, "stage": 2},
    # Hybrids whose token mixers are split by heads run each packed document on its own (mixers/head_split.py): a
    # Mamba2 family (the convolution and the scan restart) at SP 4 on ZeRO-3, a Gated-DeltaNet family at SP 2 × DP 2
    # on ZeRO-2.
    {"name": "nemotron_h-zero3-sp4", "model": "family:nemotron_h", "kv_heads": 2, "sp": 4, "stage": 3},
    {"name": "qwen3_5_text-zero2-sp2-dp2", "model": "family:qwen3_5_text", "kv_heads": 2, "sp": 2, "stage": 2},
    # ... and split unevenly (families.py `UNEVEN`: 9 value heads over 3 key heads, 3, 2, 2, 2 per rank)
    {"name": "qwen3_next-uneven-zero3-sp4", "model": "family:qwen3_next@uneven", "kv_heads": 2, "sp": 4, "stage": 3},
]
STRATEGY_CASES = [dict(case, data="packed", steps=STEPS, batch_size=BATCH_SIZE, seq_len=SEQ_LEN, lr=LR)
                  for case in STRATEGY_CASES]
# In the shared 4-rank launch (pool.py).
JOB = shared(WORLD_SIZE, "packing", WORKER, {"strategy_cases": STRATEGY_CASES, "sequence_parallel_sizes": [2, 4]})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("sp", [2, 4])
def test_attention_core_keeps_documents_apart(results, sp, kv_heads):
    for rank in results:
        for name in ("packed", "packed_padded"):
            assert rank[sp][f"core_out_{name}_kv{kv_heads}"] < 1e-5
            for tensor in "qkv":
                assert rank[sp][f"core_grad_{tensor}_{name}_kv{kv_heads}"] < 1e-5
        assert rank[sp][f"flex_out_kv{kv_heads}"] < 1e-5


@pytest.mark.parametrize("model", ["llama_kv4", "llama_kv1", "gpt_kv2"])
@pytest.mark.parametrize("sp", [2, 4])
def test_packed_model_equals_documents_alone(results, sp, model):
    for rank in results:
        assert rank[sp][f"model_loss_{model}"] < 1e-5
        assert rank[sp][f"model_logits_{model}"] < 1e-5
        assert rank[sp][f"model_grad_relative_{model}"] < 1e-5


def _documents_alone_loss(model, batch: dict) -> torch.Tensor:
    """The token mean over every document of the rows, each run alone (found without the code under test)."""
    input_ids = batch["input_ids"]
    return per_document_forward(model, input_ids, [document_spans(row) for row in input_ids])[0]


@pytest.mark.parametrize("case", STRATEGY_CASES, ids=[case["name"] for case in STRATEGY_CASES])
def test_strategy_trains_packed_rows_like_documents_alone(results, case):
    ranks = [rank["strategy"][case["name"]] for rank in results]
    steps = []
    for step in range(STEPS):
        by_dp = {rank["data_parallel_rank"]: rank["records"][step]["sample_index"] for rank in ranks}
        steps.append([by_dp[dp] for dp in sorted(by_dp)])
    # Each rank saw its slice of the packed rows, positions restarting per document, cut as they are.
    dataset = PackedDocuments(10_000 // SEQ_LEN, SEQ_LEN)
    shard = SEQ_LEN // case["sp"]
    for rank in ranks:
        window = slice(rank["sequence_parallel_rank"] * shard, (rank["sequence_parallel_rank"] + 1) * shard)
        for record in rank["records"]:
            full = collate([dataset[i] for i in record["sample_index"]])
            assert torch.equal(record["position_ids"], full["position_ids"][:, window])
            assert bool((full["position_ids"][:, 1:] == 0).any())  # the rows really are packed
    reference = reference_training(case["kv_heads"], SEQ_LEN, steps, lr=LR, kind=case["model"], dataset=dataset,
                                   replica_loss=_documents_alone_loss)
    assert_training_matches(ranks, reference)
    if case["model"].startswith("family:"):  # its mixers ran split by heads (on whole rows packed rows are refused)
        assert all(rank["token_mixers"] and set(rank["token_mixers"].values()) == {"split"} for rank in ranks)
