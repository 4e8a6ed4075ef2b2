"""Packing documents into fixed-length rows: no padding waste, and no token attends to another document.

The rows follow the convention the strategy and the models read (attention/documents.py):

- `input_ids`: the documents back to back, cut into rows of `seq_len`. A document that does not fit continues in
  the next row, where it starts again at position 0: the two pieces are trained as two documents.
- `position_ids`: restart at 0 at every document start and at every row start.
- `labels`: the tokens, with -100 at every document start. Labels are unshifted (token t is predicted from the
  tokens before it), so without the mask the first token of a document would be predicted from the end of the
  previous, unrelated one; masked, the loss is exactly that of the documents trained one by one.
- Padding (only to fill the last row of a collated batch): `pad_token_id`, labels -100 and positions that continue
  the last document, so the padding is not a document of its own; it comes last, so no real token attends to it.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from lightning_ulysses.loss import IGNORE_INDEX

Document = Union[torch.Tensor, Sequence[int], dict]


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Positions `[..., seq]` that restart at 0 wherever `starts` is True (and at the first token of each row)."""
    index = torch.arange(starts.size(-1), device=starts.device).expand_as(starts)
    starts = starts.clone()
    starts[..., 0] = True
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values


def packed_rows(input_ids: torch.Tensor, starts: torch.Tensor) -> dict[str, torch.Tensor]:
    """`input_ids` `[..., seq]` with document `starts` (bool, same shape) → the packed-row batch entries.

    The first token of every row counts as a start (a document cut by the row boundary restarts there).
    """
    starts = starts.clone()
    starts[..., 0] = True
    return {
        "input_ids": input_ids,
        "labels": input_ids.masked_fill(starts, IGNORE_INDEX),
        "position_ids": document_positions(starts),
    }


def pack_documents(documents: Sequence[Document], seq_len: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pack `documents` (1-D token sequences, or dicts with `input_ids`) in order into `[rows, seq_len]` rows."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces = [torch.as_tensor(d["input_ids"] if isinstance(d, dict) else d, dtype=torch.long).reshape(-1) for d in documents]
    pieces = [piece for piece in pieces if piece.numel()]
    if not pieces:
        raise ValueError("pack_documents got no tokens: every document is empty")
    tokens = torch.cat(pieces)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[torch.tensor([0] + [piece.numel() for piece in pieces[:-1]]).cumsum(0)] = True
    padding = -tokens.numel() % seq_len
    tokens = torch.cat([tokens, torch.full((padding,), pad_token_id, dtype=torch.long)])
    starts = torch.cat([starts, torch.zeros(padding, dtype=torch.bool)])
    rows = packed_rows(tokens.view(-1, seq_len), starts.view(-1, seq_len))
    if padding:
        rows["labels"][-1, seq_len - padding :] = IGNORE_INDEX
    return rows


class PackingCollator:
    """`collate_fn` for a dataset of documents: packs each batch's documents into rows of `seq_len` tokens.

    The number of rows varies with the batch's documents (every rank of an SP group sees the same batch, so the
    ranks agree). `DataLoader(documents, batch_size=64, collate_fn=PackingCollator(4096))`.
    """

    def __init__(self, seq_len: int, pad_token_id: int = 0):
        self.seq_len, self.pad_token_id = seq_len, pad_token_id

    def __call__(self, documents: Sequence[Document]) -> dict[str, torch.Tensor]:
        return pack_documents(documents, self.seq_len, self.pad_token_id)
