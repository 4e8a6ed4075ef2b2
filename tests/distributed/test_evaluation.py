"""SP-aware metrics and predict outputs equal the single-process, full-sequence values (fp32, within 1e-5).

World 8: SP 2 × DP 4 and SP 4 × DP 2, labels masked unevenly, one right-padded batch.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.common import UnevenlyMaskedTokens, collate, tiny_llama
from tests.distributed.harness import ROOT, launch
from tests.distributed.workers.evaluation import BATCH, BATCHES, SEQ_LEN, is_padded, samples_of

WORKER = ROOT / "tests" / "distributed" / "workers" / "evaluation.py"
WORLD_SIZE = 8
LAYOUTS = {2: 4, 4: 2}  # SP → DP in a world of 8


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(WORKER, WORLD_SIZE, {"sequence_parallel_sizes": list(LAYOUTS)}, tmp_path_factory.mktemp("evaluation"))


def reference(dp_size: int):
    """Unsharded logits of every sample, token sums over every DP rank's samples, and each batch's own values."""
    model, dataset = tiny_llama(1), UnevenlyMaskedTokens(1000, SEQ_LEN)
    nll, correct, count, rows, batches = 0.0, 0, 0, {}, {}
    for dp_rank in range(dp_size):
        for indices in samples_of(dp_rank, dp_size):
            batch = collate([dataset[i] for i in indices])
            if is_padded(indices):  # the same rows without their padding: padding must change nothing
                batch["labels"][0, -3:] = -100
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"]).logits
            targets = batch["labels"][:, 1:]
            valid = targets != -100
            batch_nll = F.cross_entropy(logits[:, :-1][valid], targets[valid], reduction="sum").item()
            batch_correct = (logits[:, :-1].argmax(-1)[valid] == targets[valid]).sum().item()
            batch_count = valid.sum().item()
            nll, correct, count = nll + batch_nll, correct + batch_correct, count + batch_count
            batches.setdefault(dp_rank, []).append({
                "loss": batch_nll / batch_count, "perplexity": math.exp(batch_nll / batch_count),
                "accuracy": batch_correct / batch_count, "wrapped_accuracy": batch_correct / batch_count})
            for row, index in enumerate(indices):
                rows[index] = (logits[row], batch["labels"][row])
    return {"loss": nll / count, "perplexity": math.exp(nll / count), "accuracy": correct / count}, rows, batches


@pytest.mark.parametrize("sp", list(LAYOUTS))
def test_metrics_aggregate_tokens_over_sp_and_dp(results, sp):
    expected, _, _ = reference(LAYOUTS[sp])
    for rank in results:
        for name, value in rank[sp]["metrics"].items():
            assert abs(value - expected[name]) < 1e-5 * max(1.0, expected[name]), (name, value, expected[name])
        assert abs(rank[sp]["wrapped_accuracy"] - expected["accuracy"]) < 1e-6


@pytest.mark.parametrize("sp", list(LAYOUTS))
def test_metrics_called_give_each_batch_the_whole_rows_value(results, sp):
    # `metric(logits, labels)` (what `self.log(name, metric)` logs on step): the batch's value of the whole rows on
    # every SP rank, not the shard's; accumulated, the epoch's value as `update` gives it.
    expected, _, batches = reference(LAYOUTS[sp])
    for rank_index, rank in enumerate(results):
        dp_rank = rank_index // sp  # SP groups are consecutive ranks
        for step, values in enumerate(rank[sp]["batch_values"]):
            for name, value in values.items():
                wanted = batches[dp_rank][step][name]
                assert abs(value - wanted) < 1e-5 * max(1.0, wanted), (name, step, value, wanted)
        for name, value in rank[sp]["called"].items():
            wanted = expected["accuracy" if name == "wrapped_accuracy" else name]
            assert abs(value - wanted) < 1e-5 * max(1.0, wanted), (name, value, wanted)


@pytest.mark.parametrize("sp", list(LAYOUTS))
def test_predict_outputs_equal_unsharded_model(results, sp):
    _, rows, _ = reference(LAYOUTS[sp])
    for rank in results:
        assert len(rank[sp]["predictions"]) == BATCHES
        for prediction in rank[sp]["predictions"]:
            for row, index in enumerate(prediction["indices"]):
                logits, labels = rows[index]
                real = SEQ_LEN - 3 if prediction["padded"] and row == 0 else SEQ_LEN
                assert torch.allclose(prediction["full"][row, :real], logits[:real], atol=1e-5)
                last = real - 1
                assert torch.allclose(prediction["last"][row], logits[last], atol=1e-5)
                targets = labels[1:]
                valid = targets != -100
                expected = torch.log_softmax(logits[:-1], -1).gather(-1, targets.clamp(min=0)[:, None])[:, 0] * valid
                assert torch.allclose(prediction["log_probs"][row, :-1], expected, atol=1e-5)
                assert prediction["log_probs"][row, -1] == 0  # the last position has no target
    assert BATCH == 2
