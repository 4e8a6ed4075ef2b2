"""Worker for test_review_regressions.py (world 2): what a rank saw in three situations found in review.

- `SequenceParallel(SumMetric())` counting tokens in `validate`, with and without `sequence_parallel_in_evaluation`;
- `ThroughputCallback` at SP 1 × DP 2 on rows of 16 and 12 tokens (DP ranks of different lengths in one step);
- `sequence_outputs(..., "last")` on a 15-token row that the sharder pads to 16 (no attention mask).
"""

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torchmetrics.aggregation import SumMetric

import lightning_ulysses
from lightning_ulysses import SequenceSharder, prepare_hf_model
from lightning_ulysses.integration.callbacks import ThroughputCallback, model_flops_per_sequence
from lightning_ulysses.integration.inference import sequence_outputs
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.metrics import SequenceParallel
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate, tiny_llama

TRAINER = {"accelerator": "cpu", "devices": 2, "precision": "32-true", "logger": False, "enable_progress_bar": False,
           "enable_model_summary": False, "enable_checkpointing": False}


class TokenCounting(CausalLM):
    def __init__(self):
        super().__init__(2)
        self.tokens = SequenceParallel(SumMetric())

    def validation_step(self, batch, batch_idx):
        self.tokens.update(torch.ones_like(batch["input_ids"], dtype=torch.float32))

    def on_validation_epoch_end(self):
        self.counted = self.tokens.compute().item()
        self.tokens.reset()


class StepRecorder(ThroughputCallback):
    def __init__(self):
        super().__init__(peak_flops=1e12)
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        length = batch["input_ids"].size(1)
        self.steps.append({"length": length, "flops": self.last_metrics["flops"],
                           "own_flops": model_flops_per_sequence(self.model_shape, length)})


def main():
    workdir = Path(sys.argv[2])
    out = {}
    for sequence_parallel_in_evaluation in (True, False):
        module = TokenCounting()
        strategy = lightning_ulysses.UlyssesDeepSpeedStrategy(
            sequence_parallel_size=2, stage=2, sequence_parallel_in_evaluation=sequence_parallel_in_evaluation)
        trainer = L.Trainer(strategy=strategy, **TRAINER)
        loader = DataLoader(UnevenlyMaskedTokens(4, 16), batch_size=2, collate_fn=collate)  # 64 tokens in all
        trainer.validate(module, loader, verbose=False)
        out[f"counted_{sequence_parallel_in_evaluation}"] = module.counted

    recorder = StepRecorder()
    trainer = L.Trainer(strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=1, stage=2),
                        max_steps=4, callbacks=[recorder], **TRAINER)
    rows = UnevenlyMaskedTokens(8, 16, odd_rows_shorter_by=4)
    trainer.fit(CausalLM(2), DataLoader(rows, batch_size=1, collate_fn=collate))
    out["throughput_steps"] = recorder.steps

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), 2))
    input_ids = torch.randint(0, 60, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tiny_llama(2)(input_ids=input_ids).logits[:, -1]
        model = tiny_llama(2)
        prepare_hf_model(model, groups.sequence_parallel_group)
        sharder = SequenceSharder(2, groups.sequence_parallel_rank)
        shard = sharder({"input_ids": input_ids})
        last = sequence_outputs(model(**shard).logits, "last", groups.sequence_parallel_group,
                                sequence_length=sharder.unpadded_length)
    out["unpadded_length"] = sharder.unpadded_length
    out["last_error"] = (last - expected).abs().max().item()
    groups.release()
    torch.save(out, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
