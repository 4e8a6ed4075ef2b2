"""Worker for test_review_regressions.py (world 2): what a rank saw in three situations found in review.

- `SequenceParallel(SumMetric())` counting tokens in `validate`, with and without `sequence_parallel_in_evaluation`,
  while the step logs whole-row values (the model's loss, the strategy's `loss_function`, a `SequenceParallel`
  metric's batch value, through `log` and `log_dict`); a loss written by hand on the logits logged too where rows are
  whole, and alone where they are sharded (refused);
- `ThroughputCallback` at SP 1 × DP 2 on rows of 16 and 12 tokens (DP ranks of different lengths in one step);
- `sequence_outputs(..., "last")` on a 15-token row that the sharder pads to 16 (no attention mask).
"""

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
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
    def __init__(self, log_exact: bool = True, log_hand_written: bool = False):
        super().__init__(2)
        self.tokens = SequenceParallel(SumMetric())
        self.batch_tokens = SequenceParallel(SumMetric())  # logged through its forward's batch value
        self.log_exact, self.log_hand_written = log_exact, log_hand_written

    def validation_step(self, batch, batch_idx):
        self.tokens.update(torch.ones_like(batch["input_ids"], dtype=torch.float32))
        inputs = {key: value for key, value in batch.items() if key != "sample_index"}
        outputs = self.model(**inputs)
        if self.log_exact:  # whole-row values, the same on every SP rank: never refused
            self.log("val_loss", outputs.loss, sync_dist=True)
            self.log_dict({"val_loss_function": self.trainer.strategy.loss_function(outputs.logits, batch["labels"]),
                           "val_tokens_in_batch": self.batch_tokens(torch.ones_like(batch["input_ids"], dtype=torch.float32))})
            # a number of this rank's own, logged on purpose (seconds, bytes): Python's, never compared
            self.log("val_rank_number", float(self.global_rank), sync_dist=False)
        if self.log_hand_written:  # a user's own loss on this rank's logits
            logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
            self.log("val_hand_written", F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)),
                     sync_dist=True)

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
        # On whole rows the hand-written loss is exact (logged beside the exact values)
        module = TokenCounting(log_hand_written=not sequence_parallel_in_evaluation)
        strategy = lightning_ulysses.UlyssesDeepSpeedStrategy(
            sequence_parallel_size=2, stage=2, sequence_parallel_in_evaluation=sequence_parallel_in_evaluation,
            check_batches="every")
        trainer = L.Trainer(strategy=strategy, **TRAINER)
        loader = DataLoader(UnevenlyMaskedTokens(4, 16), batch_size=2, collate_fn=collate)  # 64 tokens in all
        logged = trainer.validate(module, loader, verbose=False)[0]
        out[f"counted_{sequence_parallel_in_evaluation}"] = module.counted
        out[f"logged_{sequence_parallel_in_evaluation}"] = logged
    # The same hand-written loss on sharded rows: refused after the first step, on both ranks.
    trainer = L.Trainer(strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=2, stage=2),
                        **TRAINER)
    try:
        trainer.validate(TokenCounting(log_exact=False, log_hand_written=True),
                         DataLoader(UnevenlyMaskedTokens(4, 16), batch_size=2, collate_fn=collate), verbose=False)
        out["hand_written_refusal"] = None
    except RuntimeError as refused:
        out["hand_written_refusal"] = str(refused)

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
