from lightning_ulysses.data.copy_task import CopyTaskDataModule, CopyTaskDataset

__all__ = ["CopyTaskDataModule", "CopyTaskDataset"]
