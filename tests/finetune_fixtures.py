"""Offline stand-ins for a fine-tuning user's files: the tiny pretrained Llama folder with its own tokenizer (config,
weights, tokenizer, chat template), the plain-text jsonl and the chat jsonl that `python -m lightning_ulysses
example-finetune` writes (`lightning_ulysses.recipe.example`), plus the same documents in the other file formats.

Shared by the data, recipe and LoRA tests, so that every one of them fine-tunes the same kind of folder a user has.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_ulysses.recipe.example import (  # noqa: F401  (re-exported for the tests)
    CHAT_TEMPLATE,
    save_tiny_pretrained,
    save_tiny_tokenizer,
    text_documents,
    write_chat_jsonl,
    write_text_jsonl,
)


def write_text_file(path: Path, lines: int = 300, field: str = "text", seed: int = 0) -> Path:
    """`text_documents` in the format `path`'s suffix names: .jsonl, .json (one array), .parquet, .arrow (an Arrow
    stream, as `datasets` writes), .txt (one document per line; `field` is then datasets' "text")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, documents = Path(path), text_documents(lines, seed)
    table = pa.table({field: documents})
    if path.suffix == ".jsonl":
        return write_text_jsonl(path, lines, field, seed)
    if path.suffix == ".json":
        path.write_text(json.dumps([{field: text} for text in documents]))
    elif path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".arrow":
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            writer.write_table(table)
    elif path.suffix == ".txt":
        path.write_text("".join(text + "\n" for text in documents))
    else:
        raise ValueError(f"no writer for {path.suffix}")
    return path
