"""Synthetic long-range data: the second half of every sequence repeats the first half.

Both halves carry labels: the random first half stays at ln(vocab) whatever the model does; the second half is
predictable only by attending to the first. Under sequence parallelism the halves live on different SP ranks,
so the second half's loss can fall below ln(vocab) only if attention really crosses shard boundaries.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class CopyTaskDataset(Dataset):
    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        if seq_len % 2:
            raise ValueError(f"seq_len must be even for the copy task, got {seq_len}")
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        half = torch.randint(0, self.vocab_size, (self.seq_len // 2,), generator=generator)
        input_ids = torch.cat([half, half])
        return {"input_ids": input_ids, "labels": input_ids.clone()}


class CopyTaskDataModule(L.LightningDataModule):
    def __init__(self, seq_len: int = 256, vocab_size: int = 32, num_train: int = 4096, num_val: int = 64,
                 batch_size: int = 4, num_workers: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(CopyTaskDataset(h.num_train, h.seq_len, h.vocab_size, seed=0), batch_size=h.batch_size,
                          shuffle=True, num_workers=h.num_workers)

    def val_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(CopyTaskDataset(h.num_val, h.seq_len, h.vocab_size, seed=1), batch_size=h.batch_size,
                          num_workers=h.num_workers)
