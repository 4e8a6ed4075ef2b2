"""Ulysses for token mixers: each SP rank runs a mixer's own code on whole rows of its share of the heads.

A linear-attention, state-space or convolution layer mixes tokens within a head (or a channel), never across
heads, exactly as attention does; so the same trick applies. With the hidden states of `seq/P` tokens:

1. the mixer's input projections run on this rank's shard (`seq/P` tokens, every channel);
2. one all-to-all per projection turns their outputs into every token of this rank's units (heads or channels):
   `[batch, seq/P, C]` → `[batch, seq, C_r]` (channels/ChannelExchange), `C_r` the channels of rank r's units:
   ⌈U/P⌉ or ⌊U/P⌋ of the mixer's U units, contiguous, in rank order (the even split is the case where they are
   equal; an uneven one exchanges pieces of per-rank sizes);
3. the mixer's own forward runs unchanged on those whole rows, with its head counts, per-head parameters and
   convolution weights narrowed to this rank's units (so it calls the same kernels as the unprepared model: the
   flash-linear-attention, causal-conv1d and mamba_ssm ones where installed, transformers' PyTorch fallbacks
   elsewhere, or ours where that fallback is costly: the gated delta rule in linear time, Mamba2's scan in blocks:
   kernels.py);
4. before its output projection, a second all-to-all returns every channel of this rank's tokens.

Every projection of the layer then sees `seq/P` tokens on every rank, and its convolution, recurrence and
activations are ⌈U/P⌉ or ⌊U/P⌋ units' of the whole layer's U (`1/P` of it where P divides U).

How it is done without copying a family's forward: for each call, a *local view* of the module is made (a shallow
copy: the module itself is never changed) whose input projections are stand-ins that project this rank's shard and
exchange the result, whose output projection first exchanges back, whose per-head parameters are this rank's
slices (differentiable slices of the real parameters, so gradients land in them), and whose head-count attributes
say how many units this rank holds. The view's forward, the family's own code, is called with a placeholder of
the whole rows' shape `[batch, seq, 0]` in place of the hidden states: the family reads the row length from it and
masks it, then hands it to a projection stand-in, which ignores it and projects the real shard.

Per family, all of this is a declaration (`MixerSplit`), kept in one small file per family (gated_deltanet.py,
short_conv.py, mamba2.py, ...); a mixer without one, or with fewer units than SP ranks, runs on whole rows
(whole_rows.py) with a warning that names the cost.

A submodule whose computation spans units on different ranks (Mamba2's gated RMSNorm when a norm group holds the
heads of several ranks) is replaced in the view by a stand-in its family makes (`MixerSplit.replaced`); such a
stand-in combines per-rank partial statistics with `sum_over_ranks`, whose backward sums the gradients alike.
A projection from every unit's channels to channels every unit reads (Mamba's `x_proj`: all channels → the step,
B and C that every channel's recurrence shares) is replaced by `SumOfPartialProducts`: with its weight's input
channels sliced to this rank's units, each rank multiplies its own on its whole rows, and the partial products are
summed over the SP group (a row-parallel linear): `1/P` of its work on every rank too.

The stand-ins of the projections are modules of their own, not the projections: code that reads a projection's
weight instead of calling it (a fused kernel that projects inside) would bypass the exchanges, so reading `weight`
or `bias` of a stand-in is refused with an error; a family whose mixer has such a fused path declares how its view
takes the path that calls the modules (mamba2.py).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from lightning_ulysses.fences import _torch_private as torch_private
from lightning_ulysses.fences._deepspeed_private import Z3_LEAF_ATTRIBUTE, mark_z3_leaf
from lightning_ulysses.mixers.arguments import CACHE_ARGUMENTS, PackedDocuments, shard_padding_mask, whole_row_argument
from lightning_ulysses.mixers.channels import ChannelExchange, ChannelLayout, Replicated, Shared
from lightning_ulysses.mixers.kernels import LinearTimeKernels
from lightning_ulysses.mixers.lora import is_plain_lora
from lightning_ulysses.mixers.ranks import SequenceRanks


@dataclass(frozen=True)
class MixerSplit:
    """How one token mixer splits over `parts` ranks, seen from one of them: what a family declares (module
    docstring) for rank `rank` (`split(module, parts, rank)`: the layouts are every rank's, the attributes this
    rank's).

    `units`: how many units (heads, channels) the mixer has; at least the SP size (rank r takes
    `channels.unit_range(units, parts, r)`: ⌈units/P⌉ or ⌊units/P⌋ of them).
    `inputs`: submodule path → the layout of its output channels; run on the shard, exchanged to head rows.
    `output`: (submodule path, the layout of its input channels); exchanged back to the shard before it runs.
    `parameters`: parameter (or buffer) path → (dimension, layout): this rank's slice along that dimension.
    `attributes`: attribute path → its value for this rank's units (head counts, widths, a convolution's groups).
    `masks_input`: the mixer zeroes padded tokens' hidden states before projecting them (done on the shard).
    `input_multiplier`: the attribute by which the mixer multiplies its hidden states before projecting them
    (Falcon-H1's `ssm_in_multiplier`); done on the shard, after the mask.
    `replaced`: submodule path → a factory `(submodule, ranks) -> stand-in`: called for each local view with the
    view's copy of the submodule (its parameters already sliced, its attributes set) and the `SequenceRanks`; for a
    computation that spans units on different ranks (module docstring).
    """

    units: int
    inputs: Mapping[str, ChannelLayout]
    output: tuple[str, ChannelLayout]
    parameters: Mapping[str, tuple[int, ChannelLayout]] = field(default_factory=dict)
    attributes: Mapping[str, Any] = field(default_factory=dict)
    masks_input: bool = True
    input_multiplier: str | None = None
    replaced: Mapping[str, Callable[[torch.nn.Module, SequenceRanks], torch.nn.Module]] = field(default_factory=dict)


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, ranks: SequenceRanks) -> torch.Tensor:
        ctx.ranks = ranks
        total = tensor.contiguous().clone()
        ranks.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank's output is the same sum: each rank's input reaches every rank's loss
        grad = grad.contiguous().clone()
        ctx.ranks.all_reduce(grad)
        return grad, None


def sum_over_ranks(tensor: torch.Tensor, ranks: SequenceRanks) -> torch.Tensor:
    """The sum of `tensor` over the SP ranks, on every rank; differentiable (its backward sums the gradients over
    the ranks the same way). For statistics that span units on different ranks. At SP 1, the tensor itself."""
    return tensor if ranks.size == 1 else _SumOverRanks.apply(tensor, ranks)


class _StandIn(torch.nn.Module):
    """A projection's stand-in in a local view: reading the projection's weight through it is refused (module
    docstring): a fused kernel that projects by itself would skip the exchange, so its result would be wrong."""

    @property
    def weight(self):
        raise NotImplementedError(
            f"a token mixer split by heads read a projection's weight itself (through its {type(self).__name__}):"
            " a fused kernel path would bypass the split. Its family's declaration in lightning_ulysses/mixers/"
            " must make the local view take the path that calls the projection; until then train this model with"
            " sequence_parallel_size=1.")

    bias = weight


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


class _GivenRows(_StandIn):
    """Stands in for an input projection when its head rows were computed beforehand (one document of a row)."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.rows = rows

    def forward(self, _placeholder: torch.Tensor) -> torch.Tensor:
        return self.rows


class _KeepRows(_StandIn):
    """Stands in for the output projection when documents run one by one: keeps what it is handed (projected once
    all documents have run)."""

    def __init__(self):
        super().__init__()
        self.rows: torch.Tensor | None = None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        self.rows = rows
        return rows


class SumOfPartialProducts(_StandIn):
    """A linear whose input channels are per unit and whose output every unit reads, in a local view
    (`MixerSplit.replaced` with its weight's input channels sliced in `MixerSplit.parameters`): this rank's partial
    product, summed over the SP group in float32 (as one matmul over every channel accumulates; a few channels); its
    bias added once, by the group's first rank. A peft LoRA layer around the linear (mixers/lora.py: its base
    weight's and `lora_A`'s input channels sliced) runs as it is, its base layer's bias on the first rank only."""

    def __init__(self, linear: torch.nn.Module, ranks: SequenceRanks):
        super().__init__()
        first = ranks.rank == 0
        self.ranks, self.adapted = ranks, None
        if is_plain_lora(linear):
            if not first:
                base = _bare_copy(linear.base_layer)
                torch_private.parameter_table(base)["bias"] = None
                torch_private.child_table(linear)["base_layer"] = base  # (`linear` is the view's own copy)
            self.adapted = linear
            return
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"SumOfPartialProducts stands in for a torch.nn.Linear, not {type(linear).__name__}")
        # (kept under other names than `weight` and `bias`: code that reads those would read a part as if it were all)
        self.weight_part = linear.weight
        self.bias_once = linear.bias if first else None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        partial = (torch.nn.functional.linear(rows, self.weight_part, self.bias_once) if self.adapted is None
                   else self.adapted(rows))
        return sum_over_ranks(partial.float(), self.ranks).to(partial.dtype)


def _bare_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` with its own parameter and child tables and no hooks (DeepSpeed's and ours stay
    on the module itself, which runs them around the whole mixer), without the split forward installed on it."""
    return torch_private.bare_copy(module)


class HeadSplitMixer:
    """Runs one token mixer split by units over the SP group (module docstring); `install` puts it in place."""

    def __init__(self, module: torch.nn.Module, path: str, split: MixerSplit, ranks: SequenceRanks,
                 decoding: Callable[[], bool] = lambda: False,
                 documents: PackedDocuments | None = None):
        self.path, self.name, self.split, self.ranks = path, type(module).__name__, split, ranks
        self.parts, self.rank = ranks.size, ranks.rank
        self.decoding = decoding  # whether `inference.generate` is decoding with the model (a cache is then refused)
        self.documents = documents  # the packed documents of the model's forward (None: the model packs none)
        self.inputs = {name: ChannelExchange(layout, ranks) for name, layout in split.inputs.items()}
        output, layout = split.output
        if any(isinstance(segment, (Replicated, Shared)) for segment in layout.segments):
            raise ValueError(f"{path}: an output projection's channels cannot be replicated or shared")
        self.output = (output, ChannelExchange(layout, ranks))
        self.slices = {name: (dim, layout.local_channels(self.rank, self.parts))
                       for name, (dim, layout) in split.parameters.items()}
        self.signature = inspect.signature(module.forward)
        self.kernels = LinearTimeKernels(type(module))  # ours where transformers' fallback is costly (kernels.py)
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
        return self.ranks.gather(shard)

    def forward(self, module: torch.nn.Module, *args, **kwargs):
        with self.kernels.in_place():
            return self._forward(module, *args, **kwargs)

    def _forward(self, module: torch.nn.Module, *args, **kwargs):
        arguments = self.signature.bind(*args, **kwargs).arguments
        hidden = arguments.get(self.hidden)
        where = f"{self.path} ({self.name})"
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            raise TypeError(f"{where} was called without hidden states [batch, seq, hidden] first.")
        batch, length, _ = hidden.shape
        documents = None if self.documents is None else self.documents.spans(batch, length)
        if self.parts == 1 and documents is None:
            return type(module).forward(module, *args, **kwargs)  # one rank, one document per row: the module itself
        whole = length * self.parts
        mask = shard_padding_mask(arguments.get("attention_mask"), hidden, where)
        decoding = self.decoding()

        def whole_rows(name: str, value: Any) -> Any:
            return whole_row_argument(name, value, hidden, self.gather, whole, where, decoding)

        # At SP 1 the arguments are the whole rows' already (a cache included: decoding then runs as unprepared).
        for name, value in list(arguments.items()) if self.parts > 1 else ():
            if name == self.variadic:
                arguments[name] = {key: whole_rows(key, item) for key, item in value.items()}
            elif name != self.hidden:
                arguments[name] = whole_rows(name, value)
        if mask is not None and self.split.masks_input:
            hidden = (hidden * mask[:, :, None]).to(hidden.dtype)  # what the mixer does to its input, on the shard
        if self.split.input_multiplier is not None:
            hidden = hidden * getattr(module, self.split.input_multiplier)
        if documents is not None:
            return self._per_document(module, arguments, hidden, documents, where)
        arguments[self.hidden] = hidden.new_empty(batch, whole, 0)
        view = self._local_view(module, lambda path, projection: _ProjectShard(projection, hidden, self.inputs[path]),
                                lambda projection: _ProjectFromHeadRows(projection, self.output[1]))
        bound = inspect.BoundArguments(self.signature, arguments)
        return view.forward(*bound.args, **bound.kwargs)

    def _per_document(self, module: torch.nn.Module, arguments: dict, shard: torch.Tensor,
                      documents: list[list[tuple[int, int]]], where: str) -> torch.Tensor:
        """Packed rows: the mixer's own forward runs once per document of each row, so its convolution and its
        recurrence restart at every document, as the attention's masks restart (whatever kernels are installed:
        transformers' PyTorch fallbacks take no document boundaries). The projections and both exchanges still run
        once for the whole batch."""
        head_rows = {path: exchange.to_head_rows(module.get_submodule(path)(shard))
                     for path, exchange in self.inputs.items()}
        whole = shard.size(1) * self.parts
        rows = []
        for row, spans in enumerate(documents):
            pieces = []
            for start, end in spans:
                given = {path: value[row:row + 1, start:end] for path, value in head_rows.items()}
                kept = _KeepRows()
                view = self._local_view(module, lambda path, projection: _GivenRows(given[path]), lambda _: kept)
                cut = {name: _document_of(name, value, row, start, end, whole) for name, value in arguments.items()}
                if self.variadic in cut:
                    cut[self.variadic] = {key: _document_of(key, item, row, start, end, whole)
                                          for key, item in arguments[self.variadic].items()}
                cut[self.hidden] = shard.new_empty(1, end - start, 0)
                bound = inspect.BoundArguments(self.signature, cut)
                output = view.forward(*bound.args, **bound.kwargs)
                # (a mixer may return its recurrent state beside its output, MiniMax's: a document's state, which no
                # caller of a packed row reads, is dropped)
                extra = len(output) - 1 if isinstance(output, tuple) and output and output[0] is kept.rows else None
                output = output[0] if extra is not None else output
                if kept.rows is None or output is not kept.rows:
                    raise NotImplementedError(
                        f"{where} computes more after its output projection, so its packed documents cannot run one"
                        " by one: train it on unpacked rows (one document per row) under sequence parallelism.")
                pieces.append(output)
            rows.append(torch.cat(pieces, dim=1))
        path, exchange = self.output
        projected = module.get_submodule(path)(exchange.to_shard(torch.cat(rows, dim=0)))
        return projected if extra is None else (projected, *(None,) * extra)

    def _local_view(self, module: torch.nn.Module, input_stand_in: Callable, output_stand_in: Callable) -> torch.nn.Module:
        """A view of `module` for this rank's units; `input_stand_in(path, projection)` and
        `output_stand_in(projection)` make the modules that take the projections' places."""
        copies = {"": _bare_copy(module)}

        def holder(path: str) -> tuple[torch.nn.Module, str]:
            """The copy that holds the attribute at `path` (copying the submodules on the way), and its name."""
            parent, _, name = path.rpartition(".")
            if parent not in copies:
                owner, child = holder(parent)
                copies[parent] = _bare_copy(torch_private.child_table(owner)[child])
                torch_private.child_table(owner)[child] = copies[parent]
            return copies[parent], name

        for path in self.inputs:
            owner, name = holder(path)
            torch_private.child_table(owner)[name] = input_stand_in(path, torch_private.child_table(owner)[name])
        owner, name = holder(self.output[0])
        torch_private.child_table(owner)[name] = output_stand_in(torch_private.child_table(owner)[name])
        for path, (dim, channels) in self.slices.items():
            owner, name = holder(path)
            parameters = torch_private.parameter_table(owner)
            table = parameters if name in parameters else torch_private.buffer_table(owner)
            table[name] = table[name].index_select(dim, channels.to(table[name].device))
        for path, value in self.split.attributes.items():
            owner, name = holder(path)
            owner.__dict__[name] = value
        for path, make in self.split.replaced.items():
            owner, name = holder(path)
            view = torch_private.child_table(owner)[name]
            torch_private.child_table(owner)[name] = make(view if path in copies else _bare_copy(view), self.ranks)
        return copies[""]


def _document_of(name: str, value: Any, row: int, start: int, end: int, whole: int) -> Any:
    """A whole-row argument cut to one document of one row; no cache (each document starts from no state, and a
    packed row is never decoded from); other arguments as they are."""
    if name in CACHE_ARGUMENTS:
        return None
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == whole:
        return value[row:row + 1, start:end] if value.size(0) > 1 else value[:, start:end]
    return value


class _Installed:
    """The handle of an installed split: `remove()` gives the module back as it was."""

    def __init__(self, module: torch.nn.Module, was_leaf: bool):
        self.module, self.was_leaf = module, was_leaf

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)
        if not self.was_leaf:
            self.module.__dict__.pop(Z3_LEAF_ATTRIBUTE, None)

