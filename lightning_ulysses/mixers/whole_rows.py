"""Token mixers that are not attention (Mamba/Mamba2, Gated DeltaNet, KDA, lightning attention, short
convolutions, RG-LRU, RWKV time shifts) under sequence parallelism, the last resort: run each on whole rows.

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
the first argument is the hidden states `[batch, seq, ...]`; `position_embeddings` are gathered; the others are made
whole as for a mixer split by heads (arguments.py: padding masks, positions, a cache the model made for itself), and
any other argument shaped like this shard is refused by name rather than guessed.

This is the last resort (mixers/__init__.py): mixers whose family declares how to split them by heads run split
(head_split.py) unless they have fewer units than SP ranks (a rank would hold none) or a peft adapter the split
cannot slice.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.parallel.layout import ShardOrder
from lightning_ulysses.mixers.arguments import PackedDocuments, whole_row_argument



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

    def __init__(self, module: torch.nn.Module, path: str, group, ring_group=None,
                 decoding: Callable[[], bool] = lambda: False, documents: PackedDocuments | None = None):
        self.path, self.name = path, type(module).__name__
        self.decoding = decoding  # whether `inference.generate` is decoding with the model (a cache is then refused)
        self.documents = documents  # the packed documents of the model's forward (None: the model packs none)
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
        if self.documents is not None and self.documents.spans(hidden.size(0), hidden.size(1)) is not None:
            raise NotImplementedError(
                f"{self.path} ({self.name}) runs on whole rows, where its convolution and recurrence would carry state"
                " from one packed document into the next (the attention keeps them apart). Train this model on"
                " unpacked rows (one document per row), or with sequence_parallel_size=1.")
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
        if name == "position_embeddings" and isinstance(value, (tuple, list)):
            return type(value)(_GatherRows.apply(item, self) for item in value)
        whole = hidden.size(1) * self.order.sequence_parallel_size
        return whole_row_argument(name, value, hidden, self.gather, whole, f"{self.path} ({self.name})", self.decoding())

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
