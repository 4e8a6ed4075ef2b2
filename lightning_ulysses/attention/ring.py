"""Ring attention: exact softmax attention over a sequence whose tokens are spread over a ring of ranks.

Each ring rank keeps its queries and passes its K/V block to the next rank, `ring_size − 1` times; every block
it sees is attended with a fused kernel that also returns the rows' log-sum-exp, and the partial outputs are
merged with the online-softmax rule (`out = Σ_b exp(lse_b − lse)·out_b`, `lse = log Σ_b exp(lse_b)`).

Backward is a custom autograd Function, not autograd through the forward loop: autograd would keep every
visiting K/V block and every partial output alive until backward (memory growing with the ring size). Ours
keeps only the local q, k, v, the merged output and the log-sum-exp — what one fused attention keeps — and
re-runs each block's backward kernel with the *final* output and log-sum-exp, which gives exactly that block's
share of dq, dk and dv (the flash-attention backward identity). dK/dV accumulators travel around the ring with
their K/V block and take one last hop home.

Causal masking follows the global positions of the zig-zag layout (`layout.ShardOrder`): ring rank r holds
chunks r and 2R−1−r of the 2R chunks of the sequence. Then, for the block that came from ring rank j:
j == r is ordinary causal attention (the local positions increase); j < r: all local queries see the first chunk
of the block and none the second; j > r: only the second local chunk sees the block, all of it. Every step after
the first is therefore exactly half a block of unmasked work on every rank — balanced, and no mask tensor.

Communication is point-to-point (`batch_isend_irecv`) to the next rank, issued before the current block's
compute so that it overlaps it (on GPU, NCCL runs it on its own stream).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from lightning_ulysses.attention import fa4
from lightning_ulysses.attention.backends import fa4_first_for
from lightning_ulysses.fences import _torch_private as torch_private

def sdpa_kernel_order() -> tuple[str, ...]:
    """The fused SDPA kernels enabled now, in the priority torch tries them (under the strategy's
    `sdpa_kernel_priority` its order), by the names `sdpa_kernel_priority` takes."""
    from torch.nn.attention import SDPBackend

    enabled = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled()}
    # torch's private getter; without it (an older torch), torch's default order, flash before cuDNN
    order = (torch_private.sdp_priority_order() if torch_private.has_sdp_priority_order()
             else [int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)])
    names = {int(SDPBackend.CUDNN_ATTENTION): "cudnn", int(SDPBackend.FLASH_ATTENTION): "flash"}
    return tuple(names[value] for value in order if value in names and enabled[names[value]])


def block_kernel_kind(device_type: str, dtype: torch.dtype, order: tuple[str, ...]) -> str:
    """Which fused kernel attends the ring's blocks: the first of cuDNN and flash in SDPA's `order` on CUDA in
    fp16/bf16 (flash when neither is enabled: what the ring always used), memory-efficient in fp32, flash on CPU."""
    if device_type == "cpu":
        return "cpu_flash"
    if device_type != "cuda":
        raise NotImplementedError(f"ring attention runs on CPU and CUDA tensors, got a {device_type} tensor")
    if dtype not in (torch.float16, torch.bfloat16):
        return "cuda_efficient"
    return "cuda_cudnn" if order[:1] == ("cudnn",) else "cuda_flash"


def lse_from_cudnn(lse: torch.Tensor) -> torch.Tensor:
    """cuDNN's log-sum-exp `[batch, heads, rows, 1]` (torch's meta registration; older torch: `[batch, heads,
    rows]`) → the ring's `[batch, heads, rows]`. The values are flash's: natural log, softmax scale included
(measured on an H200, torch 2.11, cuDNN 9.19; there also fp32 and contiguous).
    Only the trailing 1 is dropped: `squeeze(-1)` would also drop the rows of a one-row block."""
    return lse[..., 0] if lse.dim() == 4 else lse


def lse_to_cudnn(lse: torch.Tensor, kernel_dim: int) -> torch.Tensor:
    """The ring's merged `[batch, heads, rows]` log-sum-exp (a row slice of it, so strided) → what cuDNN's backward
    reads: contiguous, with the trailing 1 when its forward returned one (`kernel_dim` 4)."""
    lse = lse.contiguous()
    return lse.unsqueeze(-1) if kernel_dim == 4 else lse


# aten's cuDNN ops, looked up here so that CPU tests can stand in for them (they only run on CUDA)
_cudnn_forward = torch_private.SDPA_CUDNN
_cudnn_backward = torch_private.SDPA_CUDNN_BACKWARD
_log = logging.getLogger("lightning.pytorch.ulysses")
# (device, dtype, heads, kv_heads, head_dim) → (kind, whether cuDNN takes the KV heads unrepeated), per process
_decided: dict[tuple, tuple[str, bool]] = {}


class BlockAttentionKernel:
    """Forward and backward of softmax attention on one (query rows × key block), with the rows' log-sum-exp.

    q: `[batch, heads, rows, dim]`, k/v: `[batch, kv_heads, cols, dim]`; the ring passes only the model's own KV
    heads around. The kernel is FlashAttention-4's (`attention/fa4.py`) where the strategy's `sdpa_kernel_priority`
    puts "fa4" first and FA4 serves the call; else PyTorch's own fused SDPA kernel for the device, dtype and SDPA
    priority (`block_kernel_kind`): cuDNN (CUDA fp16/bf16 with cuDNN first, e.g. `sdpa_kernel_priority="auto"` on
    Hopper without FA4), flash (CPU any dtype; CUDA fp16/bf16 otherwise) or memory-efficient (CUDA fp32). KV heads
    are repeated up to the query heads per block, except for FA4 and cuDNN, which take them as they are.
    """

    def __init__(self, kind: str, scale: float | None, native_gqa: bool = False):
        self.kind, self.scale = kind, scale
        self.native_gqa = native_gqa  # the kernel takes fewer KV heads than query heads
        # What the CUDA kernels' backward wants back from their forward: (cum_seq_q, cum_seq_k, max_q, max_k, seed,
        # offset) for flash, (seed, offset) for efficient and cuDNN. Without dropout and for dense inputs the backward
        # reads none of them; it only needs well-formed values, the same for every block.
        self._extras: tuple = ()
        self._lse_dim = 3  # cuDNN: the dimensions of the log-sum-exp its forward returned

    @classmethod
    def for_inputs(cls, query: torch.Tensor, key: torch.Tensor, scale: float | None, group=None):
        """The kernel for these inputs under the SDPA priority in force: FlashAttention-4 where the order puts it
        first and it serves the call (`backends.fa4_first_for`: the same on every rank, which run the same dtype and
        head dim), cuDNN as `_decide_cudnn` settles it."""
        # (fa4_serves checks the device; the ring's blocks run in the queries' own dtype, never autocast's)
        if query.dtype in (torch.float16, torch.bfloat16) and fa4_first_for(query):
            return cls("cuda_fa4", scale, native_gqa=True)
        kind = block_kernel_kind(query.device.type, query.dtype, sdpa_kernel_order())
        if kind != "cuda_cudnn":
            return cls(kind, scale)
        kind, native_gqa = _decide_cudnn(query, key, scale, group)
        return cls(kind, scale, native_gqa)

    def _repeat_kv(self, tensor: torch.Tensor, heads: int) -> torch.Tensor:
        groups = heads // tensor.size(1)
        return tensor if groups == 1 or self.native_gqa else tensor.repeat_interleave(groups, dim=1)

    @staticmethod
    def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
        if grad.size(1) == kv_heads:
            return grad
        return grad.unflatten(1, (kv_heads, grad.size(1) // kv_heads)).sum(dim=2)

    def forward(self, q, k, v, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._repeat_kv(k, q.size(1)), self._repeat_kv(v, q.size(1))
        if self.kind == "cpu_flash":
            out, lse = torch_private.SDPA_FLASH_FOR_CPU(q, k, v, 0.0, is_causal, scale=self.scale)
        elif self.kind == "cuda_fa4":  # [batch, rows, heads, dim] in and out; the KV heads as they are
            out, lse = fa4.block_forward(*(t.transpose(1, 2) for t in (q, k, v)), self.scale, is_causal)
            out = out.transpose(1, 2)
        elif self.kind == "cuda_cudnn":
            out, lse, _, _, _, _, seed, offset, _ = _cudnn_forward(q, k, v, None, True, 0.0, is_causal, False,
                                                                   scale=self.scale)
            self._extras, self._lse_dim = (seed, offset), lse.dim()
            lse = lse_from_cudnn(lse)
        elif self.kind == "cuda_flash":
            out, lse, *extras = torch_private.SDPA_FLASH(q, k, v, 0.0, is_causal, False, scale=self.scale)
            self._extras = tuple(extras[:6])
        else:
            out, lse, *extras = torch_private.SDPA_EFFICIENT(
                q, k, v, None, True, 0.0, is_causal, scale=self.scale
            )
            self._extras = tuple(extras)
            lse = lse[..., : q.size(2)]  # the kernel pads the log-sum-exp rows to a multiple of 32
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, is_causal: bool):
        kv_heads = k.size(1)
        k, v = self._repeat_kv(k, q.size(1)), self._repeat_kv(v, q.size(1))
        lse = lse.contiguous()
        if self.kind == "cpu_flash":
            dq, dk, dv = torch_private.SDPA_FLASH_FOR_CPU_BACKWARD(
                grad_out, q, k, v, out, lse, 0.0, is_causal, scale=self.scale
            )
        elif self.kind == "cuda_fa4":
            dq, dk, dv = (g.transpose(1, 2) for g in fa4.block_backward(
                *(t.transpose(1, 2) for t in (q, k, v, out)), grad_out.transpose(1, 2), lse, self.scale, is_causal))
        elif self.kind == "cuda_cudnn":
            seed, offset = self._extras
            dq, dk, dv = _cudnn_backward(grad_out, q, k, v, out, lse_to_cudnn(lse, self._lse_dim), seed, offset, None,
                                         None, None, q.size(2), k.size(2), 0.0, is_causal, scale=self.scale)
        elif self.kind == "cuda_flash":
            cum_q, cum_k, max_q, max_k, seed, offset = self._extras
            dq, dk, dv = torch_private.SDPA_FLASH_BACKWARD(
                grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=self.scale
            )
        else:
            padded = -(-lse.size(-1) // 32) * 32  # back to the kernel's own padded row count
            lse = torch.nn.functional.pad(lse, (0, padded - lse.size(-1)))
            seed, offset = self._extras
            dq, dk, dv, _ = torch_private.SDPA_EFFICIENT_BACKWARD(
                grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], is_causal,
                scale=self.scale,
            )
        return dq, self._sum_kv(dk, kv_heads), self._sum_kv(dv, kv_heads)


def _cudnn_runs(query: torch.Tensor, key: torch.Tensor, scale: float | None, native_gqa: bool) -> bool:
    """Whether cuDNN runs the ring's three block shapes (causal square, all rows × the first half of the columns,
    the second half of the rows × all columns) forward and backward at these heads, head dim and dtype, on small
    blocks of zeros (no random draws: the caller's RNG stream stays as it was)."""
    kernel = BlockAttentionKernel("cuda_cudnn", scale, native_gqa)
    q = torch.zeros(1, query.size(1), 128, query.size(-1), dtype=query.dtype, device=query.device)
    k = v = torch.zeros(1, key.size(1), 128, query.size(-1), dtype=query.dtype, device=query.device)
    try:
        for rows, columns, causal in ((slice(0, 128), slice(0, 128), True), (slice(0, 128), slice(0, 64), False),
                                      (slice(64, 128), slice(0, 128), False)):
            out, lse = kernel.forward(q[:, :, rows], k[:, :, columns], v[:, :, columns], causal)
            kernel.backward(torch.ones_like(out), q[:, :, rows], k[:, :, columns], v[:, :, columns], out, lse, causal)
    except RuntimeError:  # what a refused shape raises (torch's checks and cuDNN's own)
        return False
    return True


def _decide_cudnn(query: torch.Tensor, key: torch.Tensor, scale: float | None, group) -> tuple[str, bool]:
    """(kind, native_gqa) for cuDNN-first blocks, once per process and shape: cuDNN with the KV heads as they are if
    it takes them, else repeated, else flash. The ring's ranks agree on the least any of them can run, so all run
    the same kernel; one log line (global rank 0) says which."""
    grouped = query.size(1) != key.size(1)
    signature = (query.device, query.dtype, query.size(1), key.size(1), query.size(-1))
    if signature not in _decided:
        # 2: cuDNN, KV heads unrepeated; 1: cuDNN, KV heads repeated (or none to repeat); 0: flash
        level = 2 if grouped and _cudnn_runs(query, key, scale, True) else int(_cudnn_runs(query, key, scale, False))
        if group is not None and dist.get_world_size(group) > 1:
            agreed = torch.tensor([level], device=query.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
            level = int(agreed.item())
        _decided[signature] = ("cuda_cudnn", level == 2) if level else ("cuda_flash", False)
        if not dist.is_initialized() or dist.get_rank() == 0:
            what = {2: "cuDNN, KV heads unrepeated", 1: "cuDNN" + (", KV heads repeated" if grouped else ""),
                    0: "flash (cuDNN refused these blocks)"}[level]
            _log.info(f"lightning_ulysses: ring attention blocks ({query.size(1)} heads, {key.size(1)} KV heads, head"
                      f" dim {query.size(-1)}, {str(query.dtype).removeprefix('torch.')}) run on {what}.")
    return _decided[signature]


class _RingExchange:
    """Send a tensor to the next ring rank and receive the previous rank's, asynchronously."""

    def __init__(self, group):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def shift(self, tensor: torch.Tensor) -> _InFlight:
        if self.size == 1:  # the next rank is this one
            return _InFlight([], tensor, tensor)
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        operations = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size),
        ]
        return _InFlight(dist.batch_isend_irecv(operations), tensor, received)


class _InFlight:
    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor):
        self.works, self.sent, self.received = works, sent, received  # `sent` stays alive until the send is done

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def _block_rows_and_columns(step: int, rank: int, size: int, length: int, is_causal: bool):
    """Which local query rows see which columns of the K/V block held at `step`, and whether causally.

    The block held at step i came from ring rank (rank − i) mod size (see the module docstring for the cases).
    """
    everything = slice(0, length)
    if not is_causal:
        return everything, everything, False
    if step == 0:
        return everything, everything, True
    half = length // 2
    if (rank - step) % size < rank:
        return everything, slice(0, half), False
    return slice(half, length), everything, False


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online softmax: fold one block's normalised output and log-sum-exp into the running ones, in place."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, is_causal: bool, scale: float | None):
        ring = _RingExchange(group)
        kernel = BlockAttentionKernel.for_inputs(query, key, scale, group)
        length = query.size(2)
        if is_causal and ring.size > 1 and (length % 2 or key.size(2) != length):
            raise ValueError(
                f"causal ring attention needs the zig-zag layout: equal query and key lengths, even; got {length}"
                f" queries and {key.size(2)} keys per rank. Shard batches with SequenceSharder(..., ring_size=...)."
            )
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        lse = torch.full(query.shape[:-1], float("-inf"), dtype=torch.float32, device=query.device)
        key_value = torch.stack([key, value])  # one message per ring step
        for step in range(ring.size):
            incoming = ring.shift(key_value) if step + 1 < ring.size else None
            rows, columns, causal = _block_rows_and_columns(step, ring.rank, ring.size, length, is_causal)
            block_out, block_lse = kernel.forward(
                query[:, :, rows], key_value[0][:, :, columns], key_value[1][:, :, columns], causal
            )
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if incoming is not None:
                key_value = incoming.wait()
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.is_causal, ctx.kernel = group, is_causal, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        ring = _RingExchange(ctx.group)
        grad_out = grad_out.contiguous()
        length = query.size(2)
        grad_query = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        key_value = torch.stack([key, value])
        returning: _InFlight | None = None  # the dK/dV accumulator of the block we are about to work on
        for step in range(ring.size):
            incoming = ring.shift(key_value) if step + 1 < ring.size else None
            rows, columns, causal = _block_rows_and_columns(step, ring.rank, ring.size, length, ctx.is_causal)
            dq, dk, dv = ctx.kernel.backward(
                grad_out[:, :, rows], query[:, :, rows], key_value[0][:, :, columns], key_value[1][:, :, columns],
                out[:, :, rows], lse[:, :, rows], causal,
            )
            grad_query[:, :, rows] += dq
            # The block's accumulator arrives from the previous rank while this block's kernels run.
            grad_key_value = returning.wait() if returning is not None else torch.zeros(
                key_value.shape, dtype=torch.float32, device=key.device)
            grad_key_value[0][:, :, columns] += dk
            grad_key_value[1][:, :, columns] += dv
            returning = ring.shift(grad_key_value)  # after the last step: one more hop, home to the block's owner
            if incoming is not None:
                key_value = incoming.wait()
        grad_key_value = returning.wait()
        return grad_query.to(query.dtype), grad_key_value[0].to(key.dtype), grad_key_value[1].to(value.dtype), None, None, None


def ring_attention(query, key, value, ring_group, is_causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Softmax attention of this ring rank's queries over the keys of the whole ring, exact, with backward.

    q: `[batch, heads, tokens, dim]`, k/v: `[batch, kv_heads, tokens, dim]` (`heads % kv_heads == 0`): this ring
    rank's tokens, in the zig-zag layout when causal (`layout.ShardOrder`). Returns `[batch, heads, tokens, dim]`.
    `ring_group` None (or of one rank) is plain fused attention on the local tokens.
    """
    if query.size(1) % key.size(1) != 0:
        raise ValueError(f"query heads ({query.size(1)}) must be a multiple of KV heads ({key.size(1)})")
    return _RingAttention.apply(query, key, value, ring_group, is_causal, scale)
