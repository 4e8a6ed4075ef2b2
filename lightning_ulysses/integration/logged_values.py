"""Values an evaluation step logs, compared over the SP group: one of this rank's shard alone is refused.

In training a loss of the shard alone is refused at its backward (`training.loss.refuse_shard_local_loss`, which
reads the autograd graph). Evaluation has no graph: a `validation_step` that writes
`cross_entropy(logits[:, :-1], batch["labels"][:, 1:])` and `self.log("val_loss", loss, sync_dist=True)` logs the
mean of per-shard losses (the targets at shard boundaries dropped, every shard weighted alike), close to the whole
rows' loss and wrong, with nothing said.

What tells the two apart without a graph: every rank of an SP group holds the same rows, so every value of the
whole rows (the strategy's `loss_function`, `model(**batch).loss`, a `SequenceParallel` metric's batch value) is
the same on all of them, bit for bit (all of them end in the same all-reduce or gather); a value of one shard
differs from its neighbours'. `ShardLocalLogCheck` records what the step passes to `LightningModule.log` (and
`log_dict`, which calls it) and compares it over the SP group after the step, before Lightning hands anything to a
logger, a progress bar or a checkpoint callback; a value that differs is refused on every rank alike (all compare
the same gathered values), naming the fix.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist

from lightning_ulysses.batch.check import FIRST_BATCHES_CHECKED, CheckBatches, check_batches_option
from lightning_ulysses.parallel.layout import SequenceParallelGroups

# Two whole-row values are the same all-reduced number on every SP rank; this only forgives a last-bit difference an
# all-reduce algorithm might leave between ranks. Shard values differ in their leading digits.
_RELATIVE_TOLERANCE = 1e-6


def _scalar(value: Any) -> float | None:
    """The one-number tensor `self.log` was given, or None: a torchmetrics `Metric` (whose value Lightning computes
    and syncs at the epoch's end from its states), or a Python number. Those are left alone: a value computed from
    logits is a tensor, while the numbers users log per rank on purpose (seconds, bytes, counters) are Python's."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().float().item())
    return None


def _same(values: list[float]) -> bool:
    first = values[0]
    if math.isnan(first):
        return all(math.isnan(v) for v in values)
    return all(not math.isnan(v) and abs(v - first) <= _RELATIVE_TOLERANCE * max(abs(v), abs(first)) for v in values)


class ShardLocalLogCheck:
    """`"first"`: the first `FIRST_BATCHES_CHECKED` steps of every evaluation stage; `"every"`: each step;
    `"never"` (the strategy's `check_batches`)."""

    def __init__(self, mode: CheckBatches) -> None:
        self.mode = check_batches_option(mode)
        self._checked: dict[Any, int] = {}  # per stage: how many steps' logged values were compared

    @contextlib.contextmanager
    def step(self, module: Any, hook: str, stage: Any, groups: SequenceParallelGroups) -> Iterator[None]:
        """Around one evaluation step (`hook`: "validation_step" or "test_step") of `module` on sharded rows."""
        if not self._due(stage, groups):
            yield
            return
        logged: list[tuple[str, float]] = []
        own = module.__dict__.get("log")  # a `log` the user set on the instance, kept

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            number = _scalar(value)
            if number is not None:
                logged.append((name, number))
            return (own or type(module).log.__get__(module))(name, value, *args, **kwargs)

        module.log = log
        try:
            yield
        finally:
            if own is None:
                del module.log
            else:
                module.log = own
        self._compare(logged, hook, groups)

    def _due(self, stage: Any, groups: SequenceParallelGroups) -> bool:
        if groups.sequence_parallel_world_size == 1 or self.mode == "never":
            return False
        checked = self._checked.get(stage, 0)
        if self.mode == "first" and checked >= FIRST_BATCHES_CHECKED:
            return False
        self._checked[stage] = checked + 1
        return True

    @staticmethod
    def _compare(logged: list[tuple[str, float]], hook: str, groups: SequenceParallelGroups) -> None:
        size = groups.sequence_parallel_world_size
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, logged, group=groups.sequence_parallel_group)
        by_rank = [dict(values) for values in gathered]
        for name in dict(logged):
            values = [values.get(name) for values in by_rank]
            if any(v is None for v in values) or _same(values):  # a name some rank did not log: nothing to compare
                continue
            shown = ", ".join(f"{v:.6g} on SP rank {rank}" for rank, v in enumerate(values))
            raise RuntimeError(
                f"{hook} logged {name!r} = {shown}, from the same rows: at sequence_parallel_size={size} each rank's"
                f" step sees 1/{size} of every row, so a value computed from this rank's logits alone (e.g."
                " cross_entropy(logits[:, :-1], batch['labels'][:, 1:])) loses the targets at shard boundaries and"
                " averages per shard, and logging it (sync_dist=True too) reports a number close to the whole rows'"
                " but not it. Compute it with self.trainer.strategy.loss_function(logits, batch['labels']) (labels as"
                " the batch holds them, unshifted) or model(**batch).loss; for metrics, log a"
                " lightning_ulysses.training.metrics metric object (self.log(name, metric)) or wrap a torchmetrics"
                " metric in SequenceParallel(metric); or evaluate whole rows with"
                " sequence_parallel_in_evaluation=False.")
