"""What the ranks of an SP group must agree on, checked by value: the training loss and every tensor a step logs.

The invariant: every rank of an SP group holds the same rows (each a different piece of them), so every value of
the whole rows is the same on all of them — the loss a training step returns (or passes to `manual_backward`) and
every tensor `training_step`, `validation_step` and `test_step` log. A value of one shard alone differs from its
neighbours': a loss written by hand on this rank's logits (`cross_entropy(logits[:, :-1], batch["labels"][:, 1:])`,
with or without a whole term added, such as an MoE model's `aux_loss`) drops the targets at shard boundaries and
averages per shard, and trains silently wrong once the backend sums the SP ranks' gradients; a value logged from it
makes SP rank 0's shard the run's number. `SameValueCheck` records what a step passes to `LightningModule.log` (and
`log_dict`, which calls it) and what it returns, and compares them over the SP group after the step, before its
loss reaches `backward` (and so before any optimizer step) and before Lightning hands anything to a logger, a
progress bar or a checkpoint callback. Under manual optimization the loss is compared in `manual_backward`, before
the step's own `optimizer.step()`. A value that differs, or a name some ranks logged and others did not, is refused
on every rank of the group alike: all decide from the same gathered values, naming the fix.

One collective per checked step: a fixed-length float64 row per rank (how many values, a digest of their names, the
values in the names' order) in one all-gather over the SP group; only a step logging more than `_SLOTS` values, or
ranks whose names differ, exchange their full lists (a second gather, which every rank of the group takes alike,
having seen the same rows). Under manual optimization each `manual_backward` of a checked step adds one.

Tolerance: a value of the whole rows is computed on every rank from the same numbers (our losses and metrics end in
one all-reduce over the group, `SequenceParallel` metrics and the label shift in one all-gather; every rank receives
the same bits from them) by the same kernels, so it is the same bit for bit — measured for `model(**batch).loss`, the
strategy's `loss_function`, an MoE model's `aux_loss` and our metrics. What can differ is only rounding a user's own
code adds after that, e.g. a non-deterministic kernel (atomics) summing in another order, a few units in the last
place of float32; `_RELATIVE_TOLERANCE` forgives that and no more. A value of one shard is a different number (another
1/P of the tokens), apart from where it is exact anyway: at the leading digits, not the last.

Not checked: Python numbers (seconds, bytes, counters a user logs per rank on purpose), torchmetrics `Metric` objects
(Lightning computes and syncs them from their states; ours give the whole rows' value from `forward` too), names
matching the strategy's `per_rank_values` (values meant per rank), and `predict_step`, where Lightning 2.6 refuses
`self.log` itself (a `MisconfigurationException`: "... you are trying to log in a `predict` hook, but it doesn't
support logging").

Why not also the autograd graph (does the loss reach the group sum?): it was a pattern, not the invariant — a loss
with a whole term added (the MoE router loss, a regulariser built on `out.loss`) reaches the sum and passed it while
its main part was one shard's, and a correct loss reduced by other means would fail it. A run whose loss changes
after its first batches can check every batch (`check_batches="every"`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import math
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_ulysses.batch.check import FIRST_BATCHES_CHECKED, CheckBatches, check_batches_option
from lightning_ulysses.parallel.layout import SequenceParallelGroups

# See the module docstring: whole-row values agree bit for bit; this forgives a few float32 ulps of a user's own
# reordered sums. Shard values differ in their leading digits.
_RELATIVE_TOLERANCE = 1e-6
_SLOTS = 30  # values one row carries (after the count and the names' digest): 256 bytes a rank
_LOSS = "\0loss"  # the step's loss among the logged names (no name a user logs starts with a NUL)

PerRankValues = Union[str, Sequence[str]]


def check_per_rank_values(patterns: Optional[PerRankValues]) -> tuple[str, ...]:
    """The strategy's `per_rank_values`: logged names (`fnmatch` patterns, e.g. `"time/*"`) whose tensors are meant
    per rank and are not compared; a single name may be given as a string."""
    if patterns is None:
        return ()
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    if not all(isinstance(pattern, str) for pattern in patterns):
        raise TypeError(f"per_rank_values must be logged names (or fnmatch patterns of them), got {patterns!r}")
    return patterns


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss a training step returned, as Lightning's automatic optimization reads it (a tensor, or a mapping's
    "loss"); None where it returned none (the batch skipped)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, torch.Tensor) else None


def _digest(names: list[str]) -> float:
    """48 bits of the names (exact in a float64), the same in every process (Python's `hash` is salted per process)."""
    data = "\x1f".join(names).encode()
    return float(int.from_bytes(hashlib.blake2b(data, digest_size=6).digest(), "big"))


def _same(values: list[float]) -> bool:
    first = values[0]
    if math.isnan(first):
        return all(math.isnan(v) for v in values)
    return all(not math.isnan(v) and abs(v - first) <= _RELATIVE_TOLERANCE * max(abs(v), abs(first)) for v in values)


def _shown(name: str) -> str:
    return "the loss" if name == _LOSS else repr(name)


class SameValueCheck:
    """`"first"`: the first `FIRST_BATCHES_CHECKED` steps of every stage; `"every"`: each step; `"never"` (the
    strategy's `check_batches`). `per_rank_values`: see `check_per_rank_values`."""

    def __init__(self, mode: CheckBatches, per_rank_values: Optional[PerRankValues] = ()) -> None:
        self.mode = check_batches_option(mode)
        self.per_rank_values = check_per_rank_values(per_rank_values)
        self._checked: dict[Any, int] = {}  # per stage: how many steps were compared
        self._running: Optional[tuple[SequenceParallelGroups, torch.device]] = None  # a checked step, while it runs

    def run_step(self, step: Callable[[], Any], module: Any, hook: str, stage: Any, groups: SequenceParallelGroups,
                 device: torch.device, returns_loss: bool) -> Any:
        """`step()` (the step `hook` of `module`, on sharded rows), its logged tensors and, where `returns_loss`
        (training under automatic optimization), the loss it returns compared over the SP group after it."""
        if not self._due(stage, groups):
            return step()
        logged: list[tuple[str, torch.Tensor]] = []
        with self._recording(module, logged):
            self._running = groups, device
            try:
                output = step()
            finally:
                self._running = None
        loss = _loss_of(output) if returns_loss else None
        self._compare(logged + ([(_LOSS, loss)] if loss is not None else []), hook, groups, device)
        return output

    @property
    def in_checked_step(self) -> bool:
        """Whether a checked step is running: a `backward` now is `manual_backward`'s (automatic optimization calls
        it after the step, whose returned loss `run_step` compared)."""
        return self._running is not None

    def check_backward(self, loss: torch.Tensor) -> None:
        """A loss given to `manual_backward` inside a checked training step, compared before the step goes on to its
        optimizer's `step`."""
        groups, device = self._running
        self._compare([(_LOSS, loss)], "manual_backward", groups, device)

    def _due(self, stage: Any, groups: SequenceParallelGroups) -> bool:
        if groups.sequence_parallel_world_size == 1 or self.mode == "never":
            return False
        checked = self._checked.get(stage, 0)
        if self.mode == "first" and checked >= FIRST_BATCHES_CHECKED:
            return False
        self._checked[stage] = checked + 1
        return True

    @contextlib.contextmanager
    def _recording(self, module: Any, logged: list) -> Iterator[None]:
        """`module.log` recording every tensor it is given (not Python numbers, not `Metric` objects, not the names
        meant per rank) before passing it on."""
        own = module.__dict__.get("log")  # a `log` the user set on the instance, kept

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(value, torch.Tensor) and not any(fnmatch.fnmatchcase(name, p) for p in self.per_rank_values):
                logged.append((name, value.detach()))
            return (own or type(module).log.__get__(module))(name, value, *args, **kwargs)

        module.log = log
        try:
            yield
        finally:
            if own is None:
                del module.log
            else:
                module.log = own

    def _compare(self, values: list[tuple[str, torch.Tensor]], hook: str, groups: SequenceParallelGroups,
                 device: torch.device) -> None:
        values = sorted(values, key=lambda item: item[0])
        names = [name for name, _ in values]
        row = torch.zeros(2 + _SLOTS, dtype=torch.float64, device=device)
        row[0], row[1] = len(values), _digest(names)
        if values:  # one number per value (a non-scalar loss given to manual_backward: its sum)
            carried = [value.to(device=device, dtype=torch.float64).sum() for _, value in values[:_SLOTS]]
            row[2:2 + len(carried)] = torch.stack(carried)
        size, group = groups.sequence_parallel_world_size, groups.sequence_parallel_group
        rows = [torch.empty_like(row) for _ in range(size)]
        dist.all_gather(rows, row, group=group)
        rows = [r.tolist() for r in rows]
        if all(r[:2] == rows[0][:2] for r in rows) and len(values) <= _SLOTS:
            by_rank = [dict(zip(names, r[2:])) for r in rows]
        else:  # names that differ, or more values than a row carries: the full lists (every rank saw the same rows)
            own = [(name, float(value.to(torch.float64).sum())) for name, value in values]
            gathered: list[Any] = [None] * size
            dist.all_gather_object(gathered, own, group=group)
            by_rank = [dict(pairs) for pairs in gathered]
        ranks = next(g for g in groups.layout.sequence_parallel_groups() if dist.get_rank() in g)
        for name in sorted(set().union(*by_rank)):
            found = [values.get(name) for values in by_rank]
            if any(v is None for v in found):
                raise RuntimeError(_missing_message(name, found, hook, size, ranks))
            if not _same(found):
                raise RuntimeError(_differs_message(name, found, hook, size, ranks))


def _fixes(name: str, hook: str) -> str:
    if name == _LOSS:
        return (" Return model(**batch).loss, or self.trainer.strategy.loss_function(logits, batch['labels'])"
                " (labels as the batch holds them, unshifted), adding whole terms such as out.aux_loss to that; for a"
                " per-token loss of your own, sum it over this rank's tokens and reduce it with"
                " loss_fn.reduce_token_loss_sum(token_loss_sum, loss_fn.targets(batch['labels'])), where loss_fn ="
                " self.trainer.strategy.loss_function.")
    return (" Log values of the whole rows: self.trainer.strategy.loss_function(logits, batch['labels']) (labels as"
            " the batch holds them, unshifted) or model(**batch).loss; a lightning_ulysses.training.metrics metric (its"
            " per-batch value is the whole rows' too) or a torchmetrics metric wrapped in SequenceParallel(metric). A"
            f" value meant per rank (a timing, a count of this rank's own): log a Python number, or name it in the"
            f" strategy's per_rank_values=[{name!r}], which leaves it out of the comparison."
            + (" Or evaluate whole rows: sequence_parallel_in_evaluation=False." if hook != "training_step" else ""))


def _differs_message(name: str, found: list[float], hook: str, size: int, ranks: list[int]) -> str:
    shown = ", ".join(f"{v:.6g} on rank {rank}" for rank, v in zip(ranks, found))
    what = f"The loss {hook} was given" if hook == "manual_backward" else (
        f"The loss {hook} returned" if name == _LOSS else f"{hook} logged {name!r}: the value")
    consequence = (" A loss of this rank's logits alone (e.g. cross_entropy(logits[:, :-1], batch['labels'][:, 1:]),"
                   " with or without a whole term such as an MoE model's aux_loss added) loses the targets at shard"
                   " boundaries and averages per shard; its gradients, summed over the SP ranks, train silently wrong."
                   if name == _LOSS else
                   " A value of this rank's logits alone (a loss or an accuracy of its shard) would be logged as SP rank"
                   " 0's shard's number, close to the whole rows' but not it (sync_dist=True too: a mean of shards).")
    return (f"{what} differs between the ranks {ranks} of one SP group, which hold the same rows ({shown}): it was computed from"
            f" this rank's shard alone (at sequence_parallel_size={size} every rank holds 1/{size} of each row)."
            f"{consequence}{_fixes(name, hook)}")


def _missing_message(name: str, found: list[Optional[float]], hook: str, size: int, ranks: list[int]) -> str:
    have = [ranks[i] for i, v in enumerate(found) if v is not None]
    lack = [ranks[i] for i, v in enumerate(found) if v is None]
    what = "returned a loss" if name == _LOSS else f"logged {name!r}"
    return (f"{hook} {what} on the ranks {have} but not on {lack} of one SP group, which hold the same rows: what a step logs or"
            f" returns must not depend on this rank's shard (at sequence_parallel_size={size} every rank holds"
            f" 1/{size} of each row), e.g. a condition on its own labels or logits.{_fixes(name, hook)}")
