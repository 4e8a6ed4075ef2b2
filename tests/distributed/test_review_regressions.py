"""Regressions found in review (one 2-rank launch, see workers/review_regressions.py)."""

import pytest

from tests.distributed.harness import ROOT
from tests.distributed.pool import shared

WORKER = ROOT / "tests" / "distributed" / "workers" / "review_regressions.py"
JOB = shared(2, "review_regressions", WORKER, {})  # in the shared 2-rank launch (pool.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


@pytest.mark.parametrize("sequence_parallel_in_evaluation", [True, False])
def test_sequence_parallel_metric_counts_every_token_once(results, sequence_parallel_in_evaluation):
    # Unsharded evaluation gives both SP ranks the same whole rows: syncing over the world counts them twice.
    for rank in results:
        assert rank[f"counted_{sequence_parallel_in_evaluation}"] == 64


def test_whole_row_values_logged_in_evaluation_are_kept_and_a_shard_local_loss_is_refused(results):
    # Sharded rows: the model's loss, the strategy's loss_function and a SequenceParallel metric's batch value are
    # the same on both SP ranks and pass the check at every step; a loss written by hand on the logits is not.
    for rank in results:
        sharded, whole = rank["logged_True"], rank["logged_False"]
        assert set(sharded) == {"val_loss", "val_loss_function", "val_tokens_in_batch", "val_rank_number"}
        assert sharded["val_loss_function"] == pytest.approx(sharded["val_loss"], rel=1e-6)
        assert sharded["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)
        # On whole rows (sequence_parallel_in_evaluation=False) the hand-written loss is the model's own.
        assert whole["val_hand_written"] == pytest.approx(whole["val_loss"], rel=1e-5)
        refusal = rank["hand_written_refusal"]
        assert refusal is not None and "validation_step logged 'val_hand_written'" in refusal
        assert "self.trainer.strategy.loss_function(logits, batch['labels'])" in refusal


def test_throughput_flops_add_up_every_rank_own_length(results):
    steps = list(zip(*(rank["throughput_steps"] for rank in results)))
    assert any(len({step["length"] for step in ranks}) > 1 for ranks in steps), "DP ranks must differ in length"
    for ranks in steps:
        expected = sum(step["own_flops"] for step in ranks)
        for step in ranks:
            assert step["flops"] == pytest.approx(expected, rel=1e-12), (ranks, expected)


def test_last_logits_skip_the_padding_the_strategy_added(results):
    # 15 tokens at SP 2: the sharder appends one padding token; with the length it records, "last" is still
    # token 14's logits (without it, the padding token's: off by up to 0.46).
    for rank in results:
        assert rank["unpadded_length"] == 15
        assert rank["last_error"] < 1e-5
