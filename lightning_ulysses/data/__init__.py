from lightning_ulysses.data.copy_task import CopyTaskDataModule, CopyTaskDataset
from lightning_ulysses.data.hf_dataset import HFDataModule
from lightning_ulysses.data.packing import PackingCollator, document_positions, pack_documents
from lightning_ulysses.data.text import PackedTokenRows, TextDataModule, TokenFileDataModule, TokenRows

__all__ = [
    "CopyTaskDataModule",
    "CopyTaskDataset",
    "HFDataModule",
    "PackedTokenRows",
    "PackingCollator",
    "TextDataModule",
    "TokenFileDataModule",
    "TokenRows",
    "document_positions",
    "pack_documents",
]
