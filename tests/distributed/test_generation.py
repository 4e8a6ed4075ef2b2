"""Greedy generation with a sequence-parallel prefill equals non-parallel greedy generation, token for token.

World 4: SP 2 (two SP groups) and SP 4, MHA and MQA, a prompt length that leaves padding in the last shard.
"""

import pytest
import torch

from tests.distributed.common import tiny_llama
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.workers.generation import NEW_TOKENS, prompts

WORKER = ROOT / "tests" / "distributed" / "workers" / "generation.py"
JOB = shared(4, "generation", WORKER, {"sequence_parallel_sizes": [2, 4]})  # in the shared 4-rank launch (pool.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


def greedy(kv_heads: int) -> torch.Tensor:
    """Plain Hugging Face model, whole sequence re-run at every step: nothing shared with the code under test."""
    model, ids = tiny_llama(kv_heads, seed=5), prompts()
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("sp", [2, 4])
def test_greedy_generation_matches_unsharded(results, sp, kv_heads):
    expected = greedy(kv_heads)
    assert len(set(expected[:, -NEW_TOKENS:].flatten().tolist())) > 1  # not a degenerate constant output
    for rank in results:
        assert torch.equal(rank[(sp, kv_heads)], expected)


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("sp", [2, 4])
def test_restore_releases_the_groups_prepare_created(results, sp, kv_heads):
    assert all(rank[("released", sp, kv_heads)] for rank in results)


@pytest.mark.parametrize("sp", [2, 4])
def test_a_hybrid_model_is_refused_decoding_from_an_sp_prefill_naming_the_fix(results, sp):
    messages = {rank[("hybrid", sp)] for rank in results}
    assert len(messages) == 1  # on every rank alike
    assert "Generate with sequence_parallel_size=1" in messages.pop()


@pytest.mark.parametrize("sp", [2, 4])
def test_decoding_by_hand_from_a_sharded_cache_is_refused_naming_the_fix(results, sp):
    messages = {rank[("own decoding", sp)] for rank in results}
    assert len(messages) == 1
    assert "lightning_ulysses.integration.inference.generate" in messages.pop()
