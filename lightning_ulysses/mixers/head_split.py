"""Ulysses for token mixers: each SP rank runs a mixer's own code on whole rows of its share of the heads.

A linear-attention, state-space or convolution layer mixes tokens within a head (or a channel), never across
heads, exactly as attention does; so the same trick applies. With the hidden states of `seq/P` tokens:

1. the mixer's input projections run on this rank's shard (`seq/P` tokens, every channel);
2. one all-to-all per projection turns their outputs into every token of this rank's units (heads or channels):
   `[batch, seq/P, C]` → `[batch, seq, C/P]` (channels/ChannelExchange);
3. the mixer's own forward runs unchanged on those whole rows, with its head counts, per-head parameters and
   convolution weights narrowed to this rank's units (so it calls the same kernels as the unprepared model: the
   flash-linear-attention and causal-conv1d ones where installed, transformers' PyTorch fallbacks elsewhere);
4. before its output projection, a second all-to-all returns every channel of this rank's tokens.

A projection from every unit's channels to channels that every unit reads (Mamba's `x_proj`: all channels → the
step, B and C every channel's recurrence shares) is *reduced*: each rank multiplies its units' slice of the weight
(its input channels) on its whole rows, and an all-reduce over the SP group sums the partial products (a
row-parallel linear: forward sum, and backward sum of the gradients, since every rank's units read the result).
It then runs on every token but `1/P` of its input channels, so its work is `1/P` of the whole layer's too.
Likewise a norm over every unit's channels (MiniMax's output norm) becomes a *norm over ranks*: each rank
normalises its channels by the root mean square of all of them, whose sum of squares is summed over the SP group.

Every projection, convolution, recurrence and activation of the layer is then `1/P` of the whole layer's, per rank.

How it is done without copying a family's forward: for each call, a *local view* of the module is made (a shallow
copy: the module itself is never changed) whose input projections are stand-ins that project this rank's shard and
exchange the result, whose output projection first exchanges back, whose per-head parameters are this rank's
slices (differentiable slices of the real parameters, so gradients land in them), and whose head-count attributes
say how many units this rank holds. The view's forward, the family's own code, is called with a placeholder of
the whole rows' shape `[batch, seq, 0]` in place of the hidden states: the family reads the row length from it and
masks it, then hands it to a projection stand-in, which ignores it and projects the real shard.

Per family, all of this is a declaration (`MixerSplit`), kept in one small file per family (gated_deltanet.py,
short_conv.py, ...); a mixer without one, or whose units do not divide by the SP size, or on a ring, runs on whole
rows (whole_rows.py) with a warning that names the cost.
"""

from __future__ import annotations

import collections
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from lightning_ulysses._deepspeed_private import Z3_LEAF_ATTRIBUTE, mark_z3_leaf
from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.mixers.arguments import shard_padding_mask, whole_row_argument
from lightning_ulysses.mixers.channels import ChannelExchange, ChannelLayout, Replicated

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


@dataclass(frozen=True)
class MixerSplit:
    """How one token mixer splits over `parts` ranks: what a family declares (module docstring).

    `units`: how many units (heads, channels) the mixer has; the SP size must divide it.
    `inputs`: submodule path → the layout of its output channels; run on the shard, exchanged to head rows.
    `output`: (submodule path, the layout of its input channels); exchanged back to the shard before it runs.
    `parameters`: parameter (or buffer) path → (dimension, layout): this rank's slice along that dimension.
    `attributes`: attribute path → its value for this rank's units (head counts, widths, a convolution's groups).
    `masks_input`: the mixer zeroes padded tokens' hidden states before projecting them (done on the shard).
    `reduced`: submodule path (a linear) → the layout of its input channels; run on this rank's channels of the
    whole rows, its partial products summed over the SP group (module docstring).
    `norms`: submodule path (an RMS norm over every unit's channels: `weight * x / sqrt(mean(x²) + eps)` in float32,
    cast back before the weight, as transformers' RMSNorms compute it; its epsilon `variance_epsilon` or `eps`) →
    the layout of its channels; this rank's channels normalised over every rank's (module docstring).
    """

    units: int
    inputs: Mapping[str, ChannelLayout]
    output: tuple[str, ChannelLayout]
    parameters: Mapping[str, tuple[int, ChannelLayout]] = field(default_factory=dict)
    attributes: Mapping[str, Any] = field(default_factory=dict)
    masks_input: bool = True
    reduced: Mapping[str, ChannelLayout] = field(default_factory=dict)
    norms: Mapping[str, ChannelLayout] = field(default_factory=dict)


class _StandIn(torch.nn.Module):
    """A projection's (or norm's) stand-in in a local view. The family's code must call it: code that reads the
    layer's weights instead (a fused kernel) would skip the split, so reading them is an error that says so."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in ("weight", "bias"):
                raise
        raise AttributeError(
            f"A token mixer split by heads read the {name} of a layer it calls (a projection or norm) instead of calling"
            " it (a fused kernel, which would skip the split): its family's declaration (lightning_ulysses/mixers/)"
            " must lead it to a path that calls that layer; until then train it with sequence_parallel_size=1.")


class _ProjectShard(_StandIn):
    """Stands in for an input projection in a local view: projects the shard, returns this rank's head rows."""

    def __init__(self, projection: torch.nn.Module, shard: torch.Tensor, exchange: ChannelExchange):
        super().__init__()
        self.projection, self.exchange = projection, exchange
        self.shard = shard

    def forward(self, _placeholder: torch.Tensor) -> torch.Tensor:
        return self.exchange.to_head_rows(self.projection(self.shard))


class _ProjectFromHeadRows(_StandIn):
    """Stands in for the output projection in a local view: back to every channel of this rank's tokens first."""

    def __init__(self, projection: torch.nn.Module, exchange: ChannelExchange):
        super().__init__()
        self.projection, self.exchange = projection, exchange

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.projection(self.exchange.to_shard(rows))


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) over the SP group; backward too: every rank's units read the sum, so the gradient of each
    partial product is the sum of every rank's gradient of it."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ProjectSummedOverRanks(_StandIn):
    """Stands in for a reduced projection in a local view: this rank's input channels, summed over the SP group."""

    def __init__(self, projection: torch.nn.Linear, channels: torch.Tensor, group, adds_bias: bool):
        super().__init__()
        self.projection, self.group, self.adds_bias = projection, group, adds_bias
        self.channels = channels

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.projection.weight
        bias = self.projection.bias if self.adds_bias else None  # added once, by the group's first rank
        partial = torch.nn.functional.linear(rows, weight.index_select(1, self.channels.to(weight.device)), bias)
        # summed in float32, as one matmul over every channel accumulates (a few shared channels: cheap to send)
        return _SumOverRanks.apply(partial.float(), self.group).to(partial.dtype)


class _NormOverRanks(_StandIn):
    """Stands in for an RMS norm over every unit's channels in a local view (`MixerSplit.norms`)."""

    def __init__(self, norm: torch.nn.Module, channels: torch.Tensor, whole_channels: int, group):
        super().__init__()
        self.norm, self.group, self.whole_channels = norm, group, whole_channels
        self.channels = channels
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        dtype = rows.dtype
        rows = rows.to(torch.float32)
        squares = _SumOverRanks.apply(rows.pow(2).sum(-1, keepdim=True), self.group)
        rows = rows * torch.rsqrt(squares / self.whole_channels + self.eps)
        weight = self.norm.weight
        return weight.index_select(0, self.channels.to(weight.device)) * rows.to(dtype)


def _bare_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` with its own parameter and child tables and no hooks (DeepSpeed's and ours stay
    on the module itself, which runs them around the whole mixer)."""
    copy = module.__class__.__new__(module.__class__)
    copy.__dict__.update(module.__dict__)
    copy.__dict__.pop("forward", None)  # the split forward installed on the module itself
    copy.__dict__["_parameters"] = dict(module._parameters)
    copy.__dict__["_buffers"] = dict(module._buffers)
    copy.__dict__["_modules"] = dict(module._modules)
    for name in _HOOK_DICTS:
        if name in copy.__dict__:
            copy.__dict__[name] = collections.OrderedDict()
    return copy


class HeadSplitMixer:
    """Runs one token mixer split by units over the SP group (module docstring); `install` puts it in place."""

    def __init__(self, module: torch.nn.Module, path: str, split: MixerSplit, group,
                 decoding: Callable[[], bool] = lambda: False, transport=None):
        self.path, self.name, self.split, self.group = path, type(module).__name__, split, group
        self.parts, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.decoding = decoding
        self.inputs = {name: ChannelExchange(layout, group, self.parts, transport)
                       for name, layout in split.inputs.items()}
        output, layout = split.output
        if any(isinstance(segment, Replicated) for segment in layout.segments):
            raise ValueError(f"{path}: an output projection's channels cannot be replicated")
        self.output = (output, ChannelExchange(layout, group, self.parts, transport))
        self.slices = {name: (dim, layout.local_channels(self.rank, self.parts))
                       for name, (dim, layout) in split.parameters.items()}
        self.reduced = {name: layout.local_channels(self.rank, self.parts) for name, layout in split.reduced.items()}
        for name in self.reduced:
            if not isinstance(module.get_submodule(name), torch.nn.Linear):
                raise TypeError(f"{path}: {name} is declared reduced over the SP group but is no torch.nn.Linear")
        self.norms = {name: (layout.local_channels(self.rank, self.parts), layout.channels)
                      for name, layout in split.norms.items()}
        for name, (_, channels) in self.norms.items():
            norm = module.get_submodule(name)
            weight = getattr(norm, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(
                    norm, "variance_epsilon", getattr(norm, "eps", None)) is None:
                raise TypeError(f"{path}: {name} is declared an RMS norm over ranks but has no weight and epsilon")
        self.signature = inspect.signature(module.forward)
        parameters = list(self.signature.parameters.values())
        self.hidden = parameters[0].name
        self.variadic = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)

    def install(self, module: torch.nn.Module) -> "_Installed":
        """Route `module`'s calls through the split (its hooks still run around it); the handle's `remove()` undoes.

        Bound to the module as a method of it, so that a deep copy of the model (an EMA copy) runs its own copy."""
        installed = _Installed(module, was_leaf=Z3_LEAF_ATTRIBUTE in module.__dict__)
        module.__dict__["forward"] = types.MethodType(self.forward, module)
        # Under ZeRO-3 the whole mixer's parameters are gathered around it (its code reads its convolution's weight
        # without calling the convolution, and its view slices them); elsewhere the attribute is never read.
        mark_z3_leaf(module)
        return installed

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        return all_gather_sequence(shard, self.group, seq_dim=1)

    def forward(self, module: torch.nn.Module, *args, **kwargs):
        arguments = self.signature.bind(*args, **kwargs).arguments
        hidden = arguments.get(self.hidden)
        where = f"{self.path} ({self.name})"
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise TypeError(f"{where} was called without hidden states [batch, seq, hidden] first.")
        batch, length, _ = hidden.shape
        whole = length * self.parts
        mask = shard_padding_mask(arguments.get("attention_mask"), hidden, where)
        decoding = self.decoding()

        def whole_rows(name: str, value: Any) -> Any:
            return whole_row_argument(name, value, hidden, self.gather, whole, where, decoding)

        for name, value in list(arguments.items()):
            if name == self.variadic:
                arguments[name] = {key: whole_rows(key, item) for key, item in value.items()}
            elif name != self.hidden:
                arguments[name] = whole_rows(name, value)
        if mask is not None and self.split.masks_input:
            hidden = (hidden * mask[:, :, None]).to(hidden.dtype)  # what the mixer does to its input, on the shard
        arguments[self.hidden] = hidden.new_empty(batch, whole, 0)
        view = self._local_view(module, hidden)
        bound = inspect.BoundArguments(self.signature, arguments)
        return view.forward(*bound.args, **bound.kwargs)

    def _local_view(self, module: torch.nn.Module, shard: torch.Tensor) -> torch.nn.Module:
        copies = {"": _bare_copy(module)}

        def holder(path: str) -> tuple[torch.nn.Module, str]:
            """The copy that holds the attribute at `path` (copying the submodules on the way), and its name."""
            parent, _, name = path.rpartition(".")
            if parent not in copies:
                owner, child = holder(parent)
                copies[parent] = _bare_copy(owner._modules[child])
                owner._modules[child] = copies[parent]
            return copies[parent], name

        for path, exchange in self.inputs.items():
            owner, name = holder(path)
            owner._modules[name] = _ProjectShard(owner._modules[name], shard, exchange)
        path, exchange = self.output
        owner, name = holder(path)
        owner._modules[name] = _ProjectFromHeadRows(owner._modules[name], exchange)
        for path, channels in self.reduced.items():
            owner, name = holder(path)
            owner._modules[name] = _ProjectSummedOverRanks(owner._modules[name], channels, self.group, self.rank == 0)
        for path, (channels, whole_channels) in self.norms.items():
            owner, name = holder(path)
            owner._modules[name] = _NormOverRanks(owner._modules[name], channels, whole_channels, self.group)
        for path, (dim, channels) in self.slices.items():
            owner, name = holder(path)
            table = owner._parameters if name in owner._parameters else owner._buffers
            table[name] = table[name].index_select(dim, channels.to(table[name].device))
        for path, value in self.split.attributes.items():
            owner, name = holder(path)
            owner.__dict__[name] = value
        return copies[""]


class _Installed:
    """The handle of an installed split: `remove()` gives the module back as it was."""

    def __init__(self, module: torch.nn.Module, was_leaf: bool):
        self.module, self.was_leaf = module, was_leaf

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)
        if not self.was_leaf:
            self.module.__dict__.pop(Z3_LEAF_ATTRIBUTE, None)

