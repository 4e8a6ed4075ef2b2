import pytest
import torch

from lightning_ulysses.training.loss import sequence_parallel_cross_entropy
from tests.distributed.common import UnevenlyMaskedTokens, collate, tiny_llama


def test_matches_hugging_face_loss_on_labels_and_on_pre_shifted_labels():
    model = tiny_llama(4)
    batch = collate([UnevenlyMaskedTokens(8, 16)[i] for i in range(2)])
    logits = model(input_ids=batch["input_ids"]).logits
    shifted = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
    expected = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    assert torch.allclose(sequence_parallel_cross_entropy(logits, labels=batch["labels"]), expected, atol=1e-6)
    assert torch.allclose(sequence_parallel_cross_entropy(logits, shift_labels=shifted), expected, atol=1e-6)


def test_targets_go_in_by_keyword_naming_which_kind():
    """Labels passed positionally are refused: before, the second argument meant labels already shifted, and the
    batch's labels were; now they are not, and a positional call would silently train the token after next."""
    logits, labels = torch.randn(1, 4, 10), torch.zeros(1, 4, dtype=torch.long)
    for call in (lambda: sequence_parallel_cross_entropy(logits, labels),
                 lambda: sequence_parallel_cross_entropy(logits),
                 lambda: sequence_parallel_cross_entropy(logits, labels=labels, shift_labels=labels)):
        with pytest.raises(TypeError, match="labels= as the batch holds them"):
            call()


def test_no_valid_target_gives_zero_not_nan():
    logits = torch.randn(1, 4, 10, requires_grad=True)
    loss = sequence_parallel_cross_entropy(logits, shift_labels=torch.full((1, 4), -100))
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.isnan().any()


def test_the_swapped_loss_is_hugging_faces_for_whatever_labels_reach_it_at_sp_1():
    """Every batch form at SP 1 gives plain Hugging Face's loss: the batch's labels (which the sharder leaves as the
    user gave them), input_ids, labels built in the step, a tuple batch the sharder passes through."""
    from lightning_ulysses.attention.rows import BatchRowsSlot
    from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
    from lightning_ulysses.batch.sharding import SequenceSharder

    plain = tiny_llama(2)
    batch = collate([UnevenlyMaskedTokens(8, 16)[i] for i in range(2)])
    input_ids, labels = batch["input_ids"], batch["labels"]
    expected = {"labels": plain(input_ids=input_ids, labels=labels).loss,
                "input_ids": plain(input_ids=input_ids, labels=input_ids).loss}
    slot = BatchRowsSlot()
    model = tiny_llama(2)
    model.loss_function = SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot)
    sharder = SequenceSharder(1, 0, batch_rows=slot)
    shard = sharder({"input_ids": input_ids, "labels": labels})
    assert torch.allclose(model(**shard).loss, expected["labels"], atol=1e-6)
    assert torch.allclose(model(input_ids=shard["input_ids"], labels=shard["input_ids"]).loss, expected["input_ids"],
                          atol=1e-6)
    built = labels.clone()  # labels a step builds itself: unshifted, as Hugging Face takes them
    assert torch.allclose(model(input_ids=shard["input_ids"], labels=built).loss, expected["labels"], atol=1e-6)
    assert torch.equal(shard["labels"], labels)  # the step sees the labels it would see without the strategy
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    assert torch.allclose(model(input_ids=input_ids, labels=labels, shift_labels=shifted).loss,
                          expected["labels"], atol=1e-6)  # Hugging Face's own argument for shifted labels
    assert sharder((input_ids, labels)) == (input_ids, labels) and slot.rows is None  # a tuple: nothing published
    assert torch.allclose(model(input_ids=input_ids, labels=labels).loss, expected["labels"], atol=1e-6)
