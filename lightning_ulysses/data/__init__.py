from lightning_ulysses.data.copy_task import CopyTaskDataModule, CopyTaskDataset
from lightning_ulysses.data.text import TextDataModule, TokenFileDataModule, TokenRows

__all__ = ["CopyTaskDataModule", "CopyTaskDataset", "TextDataModule", "TokenFileDataModule", "TokenRows"]
