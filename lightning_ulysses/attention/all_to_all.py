"""The all-to-all that trades "my tokens, all heads" for "all tokens, my heads", with an exact backward.

We write our own instead of `torch.distributed.nn.functional` or DeepSpeed's `_SeqAllToAll` because the SP
group is usually smaller than the world (torch's autograd collectives have mixed up group-local and global
ranks there) and because one generic (scatter_dim, gather_dim) op serves both Hugging Face's
`[batch, heads, seq, dim]` inputs and its `[batch, seq, heads, dim]` outputs without extra transposes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ulysses.layout import ShardOrder


class AllToAllInFlight:
    """An all-to-all started with `start_all_to_all`; `wait()` returns the result (no autograd)."""

    def __init__(self, work, send: torch.Tensor, receive: torch.Tensor, gather_dim: int):
        self.work, self.send, self.receive, self.gather_dim = work, send, receive, gather_dim

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.send = None  # kept alive until the collective is done with it
        return torch.cat(self.receive.unbind(0), dim=self.gather_dim)


def start_all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> AllToAllInFlight:
    """Start the all-to-all asynchronously (on GPU it runs on the communicator's stream, beside compute)."""
    world_size = dist.get_world_size(group)
    if tensor.size(scatter_dim) % world_size != 0:
        raise ValueError(
            f"all-to-all: dimension {scatter_dim} of size {tensor.size(scatter_dim)} is not divisible by the"
            f" sequence-parallel size {world_size}"
        )
    # Chunk i goes to rank i; chunk i received comes from rank i, i.e. the i-th piece along `gather_dim`.
    send = torch.stack(tensor.chunk(world_size, dim=scatter_dim))
    receive = torch.empty_like(send)
    work = dist.all_to_all_single(receive, send, group=group, async_op=True)
    return AllToAllInFlight(work, send, receive, gather_dim)


def _all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return start_all_to_all(tensor, group, scatter_dim, gather_dim).wait()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad_output):
        # The adjoint of an all-to-all is the all-to-all with the roles of the two dimensions swapped.
        return _all_to_all(grad_output, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `tensor` along `scatter_dim` over the ranks of `group` and concatenate what arrives along `gather_dim`."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _AllToAll.apply(tensor, group, scatter_dim, gather_dim)


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
