"""Real text for the recipes: local text files, or a pre-tokenized memory-mapped token file for large corpora.

Both cut the token stream into fixed rows of `seq_len` tokens (one row = one training sample; documents are
joined with an end-of-text token and may cross rows). With `pack_documents=True` the rows are packed
(data/packing.py): positions restart at every document, whose first label is masked, and attention (sharded or
not) keeps the documents apart.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional, Sequence, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_ulysses.data.packing import packed_rows


class TokenRows(Dataset):
    """Row i is `tokens[i * seq_len : (i + 1) * seq_len]` of a 1-D array (in memory or memory-mapped)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len:
            raise ValueError(f"only {len(tokens)} tokens, fewer than one row of seq_len={seq_len}")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> dict:
        row = torch.from_numpy(np.asarray(self.tokens[index * self.seq_len : (index + 1) * self.seq_len], dtype=np.int64))
        return {"input_ids": row, "labels": row.clone()}


class PackedTokenRows(TokenRows):
    """Row i of a token stream whose documents each end with the token `end_of_document`, as a packed row.

    The stream is cut exactly as `TokenRows` cuts it (nothing dropped or padded; the end token stays the last
    token of its document, so the model learns to end documents); the row gains `position_ids` restarting at every
    document and labels masked at every document start (see data/packing.py).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, end_of_document: int):
        super().__init__(tokens, seq_len)
        self.end_of_document = end_of_document

    def __getitem__(self, index: int) -> dict:
        row = super().__getitem__(index)["input_ids"]
        starts = torch.zeros_like(row, dtype=torch.bool)
        starts[1:] = row[:-1] == self.end_of_document
        return packed_rows(row, starts)


class _RowsDataModule(L.LightningDataModule):
    def __init__(self, seq_len: int, batch_size: int, val_fraction: float, num_workers: int):
        super().__init__()
        self.seq_len, self.batch_size, self.val_fraction, self.num_workers = seq_len, batch_size, val_fraction, num_workers
        self.train_rows: Optional[Dataset] = None
        self.val_rows: Optional[Dataset] = None

    def _split(self, tokens: np.ndarray, end_of_document: Optional[int] = None) -> None:
        """Train/validation rows; packed (documents apart) when `end_of_document` is given."""
        cut = int(len(tokens) * (1 - self.val_fraction)) // self.seq_len * self.seq_len

        def rows(part: np.ndarray) -> TokenRows:
            if end_of_document is None:
                return TokenRows(part, self.seq_len)
            return PackedTokenRows(part, self.seq_len, end_of_document)

        self.train_rows = rows(tokens[:cut])
        self.val_rows = rows(tokens[cut:]) if len(tokens) - cut >= self.seq_len else None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_rows, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self):
        return [] if self.val_rows is None else DataLoader(self.val_rows, batch_size=self.batch_size,
                                                            num_workers=self.num_workers)


class TextDataModule(_RowsDataModule):
    """Local text files (paths or glob patterns). Tokenizer: bytes (vocab 257, 256 = end of text) by default, or
    a Hugging Face tokenizer from a local directory (`tokenizer=/path/to/tokenizer`, nothing is downloaded).
    Every file is one document; `pack_documents=True` keeps documents apart (see `PackedTokenRows`)."""

    BYTE_VOCAB_SIZE = 257

    def __init__(self, paths: Union[str, Sequence[str]], seq_len: int = 1024, batch_size: int = 1,
                 tokenizer: Optional[str] = None, val_fraction: float = 0.02, num_workers: int = 0,
                 pack_documents: bool = False):
        super().__init__(seq_len, batch_size, val_fraction, num_workers)
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.tokenizer = tokenizer
        self.pack_documents = pack_documents

    def setup(self, stage: str) -> None:
        files = sorted({f for pattern in self.paths for f in glob.glob(str(Path(pattern).expanduser()), recursive=True)})
        if not files:
            raise FileNotFoundError(f"no text files match {self.paths}: set data.paths to existing files or globs")
        documents = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
        if self.tokenizer is None:
            end = 256
            pieces = [np.append(np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.int32), end) for d in documents]
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True)
            end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            pieces = [np.array(tokenizer(d)["input_ids"] + [end], dtype=np.int32) for d in documents]
        self._split(np.concatenate(pieces), end if self.pack_documents else None)


class TokenFileDataModule(_RowsDataModule):
    """A flat binary file of token ids (`dtype` uint16 for vocabularies < 65536, else uint32), memory-mapped so
    that corpora larger than RAM work; every rank maps the same file. `pack_documents=True` keeps documents apart,
    which needs the token id that ends every document in the file (`end_of_document`)."""

    def __init__(self, path: str, seq_len: int = 1024, batch_size: int = 1, dtype: str = "uint16",
                 val_fraction: float = 0.001, num_workers: int = 0, pack_documents: bool = False,
                 end_of_document: Optional[int] = None):
        super().__init__(seq_len, batch_size, val_fraction, num_workers)
        if pack_documents and end_of_document is None:
            raise ValueError(
                "pack_documents=True needs end_of_document: the token id that ends every document in the token file"
                " (e.g. 50256 for the GPT-2 tokenizer's <|endoftext|>)."
            )
        self.path, self.dtype = path, dtype
        self.end_of_document = end_of_document if pack_documents else None

    def setup(self, stage: str) -> None:
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"token file {self.path} does not exist: set data.path")
        self._split(np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r"), self.end_of_document)
