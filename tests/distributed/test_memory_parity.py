"""The memory features through the strategy: 3 SGD steps equal the single-process plain fp32 reference.

Tiled MLP, tiled logits + loss, checkpointing with host offload and low-memory norms together, on ZeRO 2 and 3,
at SP 1 (DP 4) and SP 2 (DP 2), for a Hugging Face Llama and the native GPT (whose LayerNorms low_memory_norms
leaves alone). DP ranks get rows of different lengths (16 and 12 tokens: local 8 and 6 at SP 2), so they run
different numbers of MLP tiles (3 and 2) in the same step; with ZeRO-3 a tile loop that gathered parameters per
tile would deadlock here. One launch of 4 ranks runs every case.
"""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.attention.backends import check_sdpa_kernel_priority, sdpa_priority
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.reference import assert_training_matches, reference_training

WORKER = ROOT / "tests" / "distributed" / "workers" / "train_parity.py"
STEPS, SEQ_LEN, WORLD = 3, 16, 4
ALL_FEATURES = {"tiled_mlp": True, "mlp_tile_tokens": 3, "tiled_logits_loss": True, "logits_tile_tokens": 4,
                "activation_checkpointing": True, "offload_activations": True, "low_memory_norms": True}


SPARSE_FEATURES = {**ALL_FEATURES, "checkpoint_interval": 2, "keep_attention_outputs": True}
# fused_elementwise compiled with aot_eager (dynamo capture and AOT autograd, no C++ builds in 4 ranks; the inductor
# kernels are checked against eager in tests/unit/test_fused_elementwise.py): with low-memory norms (their bodies
# compiled) and without (the compiled norm), under ZeRO-3's hooks, tiles, host offload and the kept-attention mode.
FUSED = {"fused_elementwise": True, "fused_backend": "aot_eager"}


# memory="auto" planning 4096-token rows (the rows trained are shorter) with the least of the ranks' free memory,
# 6.0 MB: layer checkpointing of the first layer with kept attention outputs and products, a tiled MLP, low-memory
# norms (before partial checkpointing: every layer, without the products and norms) (planner: 5.32 MB; with 9.0 MB, rank 0's
# own, a tiled MLP alone). Tiles as in the hand-set case it is compared with.
AUTO = {"auto": True, "seq_len": 4096, "device_margin": 0, "host_margin": 0, "mlp_tile_tokens": 3,
        "logits_tile_tokens": 4, "confirm_steps": 1}  # 3 steps: one warm-up, one timed, the next batch reports
AUTO_FREE = [[9e6, 9e6], [6e6, 6e6], [8e6, 8e6], [7e6, 7e6]]
AUTO_CHOSEN = {"tiled_mlp": True, "mlp_tile_tokens": 3, "logits_tile_tokens": 4, "activation_checkpointing": True,
               "keep_attention_outputs": True, "expandable_segments": True,  # auto's default (an env var on CPU)
               # since partial checkpointing: the first layer checkpointed with its products kept, the second not
               "checkpoint_layers": 1, "keep_matmul_outputs": True, "low_memory_norms": True}


def _case(name, sp, stage, model="llama", memory=ALL_FEATURES, wrapped=None):
    wrapped = wrapped or {"llama": ["LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaRMSNorm", "Linear"],
                          "gpt": ["Block", "MLP", "_Linear"]}[model]
    if set(memory) <= {"tiled_logits_loss", "logits_tile_tokens"}:  # tiled logits + loss only: the model's
        wrapped = ["LlamaForCausalLM", "Linear"]  # forward and its head
    return {"name": name, "wrapped": wrapped, "world_size": WORLD, "sp": sp, "stage": stage, "kv_heads": 2, "model": model,
            "steps": STEPS, "batch_size": 1, "seq_len": SEQ_LEN, "dataset_kwargs": {"odd_rows_shorter_by": 4},
            "strategy_kwargs": {"memory": memory}}


CASES = [
    _case("zero3-sp2-llama-all", 2, 3),
    _case("zero3-sp2-gpt-all", 2, 3, model="gpt"),
    _case("zero2-sp2-llama-all", 2, 2),
    _case("zero3-sp1-llama-all", 1, 3),
    _case("zero3-sp2-llama-all-fused", 2, 3, memory={**ALL_FEATURES, **FUSED}),
    _case("zero3-sp2-llama-stretch-kept-attention-fused", 2, 3,
          memory={**SPARSE_FEATURES, "low_memory_norms": False, **FUSED}),
    _case("zero3-sp2-llama-logits-only", 2, 3, memory={"tiled_logits_loss": True, "logits_tile_tokens": 3}),
    # sparser checkpoints (both layers of the tiny models in one stretch: the second layer's input is recomputed
    # in backward, with ZeRO-3 gathering the first layer's parameters again) and replayed attention outputs
    _case("zero3-sp2-llama-stretch-kept-attention", 2, 3, memory=SPARSE_FEATURES),
    _case("zero3-sp2-gpt-stretch-kept-attention", 2, 3, model="gpt", memory=SPARSE_FEATURES),
    # selective recompute: the first layer checkpointed (its input offloaded, its products and attention replayed),
    # the second keeping its activations; every layer with the products kept, under ZeRO-2
    _case("zero3-sp2-llama-partial-kept-products", 2, 3,
          memory={"activation_checkpointing": True, "checkpoint_layers": 1, "offload_activations": True,
                  "keep_matmul_outputs": True, "keep_attention_outputs": True}, wrapped=["LlamaDecoderLayer"]),
    _case("zero2-sp2-gpt-kept-products", 2, 2, model="gpt",
          memory={"activation_checkpointing": True, "keep_matmul_outputs": True}, wrapped=["Block"]),
    _case("zero3-sp2-llama-auto-by-hand", 2, 3, memory=AUTO_CHOSEN,
          wrapped=["LlamaDecoderLayer", "LlamaMLP", "LlamaRMSNorm"]),
    dict(_case("zero3-sp2-llama-auto", 2, 3, memory=AUTO, wrapped=["LlamaDecoderLayer", "LlamaMLP", "LlamaRMSNorm"]),
         free_memory_by_rank=AUTO_FREE),
]
CASES[-3]["strategy_kwargs"]["sdpa_kernel_priority"] = ["math", "flash"]  # accepted on CPU (where torch ignores it)
JOB = shared(WORLD, "memory_parity", WORKER, {"cases": CASES})  # in the shared 4-rank launch (pool.py)


def _ranks(case, tmp_path_factory):
    return [result[case["name"]] for result in JOB.ranks(tmp_path_factory)]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_memory_features_match_plain_reference(case, tmp_path_factory):
    ranks = _ranks(case, tmp_path_factory)
    sp = case["sp"]
    assert all(rank["wrapped_modules"] == sorted(case["wrapped"]) for rank in ranks), ranks[0]["wrapped_modules"]
    # Each layer runs in forward and again in its backward; in a stretch of both layers (with ZeRO-3's hooks handing
    # each layer an alias of the previous layer's output) the first runs once more, to recompute the second's input.
    memory = ranks[0]["memory"]  # as applied (memory="auto": as chosen)
    checkpointed = memory["checkpoint_layers"] if memory["checkpoint_layers"] is not None else 2
    runs = [1 + (memory["activation_checkpointing"] and layer < checkpointed) for layer in range(2)]
    runs[0] += memory["checkpoint_interval"] == 2
    assert all(rank["attention_runs"] == [STEPS * count for count in runs] for rank in ranks), ranks[0]["attention_runs"]
    # Every run of the attention, forward and each recompute in backward, under the strategy's SDPA kernel order.
    with sdpa_priority(check_sdpa_kernel_priority(case["strategy_kwargs"].get("sdpa_kernel_priority"))):
        expected = [tuple(torch._C._get_sdp_priority_order())]
    assert all(rank["sdpa_orders"] == expected for rank in ranks), (ranks[0]["sdpa_orders"], expected)
    # Under ZeRO's hooks too, a checkpointed layer's recompute leaves its tiled MLP's forward out (steps 2 and 3).
    both = memory["tiled_mlp"] and memory["activation_checkpointing"]
    # (a layer checkpoint_layers leaves out is never recomputed: its MLP's deferral is never decided)
    deferrable = [True if layer < checkpointed else None for layer in range(2)]
    assert all(rank["mlps_deferrable"] == (deferrable if both else [None] * 2 * memory["tiled_mlp"]) for rank in ranks)
    # ZeRO-3 gathers each decoder layer whole, except where a stretch recomputes layers outside their hooks.
    leaves = case["stage"] == 3 and memory["checkpoint_interval"] == 1
    assert all(rank["leaf_layers"] == [leaves] * 2 for rank in ranks), ranks[0]["leaf_layers"]
    # fused_elementwise compiled its functions (an ambient dispatch mode would make dynamo run them eagerly).
    assert all((rank["compiled_graphs"] > 0) == memory["fused_elementwise"] for rank in ranks)
    steps, lengths = [], set()
    for step in range(STEPS):
        by_dp = {}
        for rank in ranks:
            record = rank["records"][step]
            by_dp.setdefault(rank["data_parallel_rank"], record["sample_index"])
            lengths.add(record["input_ids"].size(1))
        steps.append([by_dp[dp] for dp in sorted(by_dp)])
    assert lengths == {SEQ_LEN // sp, (SEQ_LEN - 4) // sp}, "the ranks must see different local lengths"

    reference = reference_training(case["kv_heads"], SEQ_LEN, steps, kind=case["model"],
                                   dataset_kwargs=case["dataset_kwargs"])
    assert_training_matches(ranks, reference)
    checksums = [rank["weights_checksum"] for rank in ranks]
    assert max(checksums) - min(checksums) <= 1e-9 * max(checksums)


def test_auto_choice_is_identical_on_every_rank_and_trains_like_the_same_options_by_hand(tmp_path_factory):
    ranks = _ranks(CASES[-1], tmp_path_factory)
    by_hand = _ranks(CASES[-2], tmp_path_factory)
    choices = [rank["memory_choice"] for rank in ranks]
    assert all(choice == choices[0] for choice in choices)  # from the least free memory (rank 1's), on every rank
    assert choices[0]["predicted_device_bytes"] <= min(free for free, _ in AUTO_FREE)
    assert all(rank["memory"] == by_hand[0]["memory"] for rank in ranks), {
        key: (value, by_hand[0]["memory"][key]) for key, value in ranks[0]["memory"].items() if value != by_hand[0]["memory"][key]}
    assert by_hand[0]["memory_choice"] is None
    # the first steps confirmed once, from the slowest rank's time (the same on every rank); no device peak on CPU
    confirmations = [rank["memory_confirmation"] for rank in ranks]
    assert confirmations[0]["steps"] == 1 and confirmations[0]["step_s"] > 0
    assert confirmations[0]["device_peak_bytes"] is None
    assert all(confirmation == confirmations[0] for confirmation in confirmations)
    assert by_hand[0]["memory_confirmation"] is None
    for auto_rank, hand_rank in zip(ranks, by_hand):
        assert [r["loss"] for r in auto_rank["records"]] == [r["loss"] for r in hand_rank["records"]]
        assert auto_rank["weights_checksum"] == hand_rank["weights_checksum"]
