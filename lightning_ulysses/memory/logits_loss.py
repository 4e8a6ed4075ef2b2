"""Fused, tiled output projection + cross-entropy: the `[seq, vocab]` logits never exist whole.

For each tile of the sequence the logits are computed (in the model's dtype, then fp32, exactly as the plain
path's `cross_entropy(logits.float())`), their token losses summed, and — because the loss is the last operation
of the step and linear in its incoming gradient — the gradients of this tile's hidden states and of the output
weight are computed right away, so backward only scales them. Peak extra memory is one tile's logits
(4K tokens × 128K vocab: 2 GB in fp32) instead of the whole sequence's (360K tokens: 185 GB).

The token-loss *sum* is then reduced by the model's loss function: the sequence-parallel one
(`SequenceParallelCausalLMLoss`: global token count over the SP group, ZeRO-stage gradient scale) when the strategy
has installed it, else a plain token mean with Hugging Face's shift, so the value and gradients equal the plain
path's in both cases.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.training.loss import (IGNORE_INDEX, SequenceParallelCausalLMLoss, sequence_parallel_token_mean,
                                             shift_sharded_labels)


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum over valid targets of `cross_entropy(linear(hidden, weight, bias).float(), labels)`, tile by tile."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, shift_labels, tile_tokens: int, ignore_index: int):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        seq = hidden.size(1)
        for start in range(0, seq, tile_tokens):
            size = min(tile_tokens, seq - start)
            hidden_tile = hidden.narrow(1, start, size).reshape(-1, hidden.size(-1))
            targets = shift_labels.narrow(1, start, size).reshape(-1).to(hidden.device)
            logits = F.linear(hidden_tile, weight, bias).float()
            total += F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
            if not (need_hidden or need_weight or need_bias):
                continue
            # d(sum of token losses)/d(logits) = softmax - one_hot(target), zero on ignored positions.
            grad_logits = logits.softmax(dim=-1)
            del logits
            valid = targets != ignore_index
            rows = valid.nonzero().squeeze(1)
            grad_logits[rows, targets[rows]] -= 1.0
            grad_logits[~valid] = 0.0
            # The plain path's gradient reaches the linear layer in the model's dtype (through `.float()`'s backward).
            grad_logits_compute = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden.narrow(1, start, size).copy_((grad_logits_compute @ weight).view(-1, size, hidden.size(-1)))
            if need_weight:
                grad_weight += (grad_logits_compute.t() @ hidden_tile).float()
            if need_bias:
                grad_bias += grad_logits_compute.float().sum(dim=0)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (grad_hidden, grad_weight, grad_bias)))
        ctx.has = (need_hidden, need_weight, need_bias)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = [g * grad_total.to(g.dtype) if has else None for g, has in zip(ctx.saved_tensors, ctx.has)]
        if grads[1] is not None:
            grads[1] = grads[1].to(ctx.weight_dtype)
        if grads[2] is not None:
            grads[2] = grads[2].to(ctx.weight_dtype)
        return grads[0], grads[1], grads[2], None, None, None


class TiledLogitsLoss:
    """Computes a causal-LM loss from final hidden states and an output head, tile by tile.

    `loss_function` is the model's current one: `SequenceParallelCausalLMLoss` (labels arrive shifted and sharded,
    reduction over the SP group) or any plain causal-LM loss on unshifted labels (token mean, Hugging Face shift).
    """

    def __init__(self, tile_tokens: int, ignore_index: int = IGNORE_INDEX):
        if tile_tokens < 1:
            raise ValueError(f"logits_tile_tokens must be a positive number of tokens, got {tile_tokens}")
        self.tile_tokens, self.ignore_index = tile_tokens, ignore_index

    def __call__(self, hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, loss_function: Callable,
                 num_items_in_batch=None) -> torch.Tensor:
        if isinstance(loss_function, SequenceParallelCausalLMLoss):
            shift_labels = loss_function.targets(labels, ignore_index=self.ignore_index)
            reduce = loss_function.reduce_token_loss_sum
        else:
            shift_labels = shift_sharded_labels(labels, ignore_index=self.ignore_index)
            reduce = sequence_parallel_token_mean
        # Called through the head module, so that ZeRO-3 gathers its weight around this forward and its backward.
        token_loss_sum = head(hidden, shift_labels=shift_labels)
        return reduce(token_loss_sum, shift_labels, ignore_index=self.ignore_index,
                      num_items_in_batch=num_items_in_batch)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             shift_labels: torch.Tensor, tile_tokens: int, ignore_index: int = IGNORE_INDEX
                             ) -> torch.Tensor:
    """`cross_entropy(linear(hidden, weight, bias).float(), shift_labels, reduction="sum")` (`hidden` [batch, seq,
    dim], `shift_labels` [batch, seq]) without holding more than `tile_tokens` tokens' logits at once; the gradients
    are computed in the forward, tile by tile."""
    return _LinearCrossEntropySum.apply(hidden, weight, bias, shift_labels, tile_tokens, ignore_index)


def _head_forward(head: nn.Module, original: Callable, tile_tokens: int, ignore_index: int,
                  hidden: torch.Tensor, shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    if shift_labels is None:
        return original(hidden)
    return linear_cross_entropy_sum(hidden, head.weight, head.bias, shift_labels, tile_tokens, ignore_index)


def fuse_head_with_loss(head: nn.Module, loss: TiledLogitsLoss) -> Callable[[], None]:
    """`head(hidden, shift_labels=...)` returns the summed token loss instead of logits. Returns the undo."""
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or not hasattr(head, "bias"):
        raise ValueError(
            f"tiled_logits_loss needs a linear output head (weight and bias attributes), got {type(head).__name__}."
            " Switch tiled_logits_loss off for this model."
        )
    original = head.forward

    def forward(hidden, shift_labels=None):
        return _head_forward(head, original, loss.tile_tokens, loss.ignore_index, hidden, shift_labels)

    head.forward = forward

    def restore() -> None:
        head.__dict__.pop("forward", None)

    return restore


# Output transforms between the head and the loss that a fused head would skip: refuse those models.
_UNSUPPORTED_HEAD_SETTINGS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def fuse_hugging_face_loss(model: nn.Module, loss: TiledLogitsLoss) -> Callable[[], None]:
    """Give a Hugging Face causal LM a training forward that never materialises logits (returns `logits=None`).

    Outside training, or without labels, the model's own forward runs (logits are returned as usual).
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in _UNSUPPORTED_HEAD_SETTINGS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"tiled_logits_loss does not support {type(model).__name__} ({name}={getattr(config, name)}"
                             " transforms the logits before the loss). Switch tiled_logits_loss off for this model.")
    head, base = model.get_output_embeddings(), model.base_model
    if head is None or base is model:
        raise ValueError(f"tiled_logits_loss needs a causal LM with a base model and an output head; {type(model).__name__}"
                         " has none. Switch tiled_logits_loss off for this model.")
    restore_head = fuse_head_with_loss(head, loss)
    original = model.forward
    signature = inspect.signature(original)

    def forward(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.update(arguments.pop("kwargs", {}))
        labels = arguments.pop("labels", None)
        if labels is None or not model.training:
            return original(*args, **kwargs)
        num_items_in_batch = arguments.pop("num_items_in_batch", None)
        arguments.pop("logits_to_keep", None)
        outputs = base(**arguments)
        value = loss(outputs[0], head, labels, model.loss_function, num_items_in_batch)
        return CausalLMOutputWithPast(loss=value, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                                      hidden_states=getattr(outputs, "hidden_states", None),
                                      attentions=getattr(outputs, "attentions", None))

    model.forward = forward

    def restore() -> None:
        model.__dict__.pop("forward", None)
        restore_head()

    return restore
