import pytest
import torch

from lightning_ulysses.loss import gradient_scale_for, sequence_parallel_cross_entropy
from tests.distributed.common import UnevenlyMaskedTokens, collate, tiny_llama


@pytest.mark.parametrize(
    "zero, expected",
    [({"stage": 0}, 1.0), ({"stage": 2}, 1.0), ({"stage": 2, "reduce_scatter": False}, 1.0), ({"stage": 3}, 4.0),
     ({"stage": 3, "reduce_scatter": True}, 4.0)],
)
def test_gradient_scale_per_zero_stage(zero, expected):
    assert gradient_scale_for({"zero_optimization": zero}, 4) == expected


def test_zero3_without_reduce_scatter_is_refused_under_sequence_parallelism():
    # Its contiguous buckets divide by DP, its oversized ones by DP × SP: no one scale is exact.
    zero = {"stage": 3, "reduce_scatter": False}
    with pytest.raises(ValueError, match="Leave reduce_scatter on"):
        gradient_scale_for({"zero_optimization": zero}, 2)
    assert gradient_scale_for({"zero_optimization": zero}, 1) == 1.0  # DP × SP = DP: both paths agree


def test_matches_hugging_face_loss_on_pre_shifted_labels():
    model = tiny_llama(4)
    batch = collate([UnevenlyMaskedTokens(8, 16)[i] for i in range(2)])
    logits = model(input_ids=batch["input_ids"]).logits
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
    expected = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert torch.allclose(sequence_parallel_cross_entropy(logits, shifted), expected, atol=1e-6)


def test_no_valid_target_gives_zero_not_nan():
    logits = torch.randn(1, 4, 10, requires_grad=True)
    loss = sequence_parallel_cross_entropy(logits, torch.full((1, 4), -100))
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.isnan().any()
