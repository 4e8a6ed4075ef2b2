"""Token mixers that are not attention (Mamba/Mamba2, Gated DeltaNet, KDA, lightning attention, short
convolutions, RG-LRU, RWKV time shifts) under sequence parallelism: run each on whole rows.

Such a layer mixes tokens inside its own forward (a causal convolution, a recurrence over the sequence), so the
attention exchange never reaches it: over a rank's shard alone it would restart its state at every shard boundary.
`WholeRowsMixer` wraps the layer (forward hooks, undone by removing them): its sequence inputs are gathered from
the SP group into whole rows in natural order, the layer runs *unchanged* on them, and each rank keeps the
outputs of its own tokens. The gather's backward sums the gradients every rank's tokens sent back (an
all-reduce), then keeps this rank's shard, so the result is the unsharded layer's, forward and backward, whatever
the layer computes; its parameters' gradients are, like every other layer's, this rank's tokens' share.

The price: the layer's compute and activations are those of the whole row on every SP rank (its projections
included), so these layers do not shrink with the SP size the way attention does (the model's other layers
still do). `prepare_hf_model` warns with the layers it wraps.

A layer's arguments are read by name from its signature, so any layer shaped like transformers' mixers works:
the first argument is the hidden states `[batch, seq, ...]`; `attention_mask` (2-D padding) and `position_ids`
are replaced by their whole rows, `cache_position` by the whole row's positions, `position_embeddings` gathered;
a cache must be None (training and evaluation, not decoding), and any other argument shaped like this shard is
refused by name rather than guessed.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.layout import ShardOrder

# The attribute of the "ulysses" mask interface's marker for windowed layers (attention/hf/mask_interface.py `_mark`).
MASK_MARKER = "_lightning_ulysses_pattern"
_CACHES = ("cache", "cache_params", "past_key_values", "past_key_value", "layer_past", "state")


class _GatherRows(torch.autograd.Function):
    """This rank's shard `[batch, seq/P, ...]` → the whole rows in natural order; backward sums every rank's
    gradient of the whole rows and keeps this rank's shard."""

    @staticmethod
    def forward(ctx, shard, mixer: "WholeRowsMixer"):
        ctx.mixer = mixer
        return mixer.gather(shard)

    @staticmethod
    def backward(ctx, grad):
        mixer = ctx.mixer
        grad = grad.contiguous()
        for group in (mixer.group, mixer.ring):
            if group is not None:
                dist.all_reduce(grad, group=group)
        return mixer.order.shard(grad, mixer.rank, dim=1), None


class WholeRowsMixer:
    """Forward pre-hook + forward hook that run one token-mixing layer on whole rows (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, path: str, group, ring_group=None):
        self.path, self.name = path, type(module).__name__
        self.group = group if group is not None and dist.get_world_size(group) > 1 else None
        self.ring = ring_group if ring_group is not None and dist.get_world_size(ring_group) > 1 else None
        self.order, self.rank = ShardOrder.of_groups(self.group, self.ring)
        self.signature = inspect.signature(module.forward)
        parameters = list(self.signature.parameters.values())
        self.hidden = parameters[0].name if parameters else None
        self.variadic = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
        self._shard_length: Optional[int] = None

    def attach(self, module: torch.nn.Module) -> list:
        """Register the hooks on `module`; returns their handles (remove them to undo)."""
        return [module.register_forward_pre_hook(self.before, with_kwargs=True),
                module.register_forward_hook(self.after)]

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        rows = all_gather_sequence(shard, self.group, seq_dim=1)
        return all_gather_sequence(rows, self.ring, seq_dim=1, order=self.order)

    def before(self, module, args, kwargs):
        arguments = self.signature.bind(*args, **kwargs).arguments
        hidden = arguments.get(self.hidden)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
            raise TypeError(f"{self.path} ({self.name}) was called without hidden states [batch, seq, ...] first.")
        self._shard_length = hidden.size(1)
        for name, value in list(arguments.items()):
            if name == self.variadic:
                arguments[name] = {key: self._whole(key, item, hidden) for key, item in value.items()}
            elif name == self.hidden:
                arguments[name] = _GatherRows.apply(hidden, self)
            else:
                arguments[name] = self._whole(name, value, hidden)
        bound = inspect.BoundArguments(self.signature, arguments)
        return bound.args, bound.kwargs

    def _whole(self, name: str, value: Any, hidden: torch.Tensor) -> Any:
        batch, length = hidden.shape[:2]
        if name == "attention_mask":
            # Masks from the "ulysses" mask interface: 2-D padding, or a windowed layer's marker holding it (a
            # recurrent block handed the attention's mask, like RecurrentGemma's, reads no window from it).
            value = getattr(value, MASK_MARKER, (value, None))[0] if value is not None else None
            # Rank-dependent None (transformers drops a shard's all-ones mask), so every rank gathers one.
            if value is not None and (not isinstance(value, torch.Tensor) or value.dim() != 2):
                raise NotImplementedError(
                    f"{self.path} ({self.name}) got a {getattr(value, 'dim', lambda: '?')()}-D attention mask; under"
                    " sequence parallelism it runs on whole rows and takes 2-D padding masks only.")
            shard = torch.ones(batch, length, dtype=torch.long, device=hidden.device) if value is None else value
            rows = self.gather(shard)
            return None if bool(rows.bool().all()) else rows
        if name == "position_ids" and isinstance(value, torch.Tensor):
            return self.gather(value)
        if name == "cache_position" and isinstance(value, torch.Tensor):
            return torch.arange(length * self.order.sequence_parallel_size, device=value.device)
        if name == "position_embeddings" and isinstance(value, (tuple, list)):
            return type(value)(_GatherRows.apply(item, self) for item in value)
        if name in _CACHES or name == "use_cache":
            if value not in (None, False):
                raise NotImplementedError(
                    f"{self.path} ({self.name}) got a {name} under sequence parallelism: its state would cover one"
                    " shard of the sequence. Call the model with use_cache=False (training and evaluation).")
            return value
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == length and value.size(0) in (1, batch):
            raise NotImplementedError(
                f"{self.path} ({self.name}) takes {name!r} shaped like this rank's shard of the sequence, which"
                " lightning_ulysses does not know how to make whole: train this model with sequence_parallel_size=1.")
        return value

    def after(self, module, args, output):
        length = self._shard_length
        whole = length * self.order.sequence_parallel_size

        def local(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == whole:
                return self.order.shard(value, self.rank, dim=1)
            return value

        if isinstance(output, torch.Tensor):
            return local(output)
        if isinstance(output, tuple):
            return type(output)(local(item) for item in output) if not hasattr(output, "_fields") else \
                type(output)(*(local(item) for item in output))
        raise TypeError(f"{self.path} ({self.name}) returned {type(output).__name__}; expected tensors.")
