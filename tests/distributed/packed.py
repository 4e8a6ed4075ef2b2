"""Packed-row data for the distributed tests, and the reference: the unsharded model run on each document alone.

The reference finds the documents with a plain loop over the tokens (a document ends with END_OF_DOCUMENT, a
row starts a new one), independently of the packing and masking code under test.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from lightning_ulysses.data import PackedTokenRows
from tests.distributed.common import VOCAB

END_OF_DOCUMENT = VOCAB - 1


def token_stream(num_tokens: int, seed: int = 0) -> np.ndarray:
    """Documents of 1 to 11 random tokens plus the end token, back to back."""
    generator = torch.Generator().manual_seed(seed)
    pieces, total = [], 0
    while total < num_tokens:
        length = int(torch.randint(1, 12, (1,), generator=generator))
        pieces.append(torch.cat([torch.randint(0, END_OF_DOCUMENT, (length,), generator=generator),
                                 torch.tensor([END_OF_DOCUMENT])]))
        total += length + 1
    return torch.cat(pieces)[:num_tokens].numpy()


class PackedDocuments(Dataset):
    """Packed rows of `token_stream` (through the recipes' `PackedTokenRows`), with their index for the tests."""

    def __init__(self, num_samples: int, seq_len: int):
        self.rows = PackedTokenRows(token_stream(num_samples * seq_len), seq_len, END_OF_DOCUMENT)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return dict(self.rows[index], sample_index=torch.tensor(index))


def document_spans(row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of every document of a row: one starts at the row start and after every end token."""
    spans, start = [], 0
    for index, token in enumerate(row.tolist()):
        if token == END_OF_DOCUMENT or index == len(row) - 1:
            spans.append((start, index + 1))
            start = index + 1
    return spans


def spans_from_lengths(lengths: list[int]) -> list[tuple[int, int]]:
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    return [(start, start + length) for start, length in zip(starts, lengths)]


def per_document_forward(model, input_ids: torch.Tensor, spans: list[list[tuple[int, int]]]):
    """Run `model` on every document alone. Returns (loss: token mean over all documents, full-row logits)."""
    loss_sum, count, rows = 0.0, 0, []
    for row, row_spans in zip(input_ids, spans):
        pieces = []
        for start, end in row_spans:
            document = row[start:end][None]
            logits = model(input_ids=document).logits[0]
            pieces.append(logits)
            loss_sum = loss_sum + F.cross_entropy(logits[:-1], document[0, 1:], reduction="sum")
            count += end - start - 1
        rows.append(torch.cat(pieces))
    return loss_sum / count, torch.stack(rows)
