"""Worker for test_value_check.py: training steps whose loss and logged tensors are compared over the SP group.

Each case fits `LoggingSteps` (the test's CausalLM, logging as its case says) with UlyssesDeepSpeedStrategy (ZeRO-2:
the module's parameters stay whole, so "no optimizer step" reads as "the weights as built") and records what the
strategy said, what reached the logger, and whether any weight moved.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader
from torchmetrics.aggregation import MeanMetric

import lightning_ulysses
from lightning_ulysses.training.metrics import NextTokenAccuracy, SequenceParallel, TokenCrossEntropy
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate

STEPS, BATCH_SIZE, SEQ_LEN = 2, 2, 16


class RecordingLogger(Logger):
    """What Lightning hands a logger, on every rank (a real logger writes rank 0's)."""

    def __init__(self):
        super().__init__()
        self.logged: list[dict] = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.logged.append({key: float(value) for key, value in metrics.items()})

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def agreement(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The issue's shard-local value: how often the arg-max prediction is the input token, over this rank's tokens."""
    return (logits.argmax(-1) == input_ids).float().mean()


class LoggingSteps(CausalLM):
    """`logs`: "shard" (`train/agree`, of this rank's shard alone), "whole" (values of the whole rows: the model's
    loss, the strategy's loss_function, our metrics' and a SequenceParallel metric's batch values, returned and as
    the metric objects, and a Python number),
    "rank0" (`train/only_rank0`, logged on SP rank 0 only). `loss`: "model" (model(**batch).loss) or "hand_written"
    (cross-entropy of this rank's logits). `manual`: manual optimization (`manual_backward`, `optimizer.step()`)."""

    def __init__(self, logs=(), loss="model", manual=False):
        super().__init__(2)
        self.logs, self.loss_form = tuple(logs), loss
        self.automatic_optimization = not manual
        self.token_loss, self.accuracy = TokenCrossEntropy(), NextTokenAccuracy()
        self.mean_token = SequenceParallel(MeanMetric())

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        if "shard" in self.logs:
            self.log("train/agree", agreement(out.logits, batch["input_ids"]))
        if "whole" in self.logs:
            self.log("train/loss", out.loss)
            self.log_dict({"train/loss_function": self.trainer.strategy.loss_function(out.logits, batch["labels"]),
                           "train/token_ce": self.token_loss(out.logits.detach(), batch["labels"]),
                           "train/accuracy": self.accuracy(out.logits.detach(), batch["labels"])})
            self.log("train/mean_token", self.mean_token(batch["input_ids"].float()))
            # the metric objects themselves: Lightning logs their last batch value on step
            self.log_dict({"train/token_ce_metric": self.token_loss, "train/mean_token_metric": self.mean_token})
            self.log("train/rank", float(self.global_rank))  # a Python number, per rank on purpose
            # more values than one gathered row carries (logged_values._SLOTS): the ranks exchange their full lists
            self.log_dict({f"train/loss_times_{i}": out.loss.detach() * i for i in range(32)})
        if "rank0" in self.logs and self.trainer.strategy.sequence_parallel_rank == 0:
            self.log("train/only_rank0", torch.tensor(1.0))
        if self.loss_form == "hand_written":
            logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
        else:
            loss = out.loss
        self.records.append({"loss": loss.detach().item(), "sample_index": batch["sample_index"].tolist()})
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.records[-1]["stepped"] = True
        return None


def run_case(case: dict, world_size: int) -> dict:
    module = LoggingSteps(case.get("logs", ()), case.get("loss", "model"), case.get("manual", False))
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    logger = RecordingLogger()
    strategy = lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=case["sp"], stage=2,
                                                          **case.get("strategy_kwargs", {}))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true", logger=logger,
                        log_every_n_steps=1, max_steps=STEPS, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    dataset = UnevenlyMaskedTokens(BATCH_SIZE * STEPS * (world_size // case["sp"]), SEQ_LEN)
    refusal = None
    try:
        trainer.fit(module, DataLoader(dataset, batch_size=BATCH_SIZE, collate_fn=collate))
    except RuntimeError as error:
        refusal = str(error)
    return {"refusal": refusal, "records": module.records, "logged": logger.logged,
            "weights_unchanged": all(torch.equal(p.detach(), before[name])
                                     for name, p in module.model.named_parameters()),
            "sequence_parallel_rank": strategy.sequence_parallel_rank}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    world_size = int(spec["world_size"])
    results = {case["name"]: run_case(case, world_size) for case in spec["cases"]}
    torch.save(results, Path(sys.argv[2]) / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
