"""`python -m lightning_ulysses example-finetune <folder>`: a tiny model folder and data files to try
`experiment=finetune_cpu` on, made offline in a second or two (no Hub access, nothing downloaded).

    <folder>/model/       a random Llama (2 layers, width 32, 4 heads, 2 KV heads) saved with `save_pretrained`, with
                          its own tokenizer (a byte-level BPE trained here on a small vocabulary) and a chat template
                          that marks the assistant's turns with {% generation %}: what a user's model folder holds
    <folder>/text.jsonl   plain-text documents, one `{"text": ...}` per line
    <folder>/chat.jsonl   conversations, one `{"messages": [{"role": ..., "content": ...}, ...]}` per line

The command then prints the exact `bash scripts/run.sh train experiment=finetune_cpu ...` lines that fine-tune it.
The words are random, so the loss falls only as far as the word frequencies and the templates allow: enough to see
a fine-tune learn, not a model worth keeping. The test suite fine-tunes the same folders (`tests/finetune_fixtures.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

WORDS = ("the cat dog sat on a mat long sequence parallel ranks shard tokens attention heads gradient step model "
         "train data file row pack chat user assistant says hello world why because").split()

# A Llama-3-like template with `{% generation %}` around what the assistant writes: transformers'
# `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly those tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def save_tiny_tokenizer(folder: Path, vocab_size: int = 320):
    """A byte-level BPE trained on `WORDS` with bos/eos/pad and `CHAT_TEMPLATE`, saved with `save_pretrained`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((sentence(rng, 12) for _ in range(500)), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_tiny_pretrained(folder: Path, num_key_value_heads: int = 2, seed: int = 0):
    """A tiny Llama (4 heads, vocab = the tokenizer's) and its tokenizer in one `save_pretrained` folder, as a user's
    model folder is. Returns (model, tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = save_tiny_tokenizer(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=num_key_value_heads, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model, tokenizer


def text_documents(lines: int = 300, seed: int = 0) -> list[str]:
    """`lines` documents of 5-60 words."""
    rng = random.Random(seed)
    return [sentence(rng, rng.randint(5, 60)) for _ in range(lines)]


def write_text_jsonl(path: Path, lines: int = 300, field: str = "text", seed: int = 0) -> Path:
    """`lines` documents of 5-60 words, one JSON object per line."""
    Path(path).write_text("".join(json.dumps({field: text}) + "\n" for text in text_documents(lines, seed)))
    return Path(path)


def write_chat_jsonl(path: Path, lines: int = 200, field: str = "messages", seed: int = 0) -> Path:
    """`lines` conversations (optional system turn, 1-3 user/assistant exchanges), one JSON object per line."""
    rng = random.Random(seed)
    rows = []
    for _ in range(lines):
        messages = [{"role": "system", "content": sentence(rng, 4)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": sentence(rng, rng.randint(3, 15))},
                         {"role": "assistant", "content": sentence(rng, rng.randint(3, 25))}]
        rows.append(json.dumps({field: messages}) + "\n")
    Path(path).write_text("".join(rows))
    return Path(path)


@dataclass(frozen=True)
class ExampleFinetune:
    """What `write_example_finetune` wrote: the model folder, the two data files, and the commands that train."""

    model: Path
    text: Path
    chat: Path

    def commands(self) -> list[str]:
        """The `bash scripts/run.sh train ...` lines (run from the project's root) that fine-tune the model on the
        text file and on the chat file (the assistant's tokens only)."""
        base = f"bash scripts/run.sh train experiment=finetune_cpu model.pretrained={self.model}"
        return [f"{base} data.files={self.text}", f"{base} data.files={self.chat} data.messages_field=messages"]


def write_example_finetune(folder: Path, seed: int = 0) -> ExampleFinetune:
    """`folder/model` (a tiny random Llama with its tokenizer), `folder/text.jsonl` and `folder/chat.jsonl` (see
    the module docstring); the folder is created. Absolute paths: the printed commands work from any directory."""
    folder = Path(folder).expanduser().resolve()
    save_tiny_pretrained(folder / "model", seed=seed)
    return ExampleFinetune(folder / "model", write_text_jsonl(folder / "text.jsonl", seed=seed),
                           write_chat_jsonl(folder / "chat.jsonl", seed=seed))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ulysses example-finetune",
        description="Write a tiny model folder (random Llama + tokenizer + chat template) and text/chat jsonl files,"
                    " offline, and print the command that fine-tunes it with experiment=finetune_cpu.")
    parser.add_argument("folder", type=Path, help="where to write them (created; must be empty or new)")
    args = parser.parse_args(argv)
    folder = args.folder.expanduser().resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        print(f"error: {folder} already exists and is not an empty folder: name a new one (nothing was written).",
              file=sys.stderr)
        return 1
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Writing model shards" of a one-file model
    example = write_example_finetune(folder)
    text, chat = example.commands()
    print(f"Wrote a tiny model and data to {folder} (offline; random weights, for trying the recipe):\n"
          f"  {example.model}    Llama, 2 layers, width 32, 4 heads, with tokenizer and chat template\n"
          f"  {example.text}    plain text, {{\"text\": ...}} per line\n"
          f"  {example.chat}    conversations, {{\"messages\": [{{role, content}}, ...]}} per line\n"
          f"\nFine-tune it on 2 CPU processes (SP 2, 60 steps, a minute or two; from the project's root):\n  {text}\n"
          f"On the chat data (trains on the assistant's tokens only):\n  {chat}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
