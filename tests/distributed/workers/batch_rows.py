"""Worker: whole rows described once per batch by the sharder (attention/rows.py) instead of gathered per layer.

World 4. First a Trainer (SP 2 × DP 2, ZeRO-2, 4-layer native GPT, packed rows) counts the gather path and
`DocumentMask.from_rows` inside its training steps: the strategy's sharder and attention share one slot. Then three
layouts `[sequence_parallel_size, ring_size]`: SP 2 (two groups inside the world), SP 4, and SP 4 =
Ulysses 2 × ring 2 (zig-zag shards). On each:
- the `DocumentMask` the sharder's published rows give equals the one the gather path builds from the shards, for
  plain, packed, right-padded, left-padded and packed + padded rows (with and without the padding);
- with a ring, the refusals (packed rows, left padding) come from the published rows, with the gather path's
  message, on every rank, and right padding is accepted.
At SP 2, a 4-layer native GPT and a 4-layer HF Llama run one forward + backward on packed, padded rows with and
without the published rows (the GPT also under activation checkpointing, whose recompute detaches its inputs):
the calls of the gather path, the all-gathers, `DocumentMask.from_rows` calls and host syncs are counted, and loss
and gradients of both paths are compared.
"""

import json
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import lightning_ulysses
from lightning_ulysses import SequenceSharder, UlyssesAttention, prepare_hf_model
from lightning_ulysses.attention import core
from lightning_ulysses.attention.documents import DocumentMask
from lightning_ulysses.attention.rows import BatchRows, BatchRowsSlot
from lightning_ulysses.memory import MemoryOptions, apply_memory_options
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.common import VOCAB, CausalLM, collate, tiny_gpt, tiny_llama
from tests.distributed.packed import PackedDocuments

SEQ_LEN = 16
NUM_LAYERS = 4


def rows(kind: str) -> dict:
    """A batch of two rows of SEQ_LEN tokens: `plain` (no positions, no mask), `packed` (positions restarting inside
    both rows, documents crossing shard boundaries), `right_padded`, `left_padded`, `packed_padded` (both), and
    `packed_padded_uneven`: one token shorter, so that the sharder pads the rows to a multiple of the SP size."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=generator)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    if "packed" in kind:
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                                             for lengths in ([5, 7, 4], [3, 9, 1, 3])])
    mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    if kind in ("right_padded", "packed_padded", "packed_padded_uneven"):
        mask[0, -3:] = 0
        mask[1, -6:] = 0
    if kind in ("left_padded", "packed_padded", "packed_padded_uneven"):
        mask[1, :2] = 0
    if "padded" in kind:
        batch["attention_mask"] = mask
        batch["labels"] = input_ids.masked_fill(mask == 0, -100)
    if kind.endswith("uneven"):
        batch = {key: value[:, :-1] for key, value in batch.items()}
    return batch


ROW_KINDS = ("plain", "packed", "right_padded", "left_padded", "packed_padded", "packed_padded_uneven")


def same_documents(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None

    def equal(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return equal(a.document_ids, b.document_ids) and equal(a.real_tokens, b.real_tokens)


def check_descriptions(groups, results):
    """Published rows vs the gather path, per row kind, with and without the padding mask."""
    sp, rank = groups.sequence_parallel_world_size, groups.sequence_parallel_rank
    for kind in ROW_KINDS:
        slot = BatchRowsSlot()
        shard = SequenceSharder(sp, rank, ring_size=groups.ring_size, batch_rows=slot)(rows(kind))
        mask = shard.get("attention_mask")
        for with_padding in (False, True) if mask is not None else (False,):
            padding = mask if with_padding else None
            described, published = slot.documents_for(shard["position_ids"], padding)
            gathered_positions = core._whole_rows(shard["position_ids"], groups.ulysses_group, groups.ring_group)
            gathered_padding = None if padding is None else core._whole_rows(
                padding.bool(), groups.ulysses_group, groups.ring_group)
            gathered = DocumentMask.from_rows(2, gathered_positions, gathered_padding)
            name = f"{kind}{'_with_padding' if with_padding else ''}"
            results[f"described_{name}"] = described
            results[f"same_documents_{name}"] = same_documents(published, gathered)
            # Guard against comparing two empty descriptions: the rows really hold documents / padding where named.
            results[f"has_documents_{name}"] = gathered is not None and gathered.document_ids is not None
            results[f"has_padding_{name}"] = gathered is not None and gathered.real_tokens is not None
        # Tensors that are not the sharded batch's own are not described: the attention gathers for them.
        results[f"clone_described_{kind}"] = slot.documents_for(shard["position_ids"].clone(), mask)[0]
        results[f"detached_described_{kind}"] = slot.documents_for(shard["position_ids"].detach(), mask)[0]
        modified = shard["position_ids"].clone()
        slot.rows = BatchRows(2, None, None, modified, None)
        modified.add_(0)  # an in-place change after publication: the recorded rows no longer describe it
        results[f"modified_described_{kind}"] = slot.documents_for(modified, None)[0]


@contextmanager
def counting():
    """Counts, while active: the gather path's `_whole_rows` calls, `dist.all_gather` calls, `DocumentMask.from_rows`
    calls and host syncs (`aten._local_scalar_dense`: `.item()`, `bool()`, `int()` of a tensor)."""
    counts = Counter()
    originals = core._whole_rows, dist.all_gather, DocumentMask.from_rows.__func__

    def whole_rows(*args, **kwargs):
        counts["whole_rows"] += 1
        return originals[0](*args, **kwargs)

    def all_gather(*args, **kwargs):
        counts["all_gather"] += 1
        return originals[1](*args, **kwargs)

    def from_rows(cls, *args, **kwargs):
        counts["from_rows"] += 1
        return originals[2](cls, *args, **kwargs)

    class HostSyncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                counts["host_syncs"] += 1
            return func(*args, **(kwargs or {}))

    core._whole_rows, dist.all_gather = whole_rows, all_gather
    DocumentMask.from_rows = classmethod(from_rows)
    try:
        with HostSyncs():
            yield counts
    finally:
        core._whole_rows, dist.all_gather = originals[0], originals[1]
        DocumentMask.from_rows = classmethod(originals[2])


def check_ring_refusals(groups, results):
    """With a ring, packed rows and left padding are refused from the published rows (no gather), on every rank."""
    sp, rank = groups.sequence_parallel_world_size, groups.sequence_parallel_rank
    query = torch.randn(2, 4, SEQ_LEN // sp, 8)
    for kind in ("packed", "left_padded", "right_padded"):
        messages = {}
        for path in ("gathered", "described"):
            slot = BatchRowsSlot()
            shard = SequenceSharder(sp, rank, ring_size=groups.ring_size, batch_rows=slot)(rows(kind))
            attention = UlyssesAttention()
            attention.bind_parallel_groups(groups)
            attention.bind_batch_rows(slot if path == "described" else None)
            with counting() as counts:
                try:
                    attention(query, query, query, shard["position_ids"], shard.get("attention_mask"))
                    messages[path] = None
                except NotImplementedError as error:
                    messages[path] = str(error)
            results[f"ring_{kind}_{path}_whole_rows"] = counts["whole_rows"]
        results[f"ring_{kind}_error"] = messages["described"]
        results[f"ring_{kind}_same_error"] = messages["described"] == messages["gathered"]


def model_pass(kind, groups, batch, slot, checkpointing: bool):
    """One forward + backward of a fresh 4-layer model at this SP size; (counts, loss, gradients)."""
    group = groups.sequence_parallel_group
    # The loss reads the unpadded length of the rows from the published rows, also where the attention is left to
    # gather (slot None): the sharder publishes into `published`, the attention reads `slot`.
    published = slot if slot is not None else BatchRowsSlot()
    loss_function = SequenceParallelCausalLMLoss(group, gradient_scale=1.0, batch_rows=published)
    if kind == "llama":
        model = tiny_llama(2, num_layers=NUM_LAYERS)
        prepare_hf_model(model, group, loss_function, batch_rows=slot)
    else:
        model = tiny_gpt(2, num_layers=NUM_LAYERS)
        for attention in model.modules():
            if isinstance(attention, UlyssesAttention):
                attention.bind(group)
                attention.bind_batch_rows(slot)
        model.loss_function = loss_function
    if checkpointing:
        apply_memory_options(model, MemoryOptions(activation_checkpointing=True))
    shard = SequenceSharder(groups.sequence_parallel_world_size, groups.sequence_parallel_rank,
                            batch_rows=published)(batch)
    with counting() as forward:
        loss = model(**shard).loss
    with counting() as backward:
        loss.backward()
    return forward, backward, loss.detach(), [p.grad.clone() for p in model.parameters()]


def check_counts(groups, results):
    batch = rows("packed_padded")
    for kind, checkpointing in (("gpt", False), ("gpt", True), ("llama", False)):
        name = f"{kind}{'_checkpointed' if checkpointing else ''}"
        gathered = model_pass(kind, groups, batch, None, checkpointing)
        described = model_pass(kind, groups, batch, BatchRowsSlot(), checkpointing)
        for path, (forward, backward, _, _) in (("gathered", gathered), ("described", described)):
            for counter in ("whole_rows", "all_gather", "from_rows", "host_syncs"):
                results[f"{name}_{path}_forward_{counter}"] = forward[counter]
                results[f"{name}_{path}_backward_{counter}"] = backward[counter]
        results[f"{name}_loss_difference"] = (gathered[2] - described[2]).abs().item()
        results[f"{name}_grad_difference"] = max((a - b).abs().max().item() for a, b in zip(gathered[3], described[3]))


class CountingCausalLM(CausalLM):
    """Counts the gather path and `from_rows` inside every training step (forward and backward)."""

    def __init__(self):
        super().__init__(num_key_value_heads=2, kind="gpt")
        self.model = tiny_gpt(2, num_layers=NUM_LAYERS)
        self.step_counts = []

    def on_train_batch_start(self, batch, batch_idx):
        self._counting = counting()
        self.step_counts.append(self._counting.__enter__())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._counting.__exit__(None, None, None)


def check_strategy(results, world_size):
    module = CountingCausalLM()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(2, stage=2),
        max_steps=2, precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    dataset = PackedDocuments(2 * 2 * (world_size // 2), SEQ_LEN)
    trainer.fit(module, DataLoader(dataset, batch_size=2, collate_fn=collate))
    results["strategy_steps"] = [dict(counts) for counts in module.step_counts]
    results["strategy_rows_released"] = trainer.strategy.runtime.parallel.batch_rows.rows is None


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    output = {}
    check_strategy(output, 4)  # first: the Trainer's strategy sets up the process group the checks below share
    for sp, ring in spec["layouts"]:
        groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp, ring_size=ring))
        results = {}
        check_descriptions(groups, results)
        if ring > 1:
            check_ring_refusals(groups, results)
        if (sp, ring) == (2, 1):
            check_counts(groups, results)
        output[f"sp{sp}_ring{ring}"] = results
        groups.release()
    torch.save(output, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
