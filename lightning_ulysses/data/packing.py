"""Packing documents into fixed-length rows: no padding waste, and no token attends to another document.

The rows follow the convention the strategy and the models read (attention/documents.py):

- `input_ids`: the documents back to back, cut into rows of `seq_len`. A document that does not fit continues in
  the next row, where it starts again at position 0: the two pieces are trained as two documents.
- `position_ids`: restart at 0 at every document start and at every row start.
- `labels`: the tokens (or a document's own labels, e.g. -100 outside a chat's assistant turns), with -100 at
  every document start. Labels are unshifted (token t is predicted from the tokens before it), so without the mask
  the first token of a document would be predicted from the end of the previous, unrelated one; masked, the loss is
  exactly that of the documents trained one by one.
- Padding (only to fill the last row of a collated batch): `pad_token_id`, labels -100 and positions that continue
  the last document, so the padding is not a document of its own; it comes last, so no real token attends to it.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from lightning_ulysses.training.loss import IGNORE_INDEX

Document = Union[torch.Tensor, Sequence[int], dict]


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Positions `[..., seq]` that restart at 0 wherever `starts` is True (and at the first token of each row)."""
    index = torch.arange(starts.size(-1), device=starts.device).expand_as(starts)
    starts = starts.clone()
    starts[..., 0] = True
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values


def packed_rows(input_ids: torch.Tensor, starts: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """`input_ids` `[..., seq]` with document `starts` (bool, same shape) → the packed-row batch entries.

    The first token of every row counts as a start (a document cut by the row boundary restarts there). `labels`
    (same shape; default: the tokens) are what is trained on, e.g. -100 outside a chat's assistant turns.
    """
    starts = starts.clone()
    starts[..., 0] = True
    return {
        "input_ids": input_ids,
        "labels": (input_ids if labels is None else labels).masked_fill(starts, IGNORE_INDEX),
        "position_ids": document_positions(starts),
    }


def _tokens_and_labels(document: Document) -> tuple[torch.Tensor, torch.Tensor]:
    def flat(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.long).reshape(-1)

    if not isinstance(document, dict):
        tokens = flat(document)
        return tokens, tokens
    tokens = flat(document["input_ids"])
    labels = flat(document["labels"]) if "labels" in document else tokens
    if labels.shape != tokens.shape:
        raise ValueError(f"a document's labels ({labels.numel()}) and input_ids ({tokens.numel()}) differ in length")
    return tokens, labels


def pack_documents(documents: Sequence[Document], seq_len: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pack `documents` in order into `[rows, seq_len]` rows: 1-D token sequences, or dicts with `input_ids` and
    optionally `labels` (unshifted, -100 where nothing is trained; default: the tokens)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    pieces = [piece for piece in map(_tokens_and_labels, documents) if piece[0].numel()]
    if not pieces:
        raise ValueError("pack_documents got no tokens: every document is empty")
    tokens, labels = (torch.cat(column) for column in zip(*pieces))
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[torch.tensor([0] + [piece.numel() for piece, _ in pieces[:-1]]).cumsum(0)] = True
    padding = -tokens.numel() % seq_len
    tokens = torch.cat([tokens, torch.full((padding,), pad_token_id, dtype=torch.long)])
    labels = torch.cat([labels, torch.full((padding,), IGNORE_INDEX, dtype=torch.long)])
    starts = torch.cat([starts, torch.zeros(padding, dtype=torch.bool)])
    return packed_rows(tokens.view(-1, seq_len), starts.view(-1, seq_len), labels.view(-1, seq_len))


class PackingCollator:
    """`collate_fn` for a dataset of documents: packs each batch's documents into rows of `seq_len` tokens.

    The number of rows varies with the batch's documents (every rank of an SP group sees the same batch, so the
    ranks agree). `DataLoader(documents, batch_size=64, collate_fn=PackingCollator(4096))`.
    """

    def __init__(self, seq_len: int, pad_token_id: int = 0):
        self.seq_len, self.pad_token_id = seq_len, pad_token_id

    def __call__(self, documents: Sequence[Document]) -> dict[str, torch.Tensor]:
        return pack_documents(documents, self.seq_len, self.pad_token_id)
