"""The ranks of an SP group hold the same rows: the training loss and every tensor a training step logs must be the
same on all of them, and one of a shard alone is refused after the step, before any optimizer step or logger sees
it (`logged_values.SameValueCheck`). One part of the shared 2-rank launch and one of the 4-rank launch (pool.py);
the loss written by hand with an MoE aux term: test_parity.py's `-hand_written_aux` cases; evaluation steps:
test_review_regressions.py."""

import pytest
import torch

from tests.distributed.common import UnevenlyMaskedTokens, collate, tiny_llama
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.workers.value_check import SEQ_LEN, agreement

WORKER = ROOT / "tests" / "distributed" / "workers" / "value_check.py"
WHOLE = ("train/loss", "train/loss_function", "train/token_ce", "train/accuracy", "train/mean_token",
         "train/token_ce_metric", "train/mean_token_metric")
CASES = {
    2: [
        {"name": "sp2-shard-refused", "sp": 2, "logs": ["shard"]},
        {"name": "sp1-shard", "sp": 1, "logs": ["shard"]},  # the same script without sequence parallelism (DP 2)
        {"name": "sp2-whole-and-per-rank", "sp": 2, "logs": ["shard", "whole"],
         "strategy_kwargs": {"per_rank_values": ["train/agree"], "check_batches": "every"}},
        {"name": "sp2-shard-never", "sp": 2, "logs": ["shard"], "strategy_kwargs": {"check_batches": "never"}},
        {"name": "sp2-manual-hand_written-refused", "sp": 2, "loss": "hand_written", "manual": True},
        {"name": "sp2-rank0-only-refused", "sp": 2, "logs": ["rank0"]},
    ],
    4: [{"name": "sp4-shard-refused", "sp": 4, "logs": ["shard"]}],
}
JOBS = {world: shared(world, "value_check", WORKER, {"cases": cases}) for world, cases in CASES.items()}


def _ranks(name: str, tmp_path_factory) -> list[dict]:
    world = next(world for world, cases in CASES.items() if any(case["name"] == name for case in cases))
    return [rank[name] for rank in JOBS[world].ranks(tmp_path_factory)]


def _one_process(sample_index: list[int]) -> dict:
    """The values of the whole rows at the weights the first step starts from, in one process."""
    dataset = UnevenlyMaskedTokens(10_000, SEQ_LEN)
    batch = collate([dataset[i] for i in sample_index])
    with torch.no_grad():
        out = tiny_llama(2)(input_ids=batch["input_ids"], labels=batch["labels"])
    targets, logits = batch["labels"][:, 1:], out.logits[:, :-1]
    valid = targets != -100
    loss, mean_token = out.loss.item(), batch["input_ids"].double().mean().item()
    return {"train/loss": loss, "train/loss_function": loss, "train/token_ce": loss, "train/token_ce_metric": loss,
            "train/accuracy": (logits.argmax(-1)[valid] == targets[valid]).double().mean().item(),
            "train/mean_token": mean_token, "train/mean_token_metric": mean_token,
            "train/agree": agreement(out.logits, batch["input_ids"]).item()}


@pytest.mark.parametrize("name", ["sp2-shard-refused", "sp4-shard-refused"])
def test_a_shard_local_value_logged_in_training_step_is_refused(name, tmp_path_factory):
    for rank in _ranks(name, tmp_path_factory):
        refusal = rank["refusal"] or ""
        assert "training_step logged 'train/agree': the value differs between the ranks" in refusal, refusal
        assert "per_rank_values=['train/agree']" in refusal and "SequenceParallel(metric)" in refusal, refusal
        # after the first step, before its backward, its optimizer step and any logger
        assert len(rank["records"]) == 1 and rank["weights_unchanged"] and rank["logged"] == [], rank


def test_the_same_script_without_sequence_parallelism_logs_the_one_process_value(tmp_path_factory):
    for rank in _ranks("sp1-shard", tmp_path_factory):
        assert rank["refusal"] is None and len(rank["records"]) == 2
        expected = _one_process(rank["records"][0]["sample_index"])["train/agree"]
        assert rank["logged"][0]["train/agree"] == pytest.approx(expected, abs=1e-6)


def test_whole_values_pass_and_a_value_named_per_rank_is_left_to_each_rank(tmp_path_factory):
    ranks = _ranks("sp2-whole-and-per-rank", tmp_path_factory)
    for rank in ranks:
        assert rank["refusal"] is None and len(rank["records"]) == 2, rank["refusal"]
        expected = _one_process(rank["records"][0]["sample_index"])
        first = rank["logged"][0]
        # every step checked (check_batches="every"): all the same on both SP ranks, and exact (the metric objects,
        # which the check leaves alone, log their forward's batch value: the whole rows' too)
        for name in WHOLE:
            assert first[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), (name, first[name], expected)
        assert first["train/rank"] == rank["sequence_parallel_rank"]  # a Python number: never compared
    # The whole values are the same bits on both SP ranks at every step (what the check's tolerance rests on).
    for step in range(2):
        assert {name: ranks[0]["logged"][step][name] for name in WHOLE} == {
            name: ranks[1]["logged"][step][name] for name in WHOLE}
    # train/agree, named in per_rank_values: each rank logged its own shard's value, not the whole rows'
    agreed = [rank["logged"][0]["train/agree"] for rank in ranks]
    assert agreed[0] != agreed[1]


def test_check_batches_never_compares_nothing(tmp_path_factory):
    for rank in _ranks("sp2-shard-never", tmp_path_factory):
        assert rank["refusal"] is None and len(rank["records"]) == 2


def test_a_shard_local_loss_under_manual_optimization_is_refused_before_its_optimizer_step(tmp_path_factory):
    for rank in _ranks("sp2-manual-hand_written-refused", tmp_path_factory):
        refusal = rank["refusal"] or ""
        assert "The loss manual_backward was given differs between the ranks [0, 1]" in refusal, refusal
        assert "self.trainer.strategy.loss_function(logits, batch['labels'])" in refusal
        assert len(rank["records"]) == 1 and "stepped" not in rank["records"][0] and rank["weights_unchanged"]


def test_a_name_logged_on_some_ranks_only_is_refused(tmp_path_factory):
    for rank in _ranks("sp2-rank0-only-refused", tmp_path_factory):
        refusal = rank["refusal"] or ""
        assert "training_step logged 'train/only_rank0' on the ranks [0] but not on [1]" in refusal, refusal
        assert len(rank["records"]) == 1 and rank["weights_unchanged"] and rank["logged"] == []
