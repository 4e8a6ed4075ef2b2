"""Fixtures shared by the recipe tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def finetune_folder(tmp_path_factory) -> SimpleNamespace:
    """What a fine-tuning user has: a `save_pretrained` folder (tiny Llama + tokenizer with a chat template), a text
    jsonl and a chat jsonl (tests/finetune_fixtures.py)."""
    from tests.finetune_fixtures import save_tiny_pretrained, write_chat_jsonl, write_text_jsonl

    root = tmp_path_factory.mktemp("finetune")
    model, tokenizer = save_tiny_pretrained(root / "model")
    return SimpleNamespace(model=root / "model", text=write_text_jsonl(root / "text.jsonl"),
                           chat=write_chat_jsonl(root / "chat.jsonl"), tokenizer=tokenizer)
