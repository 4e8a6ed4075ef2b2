"""The packing collator and the recipes' packed data path (one process, no sequence parallelism)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses.data import (
    PackedTokenRows,
    PackingCollator,
    TextDataModule,
    TokenFileDataModule,
    document_positions,
    pack_documents,
)
from lightning_ulysses.models import GPTConfig


def test_document_positions_restart_at_starts_and_row_starts():
    starts = torch.tensor([[False, False, True, False, True, True], [False, True, False, False, False, False]])
    expected = torch.tensor([[0, 1, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4]])
    assert torch.equal(document_positions(starts), expected)


def test_pack_documents_cuts_rows_and_masks_boundaries():
    documents = [torch.arange(1, 6), list(range(10, 19)), torch.tensor([30, 31, 32]), torch.arange(40, 47)]
    rows = pack_documents(documents, seq_len=12)
    tokens = torch.cat([torch.as_tensor(d) for d in documents])
    assert torch.equal(rows["input_ids"], tokens.view(2, 12))  # 24 tokens: two full rows, no padding
    # Document 2 (9 tokens) does not fit in row 0: its last 2 tokens restart at position 0 in row 1.
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]
    assert torch.equal(rows["labels"], rows["input_ids"].masked_fill(rows["position_ids"] == 0, -100))


def test_last_row_is_padded_as_a_continuation_with_ignored_labels():
    rows = PackingCollator(seq_len=6, pad_token_id=99)([{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(7, 11)}])
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7], [8, 9, 10, 99, 99, 99]]
    assert rows["labels"].tolist() == [[-100, 2, 3, 4, 5, -100], [-100, 9, 10, -100, -100, -100]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 5]]  # padding starts no document


def test_pack_documents_trains_on_a_documents_own_labels():
    # A chat's labels (-100 outside the assistant turns) replace the tokens; starts and padding stay masked.
    rows = pack_documents([{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}, [5, 6, 7],
                           {"input_ids": [8, 9], "labels": [8, -100]}], seq_len=5, pad_token_id=0)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert rows["labels"].tolist() == [[-100, -100, 3, 4, -100], [-100, 7, -100, -100, -100]]
    with pytest.raises(ValueError, match="differ in length"):
        pack_documents([{"input_ids": [1, 2], "labels": [1]}], seq_len=4)


def test_pack_documents_rejects_nothing_to_pack():
    with pytest.raises(ValueError, match="no tokens"):
        pack_documents([[], torch.tensor([], dtype=torch.long)], seq_len=4)


def test_packed_token_rows_start_documents_after_the_end_token():
    end = 9
    stream = np.array([1, 2, end, 3, 4, 5, end, 6, end, 7, 8, 1], dtype=np.uint16)
    rows = PackedTokenRows(stream, seq_len=6, end_of_document=end)
    assert len(rows) == 2
    first, second = rows[0], rows[1]
    assert first["input_ids"].tolist() == [1, 2, end, 3, 4, 5]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    assert first["labels"].tolist() == [-100, 2, end, -100, 4, 5]
    assert second["input_ids"].tolist() == [end, 6, end, 7, 8, 1]
    assert second["position_ids"].tolist() == [0, 0, 1, 0, 1, 2]  # row start, after each end token
    assert second["labels"].tolist() == [-100, -100, end, -100, 8, 1]


def test_text_module_packs_each_file_as_a_document(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefg")
    (tmp_path / "b.txt").write_text("hijklmnopqrstu")
    module = TextDataModule(str(tmp_path / "*.txt"), seq_len=8, val_fraction=0.0, pack_documents=True)
    module.setup("fit")
    row = module.train_rows[0]
    assert row["input_ids"].tolist() == [*b"abcdefg", 256]  # a.txt and its end-of-text byte fill row 0
    assert row["position_ids"].tolist() == list(range(8))
    second = module.train_rows[1]
    assert second["position_ids"][0] == 0 and second["labels"][0] == -100
    plain = TextDataModule(str(tmp_path / "*.txt"), seq_len=8, val_fraction=0.0)
    plain.setup("fit")
    assert set(plain.train_rows[0]) == {"input_ids", "labels"}  # off by default: rows as before


def test_token_file_packing_needs_the_end_token():
    with pytest.raises(ValueError, match="needs end_of_document"):
        TokenFileDataModule("/nonexistent.bin", pack_documents=True)


def test_native_gpt_on_packed_rows_equals_documents_alone():
    """Unsharded too, the native GPT keeps packed documents apart (position_ids reach its attention)."""
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_key_value_heads=2).build().float()
    documents = [torch.randint(0, 64, (n,)) for n in (5, 9, 3, 7)]
    rows = pack_documents(documents, seq_len=12)
    output = model(**rows)
    loss_sum, count = 0.0, 0
    for index, (row, positions) in enumerate(zip(rows["input_ids"], rows["position_ids"])):
        bounds = (positions == 0).nonzero().flatten().tolist() + [row.numel()]
        for start, end in zip(bounds[:-1], bounds[1:]):
            logits = model(row[None, start:end]).logits[0]
            assert (output.logits[index, start:end] - logits).abs().max() < 1e-5
            loss_sum = loss_sum + F.cross_entropy(logits[:-1], row[start + 1 : end], reduction="sum")
            count += end - start - 1
    assert abs(output.loss.item() - (loss_sum / count).item()) < 1e-5
