"""Offline stand-ins for a fine-tuning user's files: a tiny pretrained Llama folder with its own tokenizer (config,
weights, tokenizer, chat template), a plain-text jsonl and a chat jsonl. Made in about a second, no Hub access.

Shared by the data, recipe and LoRA tests, so that every one of them fine-tunes the same kind of folder a user has.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

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
