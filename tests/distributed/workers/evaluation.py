"""Worker: SP-aware metrics and predict outputs against the unsharded model, without Lightning.

World 8: SP 2 × DP 4 and SP 4 × DP 2. Each DP group evaluates different samples; every rank saves what it
computed, the test compares with single-process values over all samples.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torchmetrics.classification import MulticlassAccuracy

from lightning_ulysses import SequenceSharder, prepare_hf_model
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.integration.inference import sequence_outputs
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from lightning_ulysses.training.metrics import NextTokenAccuracy, Perplexity, SequenceParallel, TokenCrossEntropy
from tests.distributed.common import VOCAB, UnevenlyMaskedTokens, collate, tiny_llama

SEQ_LEN, BATCH, BATCHES = 16, 2, 2


def samples_of(dp_rank: int, dp_size: int) -> list[list[int]]:
    """Batches of sample indices of one DP rank (disjoint across DP ranks)."""
    return [[dp_size * BATCH * b + dp_rank * BATCH + i for i in range(BATCH)] for b in range(BATCHES)]


def is_padded(indices: list[int]) -> bool:
    """Row 0 of these batches ends with 3 padding tokens (labels ignored, attention mask 0)."""
    return indices[0] % 4 == 0


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    if not dist.is_initialized():  # a part of a shared launch (workers/parts.py) may find it set up
        dist.init_process_group("gloo")
    dataset = UnevenlyMaskedTokens(1000, SEQ_LEN)
    output = {}
    for sp in spec["sequence_parallel_sizes"]:
        groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp))
        group = groups.sequence_parallel_group
        model = tiny_llama(1)
        slot = BatchRowsSlot()  # the whole rows the sharder publishes (positions, padding, unpadded length)
        loss = SequenceParallelCausalLMLoss(group, 1.0, batch_rows=slot)
        prepared = prepare_hf_model(model, group, loss)
        sharder = SequenceSharder(sp, groups.sequence_parallel_rank, batch_rows=slot)
        metrics = {"loss": TokenCrossEntropy(), "perplexity": Perplexity(), "accuracy": NextTokenAccuracy()}
        wrapped = SequenceParallel(MulticlassAccuracy(num_classes=VOCAB, ignore_index=-100, average="micro"))
        # The same, called (`forward`): each batch's value, then their accumulation
        called = {"loss": TokenCrossEntropy(), "perplexity": Perplexity(), "accuracy": NextTokenAccuracy(),
                  "wrapped_accuracy": SequenceParallel(MulticlassAccuracy(num_classes=VOCAB, ignore_index=-100,
                                                                          average="micro"))}
        for metric in [wrapped, *metrics.values(), *called.values()]:  # as the strategy binds them: labels shifted
            metric.bind_parallel_groups(groups)  # across the SP group's shards
        predictions, batch_values = [], []
        for indices in samples_of(groups.data_parallel_rank, groups.data_parallel_world_size):
            batch = collate([dataset[i] for i in indices])
            batch.pop("sample_index")
            if is_padded(indices):  # a right-padded batch: "last" must find the real end of each row
                batch["attention_mask"] = torch.ones_like(batch["input_ids"])
                batch["attention_mask"][0, -3:] = 0
                batch["labels"][0, -3:] = -100
            shard = sharder(batch)
            with torch.no_grad():
                logits = model(**shard).logits
            for metric in metrics.values():
                metric.update(logits, shard["labels"])
            wrapped.update(logits.argmax(-1), loss.targets(shard["labels"]))  # targets aligned with the logits
            batch_values.append({name: metric(logits.argmax(-1), loss.targets(shard["labels"])).item()
                                 if name == "wrapped_accuracy" else metric(logits, shard["labels"]).item()
                                 for name, metric in called.items()})
            predictions.append({
                "indices": indices,
                "padded": "attention_mask" in batch,
                "last": sequence_outputs(logits, "last", group, attention_mask=shard.get("attention_mask")),
                "log_probs": sequence_outputs(logits, "log_probs", group, labels=shard["labels"]),
                "full": sequence_outputs(logits, "full", group),
            })
        output[sp] = {
            "metrics": {name: metric.compute().item() for name, metric in metrics.items()},
            "wrapped_accuracy": wrapped.compute().item(),
            "batch_values": batch_values,
            "called": {name: metric.compute().item() for name, metric in called.items()},
            "predictions": predictions,
        }
        prepared.restore()
    torch.save(output, Path(sys.argv[2]) / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
