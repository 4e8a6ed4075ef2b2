import pytest
import torch

from lightning_ulysses.batch.sharding import SequenceSharder


def batch(seq_len=8, rows=2):
    input_ids = torch.arange(rows * seq_len).view(rows, seq_len)
    return {"input_ids": input_ids, "labels": input_ids + 100, "attention_mask": torch.ones_like(input_ids),
            "document_id": torch.tensor([7, 9])}


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_shards_cut_labels_as_the_user_gave_them(rank):
    out = SequenceSharder(4, rank)(batch())
    window = slice(2 * rank, 2 * rank + 2)
    full = batch()
    assert torch.equal(out["input_ids"], full["input_ids"][:, window])
    # Unshifted: a step reading batch["labels"] sees what it would without the strategy (the loss shifts them).
    assert torch.equal(out["labels"], full["labels"][:, window])
    assert torch.equal(out["position_ids"], torch.arange(8)[window].expand(2, -1))
    assert torch.equal(out["attention_mask"], full["attention_mask"][:, window])
    assert torch.equal(out["document_id"], full["document_id"])  # other entries pass through


def test_pads_with_ignored_labels_and_masked_tokens():
    full = batch(seq_len=7)
    shards = [SequenceSharder(4, rank)(full) for rank in range(4)]
    input_ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    labels = torch.cat([s["labels"] for s in shards], dim=1)
    mask = torch.cat([s["attention_mask"] for s in shards], dim=1)
    assert input_ids.shape == (2, 8) and torch.equal(input_ids[:, :7], full["input_ids"])
    assert torch.equal(labels[:, :7], full["labels"]) and torch.equal(labels[:, 7], torch.full((2,), -100))
    assert torch.equal(mask[:, 7], torch.zeros(2, dtype=mask.dtype))
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert torch.equal(positions, torch.arange(8).expand(2, -1))


def test_user_position_ids_are_cut_not_replaced():
    full = batch()
    full["position_ids"] = torch.arange(10, 18).expand(2, -1)
    out = SequenceSharder(2, 1)(full)
    assert torch.equal(out["position_ids"], torch.arange(14, 18).expand(2, -1))


def test_error_mode_names_the_fix():
    with pytest.raises(ValueError, match="pad_to_multiple_of=4.*sequence_padding='pad'"):
        SequenceSharder(4, 0, sequence_padding="error")(batch(seq_len=7))


def test_packed_rows_keep_their_positions():
    full = batch()
    full["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    out = SequenceSharder(2, 1)(full)
    assert torch.equal(out["position_ids"], full["position_ids"][:, 4:])


@pytest.mark.parametrize("key", ["cu_seq_lens_q", "max_length_k", "seq_idx"])
def test_whole_row_document_descriptions_are_rejected_when_cutting(key):
    full = dict(batch(), **{key: torch.tensor([0, 3, 8])})
    with pytest.raises(ValueError, match="position_ids restarting at 0"):
        SequenceSharder(2, 0)(full)
    assert torch.equal(SequenceSharder(1, 0)(full)[key], full[key])  # nothing is cut at SP 1


def test_mismatched_shapes_are_rejected():
    full = batch()
    full["labels"] = full["labels"][:, :5]
    with pytest.raises(ValueError, match=r"batch\['labels'\] must be a \[batch, seq\] tensor"):
        SequenceSharder(2, 0)(full)


def test_sp1_passes_non_dict_batches_untouched():
    data = (torch.ones(2, 3), torch.zeros(2))
    assert SequenceSharder(1, 0)(data) is data
    with pytest.raises(TypeError, match="must be a dict"):
        SequenceSharder(2, 0)(data)


def test_sp1_keeps_labels_and_fills_positions_like_sp_n():
    full = batch()
    out = SequenceSharder(1, 0)(full)
    assert torch.equal(out["position_ids"], torch.arange(full["input_ids"].size(1)).expand_as(full["input_ids"]))
    assert torch.equal(out["input_ids"], full["input_ids"])
    assert torch.equal(out["labels"], full["labels"])
