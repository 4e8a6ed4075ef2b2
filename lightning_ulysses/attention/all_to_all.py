"""The all-to-all that trades "my tokens, all heads" for "all tokens, my heads", with an exact backward.

We write our own instead of `torch.distributed.nn.functional` or DeepSpeed's `_SeqAllToAll` because the SP
group is usually smaller than the world (torch's autograd collectives have mixed up group-local and global
ranks there) and because one generic (split_dim, join_dim) exchange serves both Hugging Face's
`[batch, heads, seq, dim]` inputs and its `[batch, seq, heads, dim]` outputs without extra transposes.

An exchange is two autograd nodes, `start_exchange` (pack every tensor into one buffer, launch one all-to-all
without waiting) and `InFlightExchange.finish` (wait, unpack), so that work issued between the two runs while
the bytes travel (on GPU, NCCL's own stream beside the compute stream). Backward mirrors it: the finish node
launches the reverse all-to-all of the gradients, the start node waits for it. Several tensors (q, k and v) go
in one collective: one launch and one set of bigger messages instead of three.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ulysses.layout import ShardOrder


class _Exchange:
    """What the start and finish nodes of one all-to-all share: the group, the layout of the tensors in the
    packed buffer, and the collective in flight (forward, then backward)."""

    def __init__(self, group, split_dim: int, join_dim: int, shapes: Sequence[torch.Size]):
        self.group, self.split_dim, self.join_dim = group, split_dim, join_dim
        self.size = dist.get_world_size(group)
        self.shapes = [torch.Size(shape) for shape in shapes]  # of the tensors sent (the same on every rank)
        self.pieces = [_divided(shape, split_dim, self.size) for shape in self.shapes]
        self.widths = [math.prod(piece) for piece in self.pieces]
        self.work = self.send = None

    def launch(self, send: torch.Tensor) -> torch.Tensor:
        receive = torch.empty_like(send)
        self.work = dist.all_to_all_single(receive, send, group=self.group, async_op=True)
        self.send = send  # kept alive until the collective is done with it
        return receive

    def wait(self) -> None:
        self.work.wait()
        self.work = self.send = None

    def pack(self, tensors, split_dim: int) -> torch.Tensor:
        """Row p of the buffer: the p-th piece (along `split_dim`) of every tensor, flattened, one after another."""
        first = tensors[0]
        send = torch.empty(self.size, sum(self.widths), dtype=first.dtype, device=first.device)
        offset = 0
        for tensor, width in zip(tensors, self.widths):
            pieces = tensor.unflatten(split_dim, (self.size, -1)).movedim(split_dim, 0)
            send[:, offset:offset + width].view(pieces.shape).copy_(pieces)
            offset += width
        return send

    def unpack(self, buffer: torch.Tensor, piece_shapes, join_dim: int) -> list[torch.Tensor]:
        """Inverse layout of `pack`: row p holds the p-th piece along `join_dim` of every tensor."""
        tensors, offset = [], 0
        for piece, width in zip(piece_shapes, self.widths):
            pieces = buffer[:, offset:offset + width].view(self.size, *piece)
            whole = list(piece)
            whole[join_dim] *= self.size
            tensor = buffer.new_empty(whole)
            tensor.unflatten(join_dim, (self.size, -1)).copy_(pieces.movedim(0, join_dim))
            tensors.append(tensor)
            offset += width
        return tensors


def _divided(shape: torch.Size, dim: int, size: int) -> list[int]:
    piece = list(shape)
    piece[dim] //= size
    return piece


class _Start(torch.autograd.Function):
    # Output: the receive buffer, still being written. Its "gradient", handed from `_Finish.backward`, is the
    # receive buffer of the backward exchange (the gradient of what this rank sent): only `_Finish` reads it.
    @staticmethod
    def forward(ctx, exchange: _Exchange, *tensors):
        ctx.exchange = exchange
        return exchange.launch(exchange.pack(tensors, exchange.split_dim))

    @staticmethod
    def backward(ctx, grad_receive):
        exchange = ctx.exchange
        exchange.wait()
        return (None, *exchange.unpack(grad_receive, exchange.pieces, exchange.split_dim))


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, receive, exchange: _Exchange):
        ctx.exchange = exchange
        exchange.wait()
        return tuple(exchange.unpack(receive, exchange.pieces, exchange.join_dim))

    @staticmethod
    def backward(ctx, *grads):
        # The adjoint of an all-to-all is the all-to-all with the roles of the two dimensions swapped; it is
        # launched here and waited for by `_Start.backward`, so the gradients' exchange overlaps what runs between.
        exchange = ctx.exchange
        return exchange.launch(exchange.pack(grads, exchange.join_dim)), None


class InFlightExchange:
    """An all-to-all started by `start_exchange`; `finish()` waits and returns the exchanged tensors."""

    def __init__(self, exchange: Optional[_Exchange], payload):
        self._exchange, self._payload = exchange, payload

    def finish(self) -> tuple[torch.Tensor, ...]:
        if self._exchange is None:  # a group of one rank: nothing moved
            return tuple(self._payload)
        return _Finish.apply(self._payload, self._exchange)


def start_exchange(tensors: Sequence[torch.Tensor], group, split_dim: int, join_dim: int) -> InFlightExchange:
    """Start one all-to-all of all `tensors` over `group`: each is cut into P pieces along `split_dim`, piece p goes
    to rank p, and what arrives from the P ranks is joined along `join_dim` (in rank order). The tensors may differ
    in shape (q and GQA's smaller k, v) but must agree in dtype and device; every rank sends the same shapes.
    Nothing waits until `finish()`: work issued in between overlaps the transfer."""
    if group is None or dist.get_world_size(group) == 1:
        return InFlightExchange(None, tensors)
    size = dist.get_world_size(group)
    for tensor in tensors:
        if tensor.size(split_dim) % size != 0:
            raise ValueError(
                f"all-to-all: dimension {split_dim} of size {tensor.size(split_dim)} is not divisible by the"
                f" sequence-parallel size {size}"
            )
    exchange = _Exchange(group, split_dim, join_dim, [tensor.shape for tensor in tensors])
    return InFlightExchange(exchange, _Start.apply(exchange, *tensors))


def all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `tensor` along `scatter_dim` over the ranks of `group` and concatenate what arrives along `gather_dim`."""
    return start_exchange([tensor], group, scatter_dim, gather_dim).finish()[0]


def sequence_to_heads(tensor: torch.Tensor, group, head_dim: int, seq_dim: int) -> torch.Tensor:
    """`[.. heads .. seq/P ..]` → `[.. heads/P .. seq ..]`: all tokens of this rank's share of the heads."""
    return all_to_all(tensor, group, scatter_dim=head_dim, gather_dim=seq_dim)


def heads_to_sequence(tensor: torch.Tensor, group, head_dim: int, seq_dim: int) -> torch.Tensor:
    """`[.. heads/P .. seq ..]` → `[.. heads .. seq/P ..]`: the inverse of `sequence_to_heads`."""
    return all_to_all(tensor, group, scatter_dim=seq_dim, gather_dim=head_dim)


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
