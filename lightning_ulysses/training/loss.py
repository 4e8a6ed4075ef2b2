"""Token-mean cross-entropy over a sequence split across an SP group, with the right gradient on every ZeRO stage.

Value: every rank returns the loss of the *whole* sequence (sum of the token losses of all shards divided by
the number of valid targets of all shards), so the number a user logs is the same on every SP rank and equals
the unsharded loss.

Gradient: each rank back-propagates only its own shard's share (`local sum / global count`); the all-to-alls
carry the cross-shard terms, and DeepSpeed sums the SP ranks' gradients when it reduces over DP×SP. How it then
divides depends on the ZeRO stage (see `run_spec.RunSpec.loss_gradient_scale`), so the share is multiplied by a scale in the
backward pass only, leaving the reported value untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.fences import _torch_private as torch_private

IGNORE_INDEX = -100


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; backward passes the gradient to the local share only, times `gradient_scale`.

    Every whole-sequence loss of this module ends in it, so its value is the same bits on every SP rank: what the
    strategy checks a training loss by (`integration.logged_values`)."""

    @staticmethod
    def forward(ctx, local_share, group, gradient_scale: float):
        ctx.gradient_scale = gradient_scale
        total = local_share.clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * ctx.gradient_scale, None, None


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    *positional: Any,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    group=None,
    gradient_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | torch.Tensor | None = None,
    order=None,
) -> torch.Tensor:
    """Mean next-token cross-entropy of the whole (sharded) sequence.

    `logits` `[batch, seq/P, vocab]` is this rank's shard. The targets go in by keyword, exactly one of:
    `labels=` this rank's shard of labels as Hugging Face reads them — unshifted, as `batch["labels"]` holds them —
    shifted here across shard boundaries (the target of a shard's last token comes from the next shard); or
    `shift_labels=` targets already aligned with the logits (target of t at t). `group` is the SP group (None: no
    sequence parallelism), `order` how the rows were cut (`parallel_groups.shard_order`; None: contiguous).
    `num_items_in_batch`, when given, is the global number of valid targets to divide by (e.g. over
    gradient-accumulation steps), as in Hugging Face's loss functions. Under the strategy,
    `trainer.strategy.loss_function(logits, labels)` is this with the group, order and ZeRO gradient scale bound.
    """
    if positional or (labels is None) == (shift_labels is None):
        raise TypeError(
            "sequence_parallel_cross_entropy(logits, labels=...) or (logits, shift_labels=...): pass exactly one, by"
            " keyword — labels= as the batch holds them (unshifted; shifted here across shard boundaries), or"
            " shift_labels= already aligned with the logits. The strategy's batches carry unshifted labels.")
    if shift_labels is None:
        shift_labels = shift_sharded_labels(labels, group, order, ignore_index)
    token_loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return sequence_parallel_token_mean(token_loss_sum, shift_labels, group, gradient_scale, ignore_index,
                                        num_items_in_batch)


def sequence_parallel_token_mean(
    token_loss_sum: torch.Tensor,
    shift_labels: torch.Tensor,
    group=None,
    gradient_scale: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole sequence's token mean from this shard's summed token losses (see `sequence_parallel_cross_entropy`).

    Separate from it so that losses computed without whole logits (`lightning_ulysses.memory`'s tiled logits +
    loss) are reduced by exactly the same code.
    """
    if num_items_in_batch is None:
        count = (shift_labels != ignore_index).sum().to(token_loss_sum.device)
        if group is not None:
            dist.all_reduce(count, group=group)
    else:
        count = torch.as_tensor(num_items_in_batch, device=token_loss_sum.device)
    # A sequence with no valid target contributes a zero loss (and zero gradient), not NaN.
    local_share = token_loss_sum / count.clamp(min=1).to(token_loss_sum.dtype)
    if group is None and gradient_scale == 1.0:
        return local_share
    return _SumOverGroup.apply(local_share, group, gradient_scale)


class SequenceParallelCausalLMLoss:
    """Drop-in for a Hugging Face model's `loss_function` under `UlyssesDeepSpeedStrategy`, at every SP size.

    The loss is right for whatever labels reach it (`targets`): they are read the way Hugging Face reads them —
    unshifted, the target of position t is label t+1, as the batch's own `labels` arrive — and shifted here exactly,
    across shard boundaries; `shift_labels=` (Hugging Face's own argument for labels already shifted) is used as
    given.
    """

    def __init__(self, group, gradient_scale: float, batch_rows=None, order=None):
        self.group = group
        self.gradient_scale = gradient_scale
        self.batch_rows = batch_rows  # attention.rows.BatchRowsSlot the sharder publishes each batch into
        self.order = order  # layout.ShardOrder of the batch's cut (None: contiguous)

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None, **kwargs):
        return sequence_parallel_cross_entropy(
            logits, shift_labels=self.targets(labels, shift_labels, ignore_index), group=self.group,
            gradient_scale=self.gradient_scale, ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)

    def targets(self, labels: torch.Tensor, shift_labels: torch.Tensor | None = None,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """This rank's shifted targets (position t → its next token) for `labels` as a model received them."""
        if shift_labels is not None:
            return shift_labels
        rows = None if self.batch_rows is None else self.batch_rows.rows
        return shift_sharded_labels(labels, self.group, self.order, ignore_index,
                                    None if rows is None else rows.unpadded_length_of(labels))

    def reduce_token_loss_sum(self, token_loss_sum, shift_labels, ignore_index=IGNORE_INDEX, num_items_in_batch=None):
        """Same value and gradient as `__call__`, from this shard's summed token losses instead of its logits
        (`shift_labels`: as `targets` returns them)."""
        return sequence_parallel_token_mean(token_loss_sum, shift_labels, self.group, self.gradient_scale,
                                            ignore_index, num_items_in_batch)

    def __deepcopy__(self, memo):  # holds a process group: share it, see ProcessGroupHandle
        return self


def shift_sharded_labels(labels: torch.Tensor, group=None, order=None, ignore_index: int = IGNORE_INDEX,
                         unpadded_length: int | None = None) -> torch.Tensor:
    """Hugging Face's causal shift (target of t = label t+1, the last position ignored) of labels cut along the
    sequence over `group` in `order`: the whole rows are gathered (integers, no gradient), shifted and cut again,
    so the target of a shard's last token comes from the next shard. `unpadded_length`: the rows' length before the
    sharder padded them; labels beyond it (padding tokens when the labels are the input ids) are ignored."""
    size = 1 if group is None else dist.get_world_size(group)
    whole = all_gather_sequence(labels, group, 1, order) if size > 1 else labels
    if unpadded_length is not None and unpadded_length < whole.size(1):
        whole = whole.clone()
        whole[:, unpadded_length:] = ignore_index
    shifted = F.pad(whole[:, 1:], (0, 1), value=ignore_index)
    if size == 1:
        return shifted
    rank = dist.get_rank(group)
    if order is None:
        return shifted.chunk(size, dim=1)[rank]
    return order.shard(shifted, rank, dim=1)


class LossFunctionHost:
    """Marks a model whose loss comes from its `loss_function(logits, labels, vocab_size=...)` attribute.

    Hugging Face models work this way already; a native model that inherits this marker gets the same treatment
    from `UlyssesDeepSpeedStrategy`: its `loss_function` is swapped for `SequenceParallelCausalLMLoss` during
    training and restored at teardown, with no change to the strategy per model family.
    """

    loss_function: Callable


def swap_loss_function(host: Any, loss_function: Callable) -> Callable[[], None]:
    """Install `loss_function` on `host`; return the callable that puts the original back."""
    missing = object()
    original = host.__dict__.get("loss_function", missing)
    host.loss_function = loss_function

    def restore() -> None:
        if original is missing:
            host.__dict__.pop("loss_function", None)
        else:
            host.loss_function = original

    return restore
