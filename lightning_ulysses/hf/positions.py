"""Forward pre-hooks on a prepared model for what it is entered with: the latest forward's positions and padding
mask kept on the binding (for attention modules their layer does not hand them to), the refusal of a sharded
forward without the batch's global positions, and of one continuing from a cache."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from lightning_ulysses.attention.core import ProcessGroupHandle
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.hf.binding import _Binding


def watch_positions(model: torch.nn.Module, batch_rows: BatchRowsSlot, sequence_parallel_group, ring_group=None):
    """Refuse `model`'s sharded forwards whose positions are not the batch's (see `_PositionCheck`); for models
    other than Hugging Face's (the native GPT), which `prepare_hf_model` does not see. Returns the hook's handle."""
    binding = _Binding(group=ProcessGroupHandle(sequence_parallel_group), backend="", ring=ProcessGroupHandle(ring_group),
                       batch_rows=batch_rows)
    return model.register_forward_pre_hook(_PositionCheck(model, binding), with_kwargs=True)


class _ForwardPositions:
    """Keeps the `position_ids` (and the `attention_mask`) of the model's latest forward on the binding (a
    pre-hook). Kept after the forward: layers recomputed in backward (activation checkpointing) must see the
    positions their forward saw."""

    def __init__(self, model: torch.nn.Module, binding: _Binding) -> None:
        self.binding = binding
        self.signature = inspect.signature(model.forward)

    def __call__(self, module, args, kwargs):
        try:
            arguments = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            arguments = {}
        self.binding.forward_positions = arguments.get("position_ids")
        mask = arguments.get("attention_mask")
        self.binding.forward_padding_mask = mask if isinstance(mask, torch.Tensor) else None
        return None


class _PositionCheck:
    """Refuses a sharded forward whose positions are not the batch's global ones (a forward pre-hook).

    Left without `position_ids`, a model numbers every shard from 0: wrong rotary/learned positions, and the
    gathered positions restart at each shard boundary, so attention silently becomes block-diagonal. Positions
    are checked against the shard the sharder published (metadata only); a different tensor is compared by value
    before it is refused. Raised in the model's forward, before its first all-to-all, on every rank alike.
    """

    def __init__(self, model: torch.nn.Module, binding: _Binding) -> None:
        self.binding = binding
        self.name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.takes_positions = "position_ids" in self.signature.parameters

    def _same_values_on_every_rank(self, position_ids: torch.Tensor, expected: torch.Tensor | None) -> bool:
        """Whether `position_ids` hold the batch's positions on every rank of the SP group. One rank's shard may
        match by chance (local 0..n-1 are rank 0's global ones), so the ranks agree (MIN all-reduce) before any
        of them raises or goes on: the path here is taken by every rank alike (it follows metadata only)."""
        same = (expected is not None and position_ids.shape[-1] == expected.shape[-1]
                and torch.equal(position_ids.expand_as(expected).to(expected.device), expected))
        flag = torch.tensor([int(same)], device=position_ids.device)
        for handle in (self.binding.group, self.binding.ring):
            if handle.world_size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=handle.group)
        return bool(flag.item())

    def __call__(self, module, args, kwargs):
        rows = None if self.binding.batch_rows is None else self.binding.batch_rows.rows
        if rows is None or (self.binding.decode is not None) or not self.takes_positions:
            return None
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return None  # the model's own call raises its own error
        input_ids, position_ids = bound.get("input_ids"), bound.get("position_ids")
        if rows.holds_position_ids(position_ids):
            return None
        if position_ids is not None and self._same_values_on_every_rank(position_ids, rows.shard_position_ids):
            return None
        if position_ids is None and input_ids is not None and not rows.holds_input_ids(input_ids):
            return None  # not this batch's tokens: nothing to check them against
        what = "no position_ids" if position_ids is None else "position_ids that are not the batch's global ones"
        raise ValueError(
            f"{self.name} was called under sequence parallelism with {what}: each rank holds only its shard of the"
            " sequence, so the model would number it from 0 (wrong positions, and attention that stops at every shard"
            " boundary). Pass the batch's global positions: model(**batch), or model(input_ids=batch['input_ids'],"
            " labels=..., position_ids=batch['position_ids']) — the strategy fills them in when the batch has none."
        )


CACHE_ARGUMENTS = ("past_key_values", "cache", "cache_params")


def cache_holds_tokens(cache) -> bool:
    """Whether a transformers cache already holds earlier tokens (attention keys, or a mixer's recorded state)."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # not transformers' layered cache: assume it holds tokens (refused rather than guessed)
        return True
    return any(any(getattr(layer, "has_previous_state", {}).values())
               or (callable(getattr(layer, "get_seq_length", None)) and layer.get_seq_length() > 0) for layer in layers)


class _CacheCheck:
    """Refuses a sharded forward handed a cache that already holds tokens (a forward pre-hook).

    A cache the model creates for itself (transformers' default `use_cache=True`, training included) records a
    prefill and is fine; continuing from one is decoding, which only `lightning_ulysses.integration.inference.generate` does
    exactly under sequence parallelism. Raised before the model's first collective, on every rank alike (every rank
    of the SP group is handed the same kind of cache)."""

    def __init__(self, model: torch.nn.Module, binding: _Binding) -> None:
        self.binding, self.name = binding, type(model).__name__

    def __call__(self, module, args, kwargs):
        if self.binding.decode is not None:
            return None
        for name in CACHE_ARGUMENTS:
            cache = kwargs.get(name)
            if cache is not None and not isinstance(cache, bool) and cache_holds_tokens(cache):
                raise NotImplementedError(
                    f"{self.name} was called under sequence parallelism with a {name} that already holds tokens:"
                    " decoding from a cache needs the whole prompt's state, of which each rank holds a shard. Use"
                    " lightning_ulysses.integration.inference.generate, or decode with sequence_parallel_size=1.")
        return None
