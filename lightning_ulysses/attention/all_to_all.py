"""The all-to-all that trades "my tokens, all heads" for "all tokens, my heads", with an exact backward.

We write our own instead of `torch.distributed.nn.functional` or DeepSpeed's `_SeqAllToAll` because the SP
group is usually smaller than the world (torch's autograd collectives have mixed up group-local and global
ranks there) and because one generic (split_dim, join_dim) exchange serves both Hugging Face's
`[batch, heads, seq, dim]` inputs and its `[batch, seq, heads, dim]` outputs without extra transposes.

An exchange is two autograd nodes: `start_exchange` launches the all-to-all without waiting, and
`InFlightExchange.finish` waits for it, so that work issued in between runs while the bytes travel (on GPU,
NCCL's own stream beside the compute stream): q, k and v are all launched before the first is finished, so the
copy that lays one out overlaps the transfer of another. Backward mirrors it: the finish node launches the
reverse all-to-all of the gradient, the start node waits for it. The pieces to send are views whenever the
layout allows it (batch 1: a head split of a contiguous `[1, heads, seq, dim]` or a sequence split of a
contiguous `[1, seq, heads, dim]`), else one copy lays them out; what arrives is laid out with one copy (none when
it already is). Measured on 2 × H200, a single fused q/k/v exchange was 0.9% slower at 128K tokens than separate
ones (`benchmarks/results/2026-11-29-h200x2-overlap/`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ulysses.attention.copy_engine import CollectiveTransport
from lightning_ulysses.parallel.layout import ShardOrder


# The transport of every exchange not handed one: `all_to_all_single` (stateless, so one serves every group).
COLLECTIVE = CollectiveTransport()


class _Exchange:
    """What the start and finish nodes of one all-to-all share: the group, the dimensions, the transport and the
    exchange in flight (forward, then backward, whose receive buffer waits here for `_Start.backward`)."""

    def __init__(self, group, split_dim: int, join_dim: int, transport):
        self.group, self.split_dim, self.join_dim = group, split_dim, join_dim
        self.size = dist.get_world_size(group)
        self.transport = transport
        self.work = self.send = self.receive = None

    def launch(self, tensor: torch.Tensor, split_dim: int) -> torch.Tensor:
        join_dim = self.join_dim if split_dim == self.split_dim else self.split_dim
        self.work, send, receive = self.transport.launch(tensor, self.group, self.size, split_dim, join_dim)
        self.send = send  # kept alive until the transfer is done with it
        return receive

    def wait(self) -> None:
        self.work.wait()
        self.work = self.send = None

    def take_receive(self) -> torch.Tensor:
        """The backward exchange's receive buffer, once it has arrived (the exchange lets go of it)."""
        self.wait()
        receive, self.receive = self.receive, None
        return receive

    def join(self, receive: torch.Tensor, join_dim: int) -> torch.Tensor:
        """What arrived, in the joined layout (the collective transport lays it out here, a copy transport's
        buffer already is)."""
        return self.transport.join(receive, join_dim)


class _Start(torch.autograd.Function):
    # Output: the receive buffer, still being written; `_Finish` is its only reader.
    @staticmethod
    def forward(ctx, tensor, exchange: _Exchange):
        ctx.exchange = exchange
        return exchange.launch(tensor, exchange.split_dim)

    @staticmethod
    def backward(ctx, _placeholder):
        # The gradient of what this rank sent is the backward exchange's receive buffer, which `_Finish.backward`
        # left on the exchange (the engine only ever saw a placeholder: it may read what it is handed, e.g. the
        # anomaly mode's NaN check, while the transfer is still landing).
        exchange = ctx.exchange
        return exchange.join(exchange.take_receive(), exchange.split_dim).contiguous(), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, receive, exchange: _Exchange):
        ctx.exchange, ctx.receive_shape = exchange, receive.shape
        exchange.wait()
        output = exchange.join(receive, exchange.join_dim).contiguous()
        # A fresh tensor even when the layout needs no copy: an output aliasing an input of a custom Function
        # could not be modified in place, and then only for some shapes.
        return output.clone() if output.data_ptr() == receive.data_ptr() else output

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all is the all-to-all with the roles of the two dimensions swapped; it is
        # launched here and waited for by `_Start.backward`, so the gradient's exchange overlaps what runs between.
        exchange = ctx.exchange
        exchange.receive = exchange.launch(grad, exchange.join_dim)
        # (the forward receive's shape: a copy transport receives in the joined layout, whose shape differs by
        # direction)
        return grad.new_zeros(()).expand(ctx.receive_shape), None


class InFlightExchange:
    """An all-to-all started by `start_exchange`; `finish()` waits and returns the exchanged tensor."""

    def __init__(self, exchange: _Exchange | None, payload: torch.Tensor):
        self._exchange, self._payload = exchange, payload

    def finish(self) -> torch.Tensor:
        # Let go of the receive buffer: once laid out it is garbage (callers keep the in-flight handles in lists).
        payload, self._payload = self._payload, None
        if self._exchange is None:  # a group of one rank: nothing moved
            return payload
        return _Finish.apply(payload, self._exchange)


def start_exchange(tensor: torch.Tensor, group, split_dim: int, join_dim: int, transport=None) -> InFlightExchange:
    """Start an all-to-all of `tensor` over `group`: it is cut into P pieces along `split_dim`, piece p goes to rank
    p, and what arrives from the P ranks is joined along `join_dim` (in rank order); every rank sends the same
    shape. Nothing waits until `finish()`: work issued in between overlaps the transfer.

    `transport`: how the bytes move (`copy_engine.py`; the strategy's choice travels on the prepared model's
    binding); None: the collective all-to-all."""
    if group is None or dist.get_world_size(group) == 1:
        return InFlightExchange(None, tensor)
    size = dist.get_world_size(group)
    if tensor.size(split_dim) % size != 0:
        raise ValueError(
            f"all-to-all: dimension {split_dim} of size {tensor.size(split_dim)} is not divisible by the"
            f" sequence-parallel size {size}"
        )
    exchange = _Exchange(group, split_dim, join_dim, COLLECTIVE if transport is None else transport)
    return InFlightExchange(exchange, _Start.apply(tensor, exchange))


def all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int, transport=None) -> torch.Tensor:
    """Split `tensor` along `scatter_dim` over the ranks of `group` and concatenate what arrives along `gather_dim`."""
    return start_exchange(tensor, group, scatter_dim, gather_dim, transport).finish()


def sequence_to_heads(tensor: torch.Tensor, group, head_dim: int, seq_dim: int, transport=None) -> torch.Tensor:
    """`[.. heads .. seq/P ..]` → `[.. heads/P .. seq ..]`: all tokens of this rank's share of the heads."""
    return all_to_all(tensor, group, scatter_dim=head_dim, gather_dim=seq_dim, transport=transport)


def heads_to_sequence(tensor: torch.Tensor, group, head_dim: int, seq_dim: int, transport=None) -> torch.Tensor:
    """`[.. heads/P .. seq ..]` → `[.. heads .. seq/P ..]`: the inverse of `sequence_to_heads`."""
    return all_to_all(tensor, group, scatter_dim=seq_dim, gather_dim=head_dim, transport=transport)


def all_gather_sequence(tensor: torch.Tensor, group, seq_dim: int, order: ShardOrder | None = None) -> torch.Tensor:
    """Concatenate the sequence shards of a tensor that needs no gradient (masks, positions).

    `order`: how the shards were cut (`SequenceParallelGroups.shard_order`); the zig-zag layout of a ring is put
    back into natural order. None: contiguous shards.
    """
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    gathered = torch.cat(pieces, dim=seq_dim)
    return gathered if order is None else order.restore(gathered, seq_dim)
