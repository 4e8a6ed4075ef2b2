"""The sharder's published whole rows (attention/rows.py) in one process: what is published, when it is read."""

from unittest import mock

import pytest
import torch

from lightning_ulysses import SequenceSharder, UlyssesAttention
from lightning_ulysses.attention.documents import DocumentMask
from lightning_ulysses.attention.rows import BatchRowsSlot

PACKED = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])


def tokens(**extra) -> dict:
    return {"input_ids": torch.arange(16).view(2, 8), **extra}


def test_sp_1_gets_global_positions_and_publishes_one_document_per_row_like_sp_n():
    slot = BatchRowsSlot()
    shard = SequenceSharder(1, 0, batch_rows=slot)(tokens(labels=torch.arange(16).view(2, 8)))
    assert torch.equal(shard["position_ids"], torch.arange(8).expand(2, 8))
    rows = slot.rows
    assert rows is not None and rows.position_ids is None  # filled in: nothing to inspect for documents
    assert rows.holds_position_ids(shard["position_ids"]) and rows.holds_input_ids(shard["input_ids"])
    assert rows.unpadded_length_of(shard["labels"]) == 8  # what the loss reads when it shifts labels


def test_sp_1_packed_rows_build_their_document_mask_once_for_every_layer():
    slot = BatchRowsSlot()
    shard = SequenceSharder(1, 0, batch_rows=slot)(tokens(position_ids=PACKED))
    attention = UlyssesAttention("sdpa")
    attention.bind_batch_rows(slot)
    unbound = UlyssesAttention("sdpa")
    query = torch.randn(2, 4, 8, 8)
    with mock.patch.object(DocumentMask, "from_rows", wraps=DocumentMask.from_rows) as from_rows:
        outputs = [attention(query, query, query, shard["position_ids"]) for _ in range(3)]
        assert from_rows.call_count == 1
        expected = unbound(query, query, query, shard["position_ids"])
        assert from_rows.call_count == 2  # the unbound module builds its own
    for output in outputs:
        assert torch.equal(output, expected)


def test_batches_made_in_inference_mode_are_described():
    # Lightning runs validate/test/predict, data loading included, under torch.inference_mode.
    slot = BatchRowsSlot()
    with torch.inference_mode():
        shard = SequenceSharder(2, 0, batch_rows=slot)(tokens(position_ids=PACKED))
        described, documents = slot.documents_for(shard["position_ids"], None)
    assert described and torch.equal(documents.document_ids[0], torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]))
    assert not slot.documents_for(shard["position_ids"].clone(), None)[0]


def test_positions_the_sharder_filled_in_are_one_document_per_row():
    slot = BatchRowsSlot()
    shard = SequenceSharder(2, 1, batch_rows=slot)(tokens())
    assert slot.documents_for(shard["position_ids"], None) == (True, None)


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_mask_the_batch_did_not_have_is_not_described(with_mask):
    slot = BatchRowsSlot()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, -2:] = 0
    shard = SequenceSharder(2, 0, batch_rows=slot)(tokens(position_ids=PACKED, **({"attention_mask": mask} if with_mask else {})))
    described, documents = slot.documents_for(shard["position_ids"], torch.ones(2, 4, dtype=torch.bool))
    assert described == with_mask
    if with_mask:
        assert torch.equal(documents.real_tokens, mask.bool())
    described, documents = slot.documents_for(shard["position_ids"], None)  # a model that ignores masks
    assert described and documents.real_tokens is None and documents.document_ids is not None


def test_a_batch_that_fails_to_shard_leaves_no_stale_rows():
    slot = BatchRowsSlot()
    sharder = SequenceSharder(2, 0, batch_rows=slot, sequence_padding="error")
    sharder(tokens(position_ids=PACKED))
    assert slot.rows is not None
    with pytest.raises(ValueError, match="not divisible"):
        sharder({"input_ids": torch.zeros(2, 7, dtype=torch.long)})
    assert slot.rows is None


def test_derived_layouts_are_computed_once_per_document_mask():
    documents = DocumentMask.from_rows(2, PACKED, torch.ones(2, 8))
    assert documents.varlen_layout() is documents.varlen_layout()
    kept, cu_seqlens, longest = documents.varlen_layout()
    assert kept is None and cu_seqlens.tolist() == [0, 3, 5, 8, 14, 16] and longest == 6
