"""torchmetrics that stay exact when every sequence is split over an SP group and samples over DP groups.

Token-level metrics keep *sums and counts* (never means of means): every rank adds the tokens it holds, and the
default sync over all ranks adds every token exactly once, because SP ranks hold disjoint pieces of a sequence
and DP groups hold disjoint samples. `labels` are the batch's, as Hugging Face reads them (unshifted: the target of
position t is label t+1), exactly as `UlyssesDeepSpeedStrategy` delivers them: the metric shifts them across the SP
group's shards (bound by the strategy; unbound, a plain shift); targets equal to `ignore_index` are skipped.

Any other metric (sequence-level, or needing whole rows) goes through `SequenceParallel(metric)`: it gathers
the row pieces over the SP group, updates the wrapped metric with whole rows on every SP rank, and syncs the
wrapped metric over the DP group only, so each sample is counted once.

Every one of them returns the whole rows' value from `forward` too (the per-batch value `self.log(name, metric)`
logs on step), the same on every SP rank: the token metrics add this batch's sums and counts over the SP group for
it (one small all-reduce), the wrapper computes its batch value from the whole rows it gathered. (A torchmetrics
metric used unwrapped would give this rank's shard's value per batch, which the strategy refuses when it is logged.)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torchmetrics import Metric

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.training.loss import IGNORE_INDEX, _SumOverGroup, shift_sharded_labels


class _TokenSums(Metric):
    full_state_update = False

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs: Any):
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self._sequence_parallel_group, self._shard_order = None, None  # how this rank's rows were cut
        self._computing_batch_value = False  # inside `forward`: `compute` sees this batch's sums alone

    def bind_parallel_groups(self, groups, whole_rows: bool = False) -> None:
        """Called by the strategy at setup, and with None to unbind: the SP group across whose shards the labels are
        shifted. The sums still sync over every rank (each target lives on exactly one)."""
        if groups is None or groups.sequence_parallel_world_size == 1 or whole_rows:
            self._sequence_parallel_group, self._shard_order = None, None
        else:
            self._sequence_parallel_group, self._shard_order = groups.sequence_parallel_group, groups.shard_order

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        targets = shift_sharded_labels(labels, self._sequence_parallel_group, self._shard_order, self.ignore_index)
        valid = targets != self.ignore_index
        self.total += self._token_values(logits[valid].float(), targets[valid]).sum().double()
        self.count += valid.sum()

    def _token_values(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _value(self, mean: torch.Tensor) -> torch.Tensor:
        """The metric of a token mean."""
        return mean.float()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This batch's value of the whole rows (the same on every SP rank), accumulated as `update` does."""
        self._computing_batch_value = True
        try:
            return super().forward(logits, labels)
        finally:
            self._computing_batch_value = False

    def compute(self) -> torch.Tensor:
        total, count = self.total, self.count
        # torchmetrics' `forward` computes the batch value from this batch's states alone, on this rank (synced over
        # every rank only with `dist_sync_on_step`): this rank's shard. Its sums added over the SP group make it the
        # whole rows' (each target lives on one SP rank); `compute` of the accumulated states syncs them already.
        if self._computing_batch_value and self._sequence_parallel_group is not None and not self.dist_sync_on_step:
            total, count = _SumOverGroup.apply(torch.stack([total, count.to(total.dtype)]),
                                               self._sequence_parallel_group, 1.0)
        return self._value(total / count.clamp(min=1))


class TokenCrossEntropy(_TokenSums):
    """Mean next-token cross-entropy over all valid tokens of all ranks."""

    def _token_values(self, logits, labels):
        return F.cross_entropy(logits, labels, reduction="none")


class Perplexity(TokenCrossEntropy):
    """exp(token-mean cross-entropy) over all valid tokens of all ranks."""

    def _value(self, mean: torch.Tensor) -> torch.Tensor:
        return torch.exp(mean).float()


class NextTokenAccuracy(_TokenSums):
    """Share of valid tokens whose arg-max prediction is the target."""

    def _token_values(self, logits, labels):
        return (logits.argmax(dim=-1) == labels).double()


class SequenceParallel(Metric):
    """Makes any torchmetrics metric exact under sequence parallelism (see the module docstring).

    `update(*tensors)` takes this rank's pieces, `[batch, local_seq, ...]`; they are gathered along dim 1 over the
    SP group first. `UlyssesDeepSpeedStrategy` binds the groups at setup (`bind_parallel_groups`); unbound, it is
    the wrapped metric.
    """

    full_state_update = False

    def __init__(self, metric: Metric, **kwargs: Any):
        super().__init__(**kwargs)
        self.metric = metric
        self._sequence_parallel_group: Optional[Any] = None
        self._shard_order = None  # how the rows were cut (zig-zag with a ring): gathered pieces are put back in order

    def bind_parallel_groups(self, groups, whole_rows: bool = False) -> None:
        """Called by the strategy at setup, and with None to unbind. `whole_rows=True` (evaluation with
        `sequence_parallel_in_evaluation=False`): every SP rank already holds the same whole rows, so nothing is
        gathered, but the state still syncs over DP only."""
        if groups is None or groups.sequence_parallel_world_size == 1:
            self._sequence_parallel_group, self.metric.process_group, self._shard_order = None, None, None
        else:
            if whole_rows:
                self._sequence_parallel_group, self._shard_order = None, None
            else:
                self._sequence_parallel_group, self._shard_order = groups.sequence_parallel_group, groups.shard_order
            # SP ranks hold identical states after the gather: sync over DP only, or each sample counts SP times.
            self.metric.process_group = groups.data_parallel_group

    def _whole_rows(self, tensors) -> tuple:
        return tuple(all_gather_sequence(t, self._sequence_parallel_group, 1, self._shard_order) for t in tensors)

    def update(self, *tensors: torch.Tensor, **kwargs: Any) -> None:
        self.metric.update(*self._whole_rows(tensors), **kwargs)

    def forward(self, *tensors: torch.Tensor, **kwargs: Any) -> Any:
        # The wrapped metric owns all the state: let its own forward (batch value + accumulation) do the work, on the
        # whole rows (so its batch value is theirs, the same on every SP rank).
        self._update_count += 1  # what torchmetrics checks before compute()
        # What Lightning logs on step for `self.log(name, metric)` (`_ResultMetric.update` reads `_forward_cache`).
        self._forward_cache = self.metric(*self._whole_rows(tensors), **kwargs)
        return self._forward_cache

    def compute(self) -> Any:
        return self.metric.compute()

    def reset(self) -> None:
        self.metric.reset()
        super().reset()
