"""Hybrid Ulysses × ring attention and its zig-zag layout are exact against full attention (fp32, 1e-5).

One 4-rank launch: SP 4 = Ulysses 2 × ring 2, SP 4 = pure ring 4, SP 2 = pure ring 2 inside world 4 (two SP
groups). Attention with 2 KV heads, 2 heads in total, MQA and non-causal; Hugging Face Llama models with a
right-padded row, and Falcon (attention computed inline); packed rows refused (HF and native) on every rank;
every gather back to sequence order.
"""

import pytest

from lightning_ulysses.parallel.layout import ShardOrder
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.workers.ring_attention import ATTENTION_CASES, SEQ_LEN

WORKER = ROOT / "tests" / "distributed" / "workers" / "ring_attention.py"
LAYOUTS = {"sp4_ring2": (4, 2), "sp4_ring4": (4, 4), "sp2_ring2": (2, 2)}
JOB = shared(4, "ring_attention", WORKER, {"layouts": list(LAYOUTS.values())})  # in the shared 4-rank launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


def _ranks(results, layout):
    return [rank[layout] for rank in results]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_splits_as_asked(results, layout):
    sp, ring = LAYOUTS[layout]
    for rank in _ranks(results, layout):
        assert (rank["ulysses_size"], rank["ring_size"]) == (sp // ring, ring)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"h{c[0]}_kv{c[1]}_{'causal' if c[2] else 'full'}")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_equals_full_attention(results, layout, case):
    heads, kv_heads, causal = case
    name = f"h{heads}_kv{kv_heads}_{'causal' if causal else 'full'}"
    for rank in _ranks(results, layout):
        assert rank[f"out_{name}"] < 1e-5
        for label in "qkv":
            assert rank[f"grad_{label}_{name}"] < 1e-5, label


@pytest.mark.parametrize("model", ["h4_kv2", "h2_kv1"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_model_with_right_padding_equals_full_model(results, layout, model):
    for rank in _ranks(results, layout):
        assert rank[f"hf_loss_{model}"] < 1e-5
        assert rank[f"hf_grad_relative_{model}"] < 1e-5
        assert rank[f"full_logits_{model}"] < 1e-5
        assert rank[f"log_probs_{model}"] < 1e-5
        assert rank[f"last_{model}"] < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_falcon_inline_attention_in_the_ring_equals_full_model(results, layout):
    for rank in _ranks(results, layout):
        assert rank["hf_loss_falcon"] < 1e-5
        assert rank["hf_grad_relative_falcon"] < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_left_padding_is_refused_with_the_fix(results, layout):
    for rank in _ranks(results, layout):
        assert "ring_size=1" in rank["left_padding_error"] and "padding_side='right'" in rank["left_padding_error"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_rows_are_refused_with_the_fix(results, layout):
    for rank in _ranks(results, layout):
        for kind in ("hf", "native"):
            message = rank[f"packed_{kind}_error"]
            assert "cannot keep packed documents apart" in message and "ring_size=1" in message, message
        assert rank["padding_restart_error"] is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shards_are_zig_zag_and_gathers_restore_order(results, layout):
    sp, ring = LAYOUTS[layout]
    chunk = SEQ_LEN // (2 * ring)
    for rank in _ranks(results, layout):
        ring_rank, ulysses_rank = divmod(rank["sequence_parallel_rank"], sp // ring)
        mirror = 2 * ring - 1 - ring_rank
        pair = list(range(ring_rank * chunk, (ring_rank + 1) * chunk)) + list(range(mirror * chunk, (mirror + 1) * chunk))
        piece = len(pair) // (sp // ring)
        assert rank["shard_positions"] == pair[ulysses_rank * piece:(ulysses_rank + 1) * piece]
        assert rank["shard_positions"] == ShardOrder(sp, ring).positions(SEQ_LEN, rank["sequence_parallel_rank"]).tolist()
        assert rank["gather_restores_order"] is True
        assert rank["metric_rows_in_order"] is True


