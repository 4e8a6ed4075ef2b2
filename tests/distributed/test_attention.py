"""The all-to-all round trip is exact; Ulysses attention and Ulysses HF models equal full attention.

4 ranks: SP 2 (two SP groups, each smaller than the world) and SP 4; MHA, GQA (2 KV heads < SP 4) and MQA;
an HF model with a left-padded and a right-padded row.
"""

import pytest

from tests.distributed.harness import ROOT
from tests.distributed.pool import shared

WORKER = ROOT / "tests" / "distributed" / "workers" / "attention_exactness.py"
JOB = shared(4, "attention", WORKER, {"sequence_parallel_sizes": [2, 4]})  # in the shared 4-rank launch (pool.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


@pytest.mark.parametrize("sp", [2, 4])
def test_all_to_all_is_exact(results, sp):
    for rank in results:
        assert rank[sp]["seq_to_heads_vs_slice"] == 0.0
        assert rank[sp]["round_trip"] == 0.0


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_attention_equals_full_attention(results, sp, kv_heads):
    for rank in results:
        assert rank[sp][f"ulysses_out_kv{kv_heads}"] < 1e-5
        for name in "qkv":
            assert rank[sp][f"ulysses_grad_{name}_kv{kv_heads}"] < 1e-5


@pytest.mark.parametrize("sp", [2, 4])
def test_pipelined_head_groups_are_exact(results, sp):
    # 8 heads: at SP 2 up to 4 groups (8 % (4·2) == 0), at SP 4 up to 2; KV heads cap it (replicated ones at 1)
    expected_groups = {2: {8: (2, 4), 4: (2, 2), 2: (1, 1), 1: (1, 1)}, 4: {8: (2, 2), 4: (1, 1), 2: (1, 1), 1: (1, 1)}}
    for rank in results:
        for kv_heads, usable in expected_groups[sp].items():
            for requested, groups in zip((2, 4), usable):
                key = f"kv{kv_heads}_groups{requested}"
                assert rank[sp][f"head_groups_used_{key}"] == groups
                assert rank[sp][f"head_groups_error_{key}"] < 1e-5, key


@pytest.mark.parametrize("sp", [2, 4])
def test_exchange_edges(results, sp):
    for rank in results:
        assert rank[sp]["anomaly_mode"] is True  # else: the anomaly check's error message
        assert rank[sp]["in_place_on_output"] is True
        assert rank[sp]["exchanges_finished_before_attention"] == 3  # q, k, v
        assert rank[sp]["finished_exchanges_holding_buffers"] == 0



@pytest.mark.parametrize("sp", [2, 4])
def test_copy_engine_plan_is_exact_and_agreed(results, sp):
    # heads, back, x.grad (the reverse exchanges), then head-grouped attention's output and q/k/v gradients
    for rank in results:
        assert rank[sp]["copy_engine_bit_identical"] == [True] * 7
        # every exchange went through the plan: 2 + 2 reverse for x; 2 head groups × (q, k, v, output), both ways
        assert rank[sp]["copy_engine_launches"] == 4 + 2 * 4 * 2
        assert rank[sp]["copy_engine_launches_after"] == rank[sp]["copy_engine_launches"]
        assert "no peer-to-peer access" in rank[sp]["copy_engine_refusal"]
        assert 'Use exchange="nccl"' in rank[sp]["copy_engine_refusal"]
        assert rank[sp]["copy_engine_auto"] == "nccl"

@pytest.mark.parametrize("sp", [2, 4])
def test_head_group_exchanges_overlap_the_attention(results, sp):
    # forward: both groups' q, k and v exchanges (3 + 3) launched before the first attention, group 0's output
    # exchange before group 1's attention; backward (reverse creation order): both output-gradient exchanges first,
    # group 1's q/k/v gradients launched before group 0's attention backward runs.
    expected = ["exchange"] * 6 + ["attend0", "exchange", "attend1", "exchange", "backward",
                                   "exchange", "exchange", "attend1 backward"] + ["exchange"] * 3 + [
                                   "attend0 backward"] + ["exchange"] * 3
    for rank in results:
        assert rank[sp]["head_groups_schedule"] == expected


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("sp", [2, 4])
def test_hf_model_with_padding_equals_full_model(results, sp, kv_heads):
    for rank in results:
        assert rank[sp][f"hf_loss_kv{kv_heads}"] < 1e-5
        assert rank[sp][f"hf_grad_relative_kv{kv_heads}"] < 1e-5


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("sp", [2, 4])
def test_prepare_is_per_model_and_restorable(results, sp, kv_heads):
    for rank in results:
        assert rank[sp][f"bystander_keeps_sdpa_kv{kv_heads}"] is True
        assert rank[sp][f"restored_kv{kv_heads}"] is True


REFUSALS = {
    "gemma3_overlay": ["Gemma3ForCausalLM builds its attention mask with an overlay", "use a model without it"],
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_mask_only_patterns_are_refused_on_every_rank(results, case):
    for rank in results:
        message = rank[2][f"refused_{case}"]
        assert message is not None, f"{case} ran at SP 2 (its pattern silently became causal attention)"
        for fragment in REFUSALS[case]:
            assert fragment in message, message


@pytest.mark.parametrize("case", ["mistral_window16", "mistral_window3", "phimoe_window4", "llama4_chunks4"])
@pytest.mark.parametrize("sp", [2, 4])
def test_windows_and_chunks_are_exact_on_padded_rows(results, sp, case):
    for rank in results:
        assert rank[sp][f"{case}_loss"] < 1e-5
        assert rank[sp][f"{case}_grad_relative"] < 1e-5


@pytest.mark.parametrize("rows", ["padded", "unmasked"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("sp", [2, 4])
def test_moe_load_balancing_loss_equals_full_model(results, sp, family, rows):
    key = f"{family}_{rows}"
    for rank in results:
        assert rank[sp][f"router_aux_{key}"] < 1e-5
        assert rank[sp][f"router_loss_{key}"] < 1e-5
        assert rank[sp][f"router_grad_relative_{key}"] < 1e-5
        assert rank[sp][f"router_bystander_{key}"] < 1e-6  # another model of the family keeps its own loss
        assert rank[sp][f"router_restored_{key}"] < 1e-6
