"""Real text for the recipes: local text files, or a pre-tokenized memory-mapped token file for large corpora.

Both cut the token stream into fixed rows of `seq_len` tokens (one row = one training sample; documents are
joined with an end-of-text token and may cross rows, since packed rows with restarting positions are not
supported under sequence parallelism yet).
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Optional, Sequence, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


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


class _RowsDataModule(L.LightningDataModule):
    def __init__(self, seq_len: int, batch_size: int, val_fraction: float, num_workers: int):
        super().__init__()
        self.seq_len, self.batch_size, self.val_fraction, self.num_workers = seq_len, batch_size, val_fraction, num_workers
        self.train_rows: Optional[Dataset] = None
        self.val_rows: Optional[Dataset] = None

    def _split(self, tokens: np.ndarray) -> None:
        cut = int(len(tokens) * (1 - self.val_fraction)) // self.seq_len * self.seq_len
        self.train_rows = TokenRows(tokens[:cut], self.seq_len)
        self.val_rows = TokenRows(tokens[cut:], self.seq_len) if len(tokens) - cut >= self.seq_len else None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_rows, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self):
        return [] if self.val_rows is None else DataLoader(self.val_rows, batch_size=self.batch_size,
                                                            num_workers=self.num_workers)


class TextDataModule(_RowsDataModule):
    """Local text files (paths or glob patterns). Tokenizer: bytes (vocab 257, 256 = end of text) by default, or
    a Hugging Face tokenizer from a local directory (`tokenizer=/path/to/tokenizer`, nothing is downloaded)."""

    BYTE_VOCAB_SIZE = 257

    def __init__(self, paths: Union[str, Sequence[str]], seq_len: int = 1024, batch_size: int = 1,
                 tokenizer: Optional[str] = None, val_fraction: float = 0.02, num_workers: int = 0):
        super().__init__(seq_len, batch_size, val_fraction, num_workers)
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.tokenizer = tokenizer

    def setup(self, stage: str) -> None:
        files = sorted({f for pattern in self.paths for f in glob.glob(str(Path(pattern).expanduser()), recursive=True)})
        if not files:
            raise FileNotFoundError(f"no text files match {self.paths}: set data.paths to existing files or globs")
        documents = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
        if self.tokenizer is None:
            pieces = [np.append(np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.int32), 256) for d in documents]
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True)
            end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            pieces = [np.array(tokenizer(d)["input_ids"] + [end], dtype=np.int32) for d in documents]
        self._split(np.concatenate(pieces))


class TokenFileDataModule(_RowsDataModule):
    """A flat binary file of token ids (`dtype` uint16 for vocabularies < 65536, else uint32), memory-mapped so
    that corpora larger than RAM work; every rank maps the same file."""

    def __init__(self, path: str, seq_len: int = 1024, batch_size: int = 1, dtype: str = "uint16",
                 val_fraction: float = 0.001, num_workers: int = 0):
        super().__init__(seq_len, batch_size, val_fraction, num_workers)
        self.path, self.dtype = path, dtype

    def setup(self, stage: str) -> None:
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"token file {self.path} does not exist: set data.path")
        self._split(np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r"))
