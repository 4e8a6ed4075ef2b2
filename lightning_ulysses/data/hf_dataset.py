"""Training data from Hugging Face `datasets`: local json/jsonl, parquet, arrow or txt files of plain text or chat
conversations, tokenised with the model's tokenizer, as packed or padded rows of `seq_len` tokens.

- Tokenising is datasets' `map` (multi-process with `num_proc`, cached in datasets' cache: a second run over the
  same files with the same tokenizer and fields reads the cache). Plain text ends every document with the tokenizer's
  end token, so the model learns to end documents. A conversation is rendered with the tokenizer's chat template;
  only the tokens the template marks as the assistant's (`{% generation %}`) are trained on, every other label is
  -100. A template without those marks is refused: nothing else says which tokens the assistant wrote.
- `pack=True`: the documents back to back, cut every `seq_len` tokens as `PackedTokenRows` cuts a token stream, and
  packed by `pack_documents` (data/packing.py): positions restart per document, each document's first label is
  masked, attention never crosses documents; a document cut by a row boundary continues in the next row as a
  document of its own; only the last row is padded. `pack=False`: one document per row, truncated to `seq_len` (a
  warning counts them) and padded at the end with ignored labels and `attention_mask` 0 (right padding: what every
  SP size and the ring accept).
- `streaming=True` reads the files lazily and cuts rows on the fly, for corpora larger than host memory: the same
  rows as the map-style path, in file order (not shuffled).
- Every rank of a sequence-parallel group must load the same rows. Map-style rows get Lightning's distributed
  sampler over the strategy's `distributed_sampler_kwargs` (the DP group under the Ulysses strategy). Streamed rows
  are dealt round-robin over the same replicas (and each replica's DataLoader workers), in whole rounds only, so
  every replica gets equally many (one short of a row would leave the others waiting in a collective); each replica
  reads and tokenises the whole stream to know where the rows are.
- Validation: `val_fraction` of the documents, chosen by a seeded hash of each document's index (so both paths
  hold out the same documents without counting them first), or all documents of `val_files`.
"""

from __future__ import annotations

import functools
import glob
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from typing_extensions import override

from lightning_ulysses.data.packing import pack_documents
from lightning_ulysses.training.loss import IGNORE_INDEX

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
# The mark transformers looks for before it can return an assistant mask (utils/chat_template_utils.py).
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
Document = dict  # {"input_ids": [...], optional "labels": [...]}: one tokenised document


def data_files(files: Union[str, Sequence[str]]) -> tuple[list[str], str]:
    """Files matching a path, glob or list of them (in the given order, each glob sorted) and their datasets format."""
    patterns = [files] if isinstance(files, (str, Path)) else list(files)
    found = list(dict.fromkeys(f for pattern in patterns
                               for f in sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))))
    if not found:
        raise FileNotFoundError(f"no data files match {patterns}: set data.files to existing files or globs")
    formats = {FORMATS.get(Path(f).suffix.lower()) for f in found}
    if None in formats or len(formats) > 1:
        suffixes = sorted({Path(f).suffix or "(none)" for f in found})
        raise ValueError(f"data.files must all be one format, named by the extension ({', '.join(FORMATS)}); got"
                         f" {', '.join(suffixes)}")
    return found, formats.pop()


def held_out(indices: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Whether each document index is held out for validation: its seeded splitmix64 hash, as a number in [0, 1),
    is below `fraction`. Needs no count of the documents, so a stream holds out the same ones as a map."""
    with np.errstate(over="ignore"):  # the hash is arithmetic modulo 2**64
        z = np.asarray(indices, dtype=np.uint64) + np.uint64(seed + 1) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


def check_chat_template(tokenizer: Any, template: Optional[str], where: str) -> None:
    """Refuse a chat template that cannot say which tokens the assistant wrote (no `{% generation %}` marks)."""
    try:
        template = tokenizer.get_chat_template(template)
    except ValueError:
        template = None
    fix = (" Put each assistant message's content and end token inside {% generation %}...{% endgeneration %} in a"
           " copy of the template and pass that .jinja file as data.chat_template=<file>, or train on plain text"
           " with data.text_field.")
    if template is None:
        raise ValueError(f"data.messages_field needs a chat template, and the tokenizer in {where} has none.{fix}")
    if not GENERATION_MARK.search(template):
        raise ValueError(f"The chat template of {where} does not mark the assistant's turns with {{% generation %}},"
                         " so transformers cannot tell which tokens to train on (only the assistant's are; every"
                         f" other label is ignored).{fix}")


class Tokenize:
    """A batch of raw documents → `input_ids` (plus `labels` for chat) and `length`. Picklable for `num_proc`;
    datasets hashes it (the tokenizer's state, fields and template) to find its cached result."""

    def __init__(self, tokenizer: Any, text_field: str, messages_field: Optional[str], chat_template: Optional[str]):
        self.tokenizer, self.text_field = tokenizer, text_field
        self.messages_field, self.chat_template = messages_field, chat_template

    @property
    def field(self) -> str:
        return self.messages_field or self.text_field

    def __call__(self, batch: dict) -> dict:
        if self.messages_field is None:
            end = self.tokenizer.eos_token_id
            ids = [tokens if end is None or tokens[-1:] == [end] else tokens + [end]
                   for tokens in self.tokenizer(batch[self.text_field])["input_ids"]]
            return {"input_ids": ids, "length": [len(tokens) for tokens in ids]}
        out = self.tokenizer.apply_chat_template(batch[self.messages_field], chat_template=self.chat_template,
                                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        labels = [[token if trained else IGNORE_INDEX for token, trained in zip(tokens, mask)]
                  for tokens, mask in zip(out["input_ids"], out["assistant_masks"])]
        return {"input_ids": out["input_ids"], "labels": labels, "length": [len(tokens) for tokens in labels]}


def _load(files: list[str], format: str, streaming: bool, cache_dir: Optional[str], txt_sample_by: str):
    import datasets  # the finetune extra: the core package does not need it

    options = {"sample_by": txt_sample_by} if format == "text" else {}
    return datasets.load_dataset(format, data_files=files, split="train", streaming=streaming, cache_dir=cache_dir,
                                 **options)


def first_documents(files: list[str], format: str, txt_sample_by: str, count: int = 8) -> dict[str, list]:
    """The first `count` documents of the first file, column by column (datasets' streaming: nothing else is read,
    nothing is cached)."""
    raw = _load(files[:1], format, True, None, txt_sample_by)
    return next(iter(raw.iter(batch_size=count)), {name: [] for name in raw.column_names or []})


def is_conversation(value: Any) -> bool:
    """A chat conversation as `messages_field` reads it: a non-empty list of `{"role": ..., "content": ...}`."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(message, dict) and {"role", "content"} <= message.keys() for message in value))


def _check_field(documents: Mapping[str, Sequence[Any]], tokenize: Tokenize, file: str) -> None:
    """Refuse a field that is missing from `documents` (the first documents of `file`, column by column) or does not
    hold what it is set for: a chat file read as plain text is named as chat, with the `data.messages_field` that
    reads it (`data.text_field` on conversations would fail deep inside the tokenizer)."""
    first = {name: values[0] for name, values in documents.items() if len(values)}
    chats = [name for name, value in first.items() if is_conversation(value)]
    texts = [name for name, value in first.items() if isinstance(value, str)]
    chat_fix = (f"set data.messages_field={chats[0]} (chat: trains on the assistant's tokens only)" if chats else None)
    if tokenize.messages_field is None:
        field = tokenize.text_field
        if field in chats:
            raise KeyError(f"data.text_field={field!r} holds chat conversations in {file} (lists of {{role, content}}"
                           f" messages), not plain text: set data.messages_field={field} instead of data.text_field"
                           " (it trains on the assistant's tokens only).")
        if field not in documents and chats:
            raise KeyError(f"{file} holds chat conversations in its field {chats[0]!r} (lists of {{role, content}}"
                           f" messages) and no text field {field!r}: set data.messages_field={chats[0]} (chat data"
                           " trains on the assistant's tokens only).")
        if field not in documents:
            raise KeyError(f"data.text_field={field!r} is not a field of {file}: its fields are {list(documents)};"
                           f" set data.text_field to the one holding the text{f' (text: {texts})' if texts else ''}.")
        if field in first and not isinstance(first[field], str):
            raise KeyError(f"data.text_field={field!r} of {file} holds {type(first[field]).__name__} values, not text:"
                           f" {chat_fix or f'set data.text_field to the one holding the text (text: {texts})'}.")
        return
    field = tokenize.messages_field
    if field not in documents:
        fix = chat_fix or (f"it holds no conversations; for plain text set data.text_field={texts[0]} instead of"
                           " data.messages_field" if texts else "set data.messages_field to the one holding them")
        raise KeyError(f"data.messages_field={field!r} is not a field of {file}: its fields are {list(documents)};"
                       f" {fix}.")
    if field in first and isinstance(first[field], str):
        raise KeyError(f"data.messages_field={field!r} holds plain text in {file}, not conversations: set"
                       f" data.text_field={field} instead of data.messages_field.")
    if field in first and not is_conversation(first[field]):
        raise KeyError(f"data.messages_field={field!r} of {file} does not hold conversations (lists of {{\"role\":"
                       f" ..., \"content\": ...}} messages): its first value is {str(first[field])[:120]}.")


def _documents(batch: dict) -> list[Document]:
    """datasets' dict of columns → one dict per document, with its tokens (and labels)."""
    keys = [key for key in ("input_ids", "labels") if key in batch]
    return [dict(zip(keys, values)) for values in zip(*(batch[key] for key in keys))]


def _clip(document: Document, begin: int, end: Optional[int]) -> Document:
    return {key: values[begin:end] for key, values in document.items()}


def packed_row(pieces: list[Document], seq_len: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """One row of `seq_len` from the document pieces it holds (padded at the end if they are fewer tokens)."""
    return {key: value[0] for key, value in pack_documents(pieces, seq_len, pad_token_id).items()}


def padded_row(document: Document, seq_len: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """One document truncated to `seq_len` and padded at the end: ignored labels, `attention_mask` 0."""
    tokens = torch.as_tensor(document["input_ids"][:seq_len], dtype=torch.long)
    labels = torch.as_tensor(document.get("labels", document["input_ids"])[:seq_len], dtype=torch.long)
    padding = (0, seq_len - tokens.numel())
    return {"input_ids": F.pad(tokens, padding, value=pad_token_id), "labels": F.pad(labels, padding, value=IGNORE_INDEX),
            "attention_mask": F.pad(torch.ones_like(tokens), padding, value=0)}


def row_pieces(documents: Iterable[Document], seq_len: int) -> Iterator[list[Document]]:
    """The documents back to back, cut every `seq_len` tokens: the pieces of each row in turn (the last may be short)."""
    pieces, filled = [], 0
    for document in documents:
        pieces.append(document)
        filled += len(document["input_ids"])
        while filled >= seq_len:
            last, rest = pieces[-1], filled - seq_len  # `rest` tokens of the last piece go to the next row
            cut = len(last["input_ids"]) - rest
            yield pieces[:-1] + [_clip(last, 0, cut)]
            pieces, filled = ([_clip(last, cut, None)] if rest else []), rest
    if filled:
        yield pieces


class DocumentRows(Dataset):
    """Map-style rows of tokenised documents (a datasets `Dataset`): packed, as `row_pieces` cuts them, or one
    padded document per row. Only the documents' lengths are held in memory; a row reads the documents it covers."""

    def __init__(self, documents: Any, seq_len: int, pad_token_id: int, pack: bool):
        self.documents, self.seq_len, self.pad_token_id, self.pack = documents, seq_len, pad_token_id, pack
        self.lengths = np.asarray(documents["length"], dtype=np.int64)
        self.ends = np.cumsum(self.lengths)

    def __len__(self) -> int:
        if not self.pack:
            return len(self.lengths)
        return -(-int(self.ends[-1]) // self.seq_len) if len(self.ends) else 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not self.pack:
            return padded_row(_documents(self.documents[index : index + 1])[0], self.seq_len, self.pad_token_id)
        start = index * self.seq_len
        stop = min(start + self.seq_len, int(self.ends[-1]))
        first, last = (int(i) for i in np.searchsorted(self.ends, [start, stop - 1], side="right"))
        documents = _documents(self.documents[first : last + 1])
        begins = self.ends[first : last + 1] - self.lengths[first : last + 1]
        pieces = [_clip(document, max(start - begin, 0), stop - begin) for document, begin in zip(documents, begins)]
        return packed_row(pieces, self.seq_len, self.pad_token_id)


class StreamedDocuments:
    """The tokenised documents of files read lazily (datasets' streaming): all, or only those `held_out` selects
    (`keep_held_out=True`: the validation documents) or only the others."""

    def __init__(self, load: Callable[[], Any], tokenize: Tokenize, files: list[str],
                 split: Optional[tuple[float, int]] = None, keep_held_out: bool = False, chunk: int = 256):
        self.load, self.tokenize, self.files = load, tokenize, files
        self.split, self.keep_held_out, self.chunk = split, keep_held_out, chunk

    def __iter__(self) -> Iterator[Document]:
        raw = self.load()
        start = 0
        for batch in raw.iter(batch_size=self.chunk):
            if start == 0:
                _check_field(batch, self.tokenize, self.files[0])
            count = len(batch[self.tokenize.field])
            if self.split is not None:
                keep = held_out(np.arange(start, start + count), *self.split) == self.keep_held_out
                batch = {key: [value for value, kept in zip(values, keep) if kept] for key, values in batch.items()}
            start += count
            if batch[self.tokenize.field]:
                yield from _documents(self.tokenize(batch))


class StreamingRows(IterableDataset):
    """Rows cut on the fly from streamed documents, dealt round-robin over `replicas` (data-parallel ranks) and each
    one's DataLoader workers; only whole rounds are dealt, so every replica yields equally many rows."""

    def __init__(self, documents: Iterable[Document], seq_len: int, pad_token_id: int, pack: bool,
                 replicas: int = 1, rank: int = 0):
        self.documents, self.seq_len, self.pad_token_id, self.pack = documents, seq_len, pad_token_id, pack
        self.replicas, self.rank = replicas, rank

    def _rows(self) -> Iterator[list[Document]]:
        if self.pack:
            yield from row_pieces(self.documents, self.seq_len)
            return
        warned = False
        for document in self.documents:
            if not warned and len(document["input_ids"]) > self.seq_len:
                warnings.warn(f"documents longer than data.seq_len={self.seq_len} are truncated (pack=false);"
                              " data.pack=true trains on all their tokens")
                warned = True
            yield [document]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = get_worker_info()
        workers, worker_id = (1, 0) if worker is None else (worker.num_workers, worker.id)
        stride, mine = self.replicas * workers, self.rank * workers + worker_id
        for index, pieces in enumerate(self._rows()):
            if index % stride == mine:
                own = pieces  # built only once the round is whole
            if index % stride == stride - 1:
                yield (packed_row(own, self.seq_len, self.pad_token_id) if self.pack
                       else padded_row(own[0], self.seq_len, self.pad_token_id))


def _replicas(trainer: Any) -> tuple[int, int]:
    """(number, index) of the data-parallel replica this rank loads for: what Lightning's sampler gets."""
    kwargs = getattr(getattr(trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
    return kwargs.get("num_replicas", 1), kwargs.get("rank", 0)


class HFDataModule(L.LightningDataModule):
    """Local data files through Hugging Face `datasets` (see the module docstring). Plain text is read from
    `text_field` (default "text"), chat conversations (lists of `{role, content}`) from `messages_field`; set one.
    `tokenizer` is a local folder (nothing is downloaded); `chat_template` a .jinja file replacing its template.
    `txt_sample_by` says what one document of a .txt file is: a line, a paragraph or the whole file."""

    def __init__(self, files: Union[str, Sequence[str]], tokenizer: Optional[str] = None, seq_len: int = 4096,
                 batch_size: int = 1, text_field: Optional[str] = None, messages_field: Optional[str] = None,
                 pack: bool = True, streaming: bool = False, val_fraction: float = 0.0,
                 val_files: Union[str, Sequence[str], None] = None, seed: int = 0, num_proc: Optional[int] = None,
                 num_workers: int = 0, cache_dir: Optional[str] = None, chat_template: Optional[str] = None,
                 txt_sample_by: str = "line"):
        super().__init__()
        if tokenizer is None:
            raise ValueError("data.tokenizer is not set: name a local folder with a Hugging Face tokenizer"
                             " (data.tokenizer=/models/x); with model=hf_pretrained it is model.pretrained's folder.")
        if text_field is not None and messages_field is not None:
            raise ValueError("set one of data.text_field (plain text) and data.messages_field (chat conversations),"
                             " not both")
        if seq_len < 1 or not 0 <= val_fraction < 1 or seed < 0:
            raise ValueError(f"need seq_len >= 1, 0 <= val_fraction < 1 and seed >= 0; got {seq_len}, {val_fraction},"
                             f" {seed}")
        from transformers import AutoTokenizer

        self.files = data_files(files)
        self.val_files = None if val_files is None else data_files(val_files)
        if not Path(tokenizer).expanduser().is_dir():
            raise FileNotFoundError(f"data.tokenizer={tokenizer}: the folder {Path(tokenizer).expanduser().resolve()}"
                                    " does not exist; name a local folder with a Hugging Face tokenizer (with"
                                    " model=hf_pretrained it is model.pretrained's folder).")
        loaded = AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()), local_files_only=True)
        template = None if chat_template is None else Path(chat_template).expanduser().read_text()
        if messages_field is not None:
            check_chat_template(loaded, template, chat_template or tokenizer)
        self.tokenize = Tokenize(loaded, text_field or "text", messages_field, template)
        # Here, in the process that builds the data module (the recipes' launching one, before any rank starts),
        # rather than when the ranks tokenise.
        _check_field(first_documents(*self.files, txt_sample_by), self.tokenize, self.files[0][0])
        self.pad_token_id = next(t for t in (loaded.pad_token_id, loaded.eos_token_id, 0) if t is not None)
        self.seq_len, self.batch_size, self.pack, self.streaming = seq_len, batch_size, pack, streaming
        self.val_fraction, self.seed, self.num_proc, self.num_workers = val_fraction, seed, num_proc, num_workers
        self.cache_dir, self.txt_sample_by = cache_dir, txt_sample_by
        self.train_rows: Optional[Dataset] = None
        self.val_rows: Optional[Dataset] = None

    def _tokenized(self, files: list[str], format: str):
        raw = _load(files, format, False, self.cache_dir, self.txt_sample_by)
        _check_field(raw[:8], self.tokenize, files[0])
        return raw.map(self.tokenize, batched=True, num_proc=self.num_proc, remove_columns=raw.column_names,
                       desc="Tokenizing")

    def _rows(self, documents: Any) -> Optional[DocumentRows]:
        return DocumentRows(documents, self.seq_len, self.pad_token_id, self.pack) if len(documents) else None

    @override
    def prepare_data(self) -> None:
        # Local rank 0 of each node tokenises into datasets' cache; setup() on every rank then reads it.
        if not self.streaming:
            for files in filter(None, (self.files, self.val_files)):
                self._tokenized(*files)

    @override
    def setup(self, stage: str) -> None:
        if self.streaming:
            return
        documents = self._tokenized(*self.files)
        if self.val_files is not None:
            train, val = documents, self._tokenized(*self.val_files)
        else:
            held = held_out(np.arange(len(documents)), self.val_fraction, self.seed)
            train, val = documents.select(np.flatnonzero(~held)), documents.select(np.flatnonzero(held))
        self.train_rows, self.val_rows = self._rows(train), self._rows(val)
        if self.train_rows is None:
            raise ValueError(f"no training documents in {self.files[0]}: every document was held out (val_fraction)")
        if not self.pack:
            longer = sum(int((rows.lengths > self.seq_len).sum()) for rows in (self.train_rows, self.val_rows) if rows)
            if longer:
                rank_zero_warn(f"{longer} of {len(documents)} documents are longer than data.seq_len={self.seq_len} and"
                               " are truncated (pack=false); data.pack=true trains on all their tokens")

    def _stream(self, validation: bool) -> StreamingRows:
        files = self.val_files if validation and self.val_files is not None else self.files
        split = None if self.val_files is not None else (self.val_fraction, self.seed)
        load = functools.partial(_load, *files, True, self.cache_dir, self.txt_sample_by)  # picklable for workers
        documents = StreamedDocuments(load, self.tokenize, files[0], split, keep_held_out=validation)
        return StreamingRows(documents, self.seq_len, self.pad_token_id, self.pack, *_replicas(self.trainer))

    @override
    def train_dataloader(self) -> DataLoader:
        if self.streaming:
            return DataLoader(self._stream(validation=False), batch_size=self.batch_size, num_workers=self.num_workers)
        # Lightning swaps the shuffling sampler for a DistributedSampler over the strategy's DP replicas.
        return DataLoader(self.train_rows, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    @override
    def val_dataloader(self):
        if self.streaming:
            if self.val_files is None and self.val_fraction == 0:
                return []
            return DataLoader(self._stream(validation=True), batch_size=self.batch_size, num_workers=self.num_workers)
        return [] if self.val_rows is None else DataLoader(self.val_rows, batch_size=self.batch_size,
                                                            num_workers=self.num_workers)
