"""Fixtures shared by the recipe tests."""

from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def finetune_folder(tmp_path_factory) -> SimpleNamespace:
    """What a fine-tuning user has: a `save_pretrained` folder (tiny Llama + tokenizer with a chat template), a text
    jsonl and a chat jsonl, made as the README tells a new user to make them, by
    `python -m lightning_ulysses example-finetune <folder>` (its `main`, in this process); `commands` are the lines it
    printed to run next (text data, then chat data)."""
    from transformers import AutoTokenizer

    from lightning_ulysses.recipe.example import main

    root = tmp_path_factory.mktemp("finetune") / "example"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main([str(root)]) == 0
    commands = [line.strip() for line in printed.getvalue().splitlines() if "scripts/run.sh train" in line]
    return SimpleNamespace(model=root / "model", text=root / "text.jsonl", chat=root / "chat.jsonl",
                           tokenizer=AutoTokenizer.from_pretrained(root / "model"), commands=commands)
