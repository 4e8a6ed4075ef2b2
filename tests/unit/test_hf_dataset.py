"""`data=hf_dataset`: files through Hugging Face `datasets`, tokenised, packed or padded, chat labels, streaming,
the data-parallel split and the validation split (one process, tiny files; the fixtures a fine-tuning user has)."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_ulysses.data import HFDataModule
from tests.finetune_fixtures import (
    CHAT_TEMPLATE,
    save_tiny_tokenizer,
    text_documents,
    write_chat_jsonl,
    write_text_file,
    write_text_jsonl,
)

SEQ_LEN = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_dataset")
    save_tiny_tokenizer(folder / "tokenizer")
    write_text_jsonl(folder / "text.jsonl", lines=120)
    write_chat_jsonl(folder / "chat.jsonl", lines=40)
    return folder


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder / "tokenizer")


def data(folder, files="text.jsonl", trainer=None, **options):
    options = {"seq_len": SEQ_LEN, "tokenizer": str(folder / "tokenizer"), "cache_dir": str(folder / "cache"), **options}
    module = HFDataModule([str(folder / f) for f in files] if isinstance(files, list) else str(folder / files), **options)
    module.trainer = trainer
    if not module.streaming:
        module.setup("fit")
    return module


def rows(dataset) -> list[dict]:
    return list(dataset) if isinstance(dataset, torch.utils.data.IterableDataset) else [dataset[i] for i in range(len(dataset))]


def assert_same_rows(actual: list[dict], expected: list[dict]):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.keys() == e.keys() and all(torch.equal(a[key], e[key]) for key in a)


def test_packed_rows_are_the_documents_back_to_back(folder, tokenizer):
    packed = rows(data(folder).train_rows)
    documents = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in text_documents(120)]
    assert [tokenizer.decode(d[:-1]) for d in documents] == text_documents(120)  # the tokens are the text
    stream = torch.tensor([token for d in documents for token in d])
    assert len(packed) == -(-len(stream) // SEQ_LEN)
    padding = len(packed) * SEQ_LEN - len(stream)
    tokens = torch.cat([row["input_ids"] for row in packed])
    assert torch.equal(tokens[: len(stream)], stream) and (tokens[len(stream) :] == tokenizer.pad_token_id).all()
    # Positions count from the later of the document's start and the row's start; the first label of each is masked.
    document_start = torch.repeat_interleave(torch.tensor([0] + [len(d) for d in documents[:-1]]).cumsum(0),
                                             torch.tensor([len(d) for d in documents]))
    index = torch.arange(len(stream))
    expected = index - torch.maximum(document_start, index // SEQ_LEN * SEQ_LEN)
    positions = torch.cat([row["position_ids"] for row in packed])
    assert torch.equal(positions[: len(stream)], expected)
    assert torch.equal(positions[len(stream) :], expected[-1] + torch.arange(1, padding + 1))  # padding continues
    labels = torch.cat([row["labels"] for row in packed])
    assert torch.equal(labels[: len(stream)], stream.masked_fill(expected == 0, -100))
    assert (labels[len(stream) :] == -100).all()


@pytest.mark.parametrize("suffix", [".json", ".parquet", ".arrow", ".txt"])
def test_every_file_format_gives_the_jsonl_rows(folder, suffix):
    write_text_file(folder / f"text{suffix}", lines=120)
    assert_same_rows(rows(data(folder, f"text{suffix}").train_rows), rows(data(folder).train_rows))


def test_padded_rows_hold_one_document_each_truncated_to_seq_len(folder, tokenizer):
    with pytest.warns(UserWarning, match="are longer than data.seq_len=16 and are truncated"):
        padded = rows(data(folder, seq_len=16, pack=False).train_rows)
    documents = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in text_documents(120)]
    assert len(padded) == len(documents)
    for row, document in zip(padded, documents):
        real = min(len(document), 16)
        assert row.keys() == {"input_ids", "labels", "attention_mask"}
        assert row["input_ids"][:real].tolist() == document[:real] and (row["input_ids"][real:] == tokenizer.pad_token_id).all()
        assert row["attention_mask"].tolist() == [1] * real + [0] * (16 - real)
        assert row["labels"].tolist() == document[:real] + [-100] * (16 - real)
    assert any(len(d) < 16 for d in documents) and any(len(d) > 16 for d in documents)  # both cases are exercised


def labelled_spans(labels: torch.Tensor) -> list[list[int]]:
    spans, current = [], []
    for label in labels.tolist() + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            spans, current = spans + [current], []
    return spans


def test_chat_trains_on_the_assistant_turns_only(folder, tokenizer):
    conversations = [json.loads(line)["messages"] for line in (folder / "chat.jsonl").read_text().splitlines()]
    padded = rows(data(folder, "chat.jsonl", messages_field="messages", pack=False, seq_len=512).train_rows)
    assert len(padded) == len(conversations)
    for row, messages in zip(padded, conversations):
        assert row["attention_mask"].sum() < 512  # nothing truncated
        spans = [tokenizer.decode(span) for span in labelled_spans(row["labels"])]
        assert spans == [m["content"] + tokenizer.eos_token for m in messages if m["role"] == "assistant"]
    # Packed, the same labels, with each conversation's first label (its bos, never trained) masked at its start.
    packed = rows(data(folder, "chat.jsonl", messages_field="messages").train_rows)
    stream = torch.cat([row["labels"][row["attention_mask"].bool()] for row in padded])
    labels = torch.cat([row["labels"] for row in packed])
    positions = torch.cat([row["position_ids"] for row in packed])
    assert torch.equal(labels[: len(stream)], stream.masked_fill(positions[: len(stream)] == 0, -100))
    assert (labels[len(stream) :] == -100).all()


def test_a_chat_template_without_generation_marks_is_refused_and_the_named_fix_works(folder, tokenizer):
    plain = folder / "plain_template"
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        tokenizer.save_pretrained(plain)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"does not mark the assistant's turns.*data\.chat_template=<file>"):
        data(folder, "chat.jsonl", messages_field="messages", tokenizer=str(plain))
    (folder / "marked.jinja").write_text(CHAT_TEMPLATE)
    fixed = data(folder, "chat.jsonl", messages_field="messages", tokenizer=str(plain),
                 chat_template=str(folder / "marked.jinja"))
    assert_same_rows(rows(fixed.train_rows), rows(data(folder, "chat.jsonl", messages_field="messages").train_rows))


@pytest.mark.parametrize("options, error, match", [
    ({"text_field": "text", "messages_field": "messages"}, ValueError, "not both"),
    ({"tokenizer": None}, ValueError, r"data\.tokenizer=/models/x"),
    ({"text_field": "body"}, KeyError, r"data\.text_field='body' is not a field .* \['text'\]"),
    ({"files": "missing*.jsonl"}, FileNotFoundError, "set data.files"),
    ({"files": ["text.jsonl", "text.parquet"]}, ValueError, "must all be one format"),
])
def test_bad_settings_are_refused_naming_the_fix(folder, options, error, match):
    write_text_file(folder / "text.parquet", lines=120)
    with pytest.raises(error, match=match):
        data(folder, options.pop("files", "text.jsonl"), **options)


@pytest.mark.parametrize("files, options, match", [
    # a chat file read as plain text (no data.messages_field): named as chat, with the setting that reads it
    ("chat.jsonl", {}, r"holds chat conversations in its field 'messages' .* set data\.messages_field=messages "),
    # the old advice followed (data.text_field=<the chat field>): refused here, not deep inside the tokenizer
    ("chat.jsonl", {"text_field": "messages"}, r"data\.text_field='messages' holds chat conversations .* set"
                                               r" data\.messages_field=messages instead of data\.text_field"),
    ("text.jsonl", {"messages_field": "text"}, r"data\.messages_field='text' holds plain text .* set"
                                               r" data\.text_field=text instead of data\.messages_field"),
    ("text.jsonl", {"messages_field": "dialogue"}, r"'dialogue' is not a field .* no conversations; for plain text"
                                                   r" set data\.text_field=text"),
])
def test_fields_that_do_not_hold_what_they_are_set_for_are_refused_when_built(folder, files, options, match):
    """Judged from the first documents when the data module is built (the recipes: in the launching process, before
    any rank starts), never by the tokenizer failing on a list of messages."""
    with pytest.raises(KeyError, match=match) as refused:
        HFDataModule(str(folder / files), tokenizer=str(folder / "tokenizer"), seq_len=SEQ_LEN, **options)
    assert "data.text_field to" not in str(refused.value)  # no advice to read conversations as text


def test_a_missing_tokenizer_folder_is_named(folder):
    with pytest.raises(FileNotFoundError, match=rf"data\.tokenizer=.*{folder / 'no_tokenizer'} does not exist"):
        HFDataModule(str(folder / "text.jsonl"), tokenizer=str(folder / "no_tokenizer"))


@pytest.mark.parametrize("options", [{}, {"pack": False}, {"messages_field": "messages"}])
def test_streaming_yields_the_map_style_rows(folder, options):
    files = "chat.jsonl" if "messages_field" in options else "text.jsonl"
    mapped = data(folder, files, val_fraction=0.2, **options)
    streamed = data(folder, files, val_fraction=0.2, streaming=True, **options)
    assert_same_rows(rows(streamed.train_dataloader().dataset), rows(mapped.train_rows))
    assert_same_rows(rows(streamed.val_dataloader().dataset), rows(mapped.val_rows))


def replica(rank: int, replicas: int = 2):
    """A trainer whose strategy says what Lightning's sampler would get: the DP replicas, not the whole world."""
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}))


def test_streamed_rows_are_split_by_data_parallel_rank_only(folder):
    every = rows(data(folder).train_rows)
    # The two SP ranks of one group have the same DP rank: the same rows. The two DP ranks share none.
    sp_ranks = [rows(data(folder, streaming=True, trainer=replica(0)).train_dataloader().dataset) for _ in range(2)]
    assert_same_rows(sp_ranks[0], sp_ranks[1])
    dp_1 = rows(data(folder, streaming=True, trainer=replica(1)).train_dataloader().dataset)
    whole = len(every) // 2 * 2  # whole rounds only: both replicas yield equally many rows
    assert_same_rows(sp_ranks[0], every[0:whole:2])
    assert_same_rows(dp_1, every[1:whole:2])
    # DataLoader workers split a replica's share further, still in whole rounds over replicas × workers.
    loader = data(folder, streaming=True, trainer=replica(1), num_workers=2, batch_size=None).train_dataloader()
    assert_same_rows(list(loader), [every[i] for i in range(len(every) // 4 * 4) if i % 4 in (2, 3)])


def test_validation_split_is_seeded_and_holds_out_whole_documents(folder, tokenizer):
    def documents(module, split):
        kept = [row["input_ids"][row["attention_mask"].bool()] for row in rows(getattr(module, f"{split}_rows"))]
        return [tokenizer.decode(d[:-1]) for d in kept]

    split = data(folder, pack=False, val_fraction=0.25, seq_len=512)
    train, val = documents(split, "train"), documents(split, "val")
    assert 10 < len(val) < 50 and sorted(train + val) == sorted(text_documents(120))
    assert documents(data(folder, pack=False, val_fraction=0.25, seq_len=512), "val") == val  # deterministic
    assert documents(data(folder, pack=False, val_fraction=0.25, seq_len=512, seed=1), "val") != val
    write_text_jsonl(folder / "val.jsonl", lines=7, seed=5)
    given = data(folder, pack=False, val_fraction=0.25, seq_len=512, val_files=str(folder / "val.jsonl"))
    assert documents(given, "train") == text_documents(120) and documents(given, "val") == text_documents(7, seed=5)


def test_tokenising_is_cached_and_multi_process(folder):
    first = data(folder).train_rows.documents
    cached = {f["filename"]: os.stat(f["filename"]).st_mtime_ns for f in first.cache_files}
    again = data(folder).train_rows.documents
    assert {f["filename"]: os.stat(f["filename"]).st_mtime_ns for f in again.cache_files} == cached
    assert any("cache-" in name for name in cached)  # the tokenised map, not only the loaded files
    assert_same_rows(rows(data(folder, num_proc=2).train_rows), rows(data(folder).train_rows))
