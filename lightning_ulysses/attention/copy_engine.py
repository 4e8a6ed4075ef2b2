"""Copy-engine exchanges: the Ulysses all-to-all as direct copies into the peers' receive buffers, permute fused.

NCCL's all-to-all runs as kernels on the SMs, so beside a compute-bound attention kernel it slows that kernel by
about the time they overlap (`benchmarks/results/2026-11-29-h200x2-overlap/`). Here each rank writes the piece
of its tensor that a peer needs straight into that peer's receive buffer (torch symmetric memory, mapped into
every rank of the group), at the offset and strides where it belongs in the *joined* layout: the layout permute
happens inside the copies and nothing is laid out after arrival. Strided blocks of contiguous rows are what the
GPU's copy engines execute without SMs.

`plan_exchange` is the pure part (shape, dimensions, group size, rank → one `PeerCopy` per peer); two transports
execute the same plan: `SymmetricMemoryTransport` (CUDA) and `EmulatedCopyTransport` (CPU/gloo, tests only: it
runs every index computation of the plan through one gloo all-to-all). `CollectiveTransport` is the
`all_to_all_single` path (NCCL on GPUs, gloo on CPU). Which one runs: `choose_exchange`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist
from lightning_ulysses.fences import _torch_private as torch_private

_log = logging.getLogger(__name__)

Exchange = Literal["auto", "nccl", "copy_engine"]
EXCHANGES = ("auto", "nccl", "copy_engine")

# NVLink multicast stays off (see README of the device machines): the copy engine path requires these as set,
# and never sets them itself (child processes inherit the environment they were started with).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# -- the plan ---------------------------------------------------------------------------------------------------
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class PeerCopy:
    """One copy of a plan: `sizes` elements read from the source at `source_offset` with `source_strides`, written
    into peer `peer`'s receive buffer at `destination_offset` with `destination_strides` (element units, offsets
    relative to the start of the source view and of the receive buffer)."""

    peer: int
    sizes: tuple[int, ...]
    source_offset: int
    source_strides: tuple[int, ...]
    destination_offset: int
    destination_strides: tuple[int, ...]

    def blocks(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(sizes, source strides, destination strides) with every pair of dimensions that is contiguous in both
        merged: the copies the hardware sees (one dimension: one memcpy; two with a unit last stride: one 2-D
        strided memcpy, i.e. `cudaMemcpy2DAsync`; more: that many 2-D copies per outer index)."""
        dims = [(n, s, d) for n, s, d in zip(self.sizes, self.source_strides, self.destination_strides) if n != 1]
        merged: list[tuple[int, int, int]] = []
        for n, s, d in dims:
            if merged and merged[-1][1] == n * s and merged[-1][2] == n * d:
                outer = merged.pop()
                n *= outer[0]
            merged.append((n, s, d))
        merged = merged or [(1, 1, 1)]
        return tuple(m[0] for m in merged), tuple(m[1] for m in merged), tuple(m[2] for m in merged)


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """What rank `rank` copies where: `copies[p]` goes to rank p. `output_shape` is the joined tensor every rank
    receives (contiguous), which is exactly `_Exchange`'s result."""

    output_shape: tuple[int, ...]
    copies: tuple[PeerCopy, ...]


def plan_exchange(shape, source_strides, split_dim: int, join_dim: int, size: int, rank: int) -> ExchangePlan:
    """The all-to-all of `_Exchange` as copies: piece p of the source along `split_dim` goes to rank p, where it is
    the `rank`-th piece along `join_dim` of a contiguous `output_shape` tensor."""
    shape, source_strides = tuple(shape), tuple(source_strides)
    if shape[split_dim] % size:
        raise ValueError(f"copy exchange: dimension {split_dim} of size {shape[split_dim]} is not divisible by {size}")
    piece = list(shape)
    piece[split_dim] //= size
    output = list(piece)
    output[join_dim] *= size
    output_strides = contiguous_strides(tuple(output))
    copies = tuple(
        PeerCopy(peer, tuple(piece), peer * piece[split_dim] * source_strides[split_dim], source_strides,
                 rank * piece[join_dim] * output_strides[join_dim], output_strides)
        for peer in range(size))
    return ExchangePlan(tuple(output), copies)


# The plan's views as torch strided tensors: the reference `block_copies` is tested against.
def source_view(tensor: torch.Tensor, copy: PeerCopy) -> torch.Tensor:
    return tensor.as_strided(copy.sizes, copy.source_strides, tensor.storage_offset() + copy.source_offset)


def destination_view(buffer: torch.Tensor, copy: PeerCopy) -> torch.Tensor:
    return buffer.as_strided(copy.sizes, copy.destination_strides, buffer.storage_offset() + copy.destination_offset)


@dataclasses.dataclass(frozen=True)
class Copy2D:
    """One `cudaMemcpy2DAsync`: `height` rows of `width` bytes, row i read at `source_offset + i·source_pitch` and
    written at `destination_offset + i·destination_pitch` (bytes from the start of the source view / buffer)."""

    source_offset: int
    source_pitch: int
    destination_offset: int
    destination_pitch: int
    width: int
    height: int


def copies_2d(copy: PeerCopy, element_size: int) -> list[Copy2D]:
    """`copy` as the 2-D memcpys the copy engines run: rows are the merged contiguous last dimension (one element
    wide when the last dimension is strided), the next dimension is the rows' pitch, the outer ones a loop."""
    sizes, source_strides, destination_strides = copy.blocks()
    if source_strides[-1] == destination_strides[-1] == 1:
        width, sizes = sizes[-1] * element_size, sizes[:-1]
        source_strides, destination_strides = source_strides[:-1], destination_strides[:-1]
    else:
        width = element_size
    if not sizes:  # one contiguous block: one row (cudaMemcpy2DAsync wants pitches of at least the width)
        sizes, source_strides, destination_strides = (1,), (width // element_size,), (width // element_size,)
    height, source_pitch, destination_pitch = sizes[-1], source_strides[-1], destination_strides[-1]
    calls = []
    for index in range(math.prod(sizes[:-1])):
        source, destination, rest = copy.source_offset, copy.destination_offset, index
        for n, step, target in reversed(list(zip(sizes[:-1], source_strides[:-1], destination_strides[:-1]))):
            rest, i = divmod(rest, n)
            source, destination = source + i * step, destination + i * target
        calls.append(Copy2D(source * element_size, source_pitch * element_size, destination * element_size,
                            destination_pitch * element_size, width, height))
    return calls


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as bytes, starting at the tensor's first element."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
    return raw[tensor.storage_offset() * tensor.element_size():]


def block_copies(destination: torch.Tensor, source: torch.Tensor, copy: PeerCopy) -> None:
    """`destination_view(destination).copy_(source_view(source))` as `copies_2d`'s calls, each run as a strided
    byte copy: what the copy engines would do, on any device (CPU: the tests' emulation)."""
    into, read = _bytes(destination), _bytes(source)
    for call in copies_2d(copy, source.element_size()):
        rows = (call.height, call.width)
        into.as_strided(rows, (call.destination_pitch, 1), into.storage_offset() + call.destination_offset).copy_(
            read.as_strided(rows, (call.source_pitch, 1), read.storage_offset() + call.source_offset))


def _cudart():
    """The CUDA runtime torch loaded (its `cudaMemcpy2DAsync`; torch exposes no 2-D copy), or None."""
    import ctypes
    import ctypes.util

    for name in ("libcudart.so.12", "libcudart.so.13", ctypes.util.find_library("cudart")):
        try:
            return ctypes.CDLL(name) if name else None
        except OSError:
            continue
    return None


def cuda_copies(destination: torch.Tensor, source: torch.Tensor, copy: PeerCopy, stream, cudart) -> None:
    """`copies_2d`'s calls as `cudaMemcpy2DAsync` (device to device, over NVLink when `destination` is a peer's
    symmetric buffer) on `stream`: copy-engine work, no kernel. Verified by reading only."""
    import ctypes

    device_to_device = 3  # cudaMemcpyDeviceToDevice
    into, read = destination.data_ptr(), source.data_ptr()
    for call in copies_2d(copy, source.element_size()):
        status = cudart.cudaMemcpy2DAsync(
            ctypes.c_void_p(into + call.destination_offset), ctypes.c_size_t(call.destination_pitch),
            ctypes.c_void_p(read + call.source_offset), ctypes.c_size_t(call.source_pitch),
            ctypes.c_size_t(call.width), ctypes.c_size_t(call.height), ctypes.c_int(device_to_device),
            ctypes.c_void_p(stream.cuda_stream))
        if status != 0:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status}")


# -- transports -------------------------------------------------------------------------------------------------
class CollectiveTransport:
    """`all_to_all_single` of the pieces stacked along a new first dimension (NCCL on GPUs, gloo on CPU); what
    arrives is laid out by `join` (one copy, none when it already is)."""

    name = "nccl"

    def launch(self, tensor: torch.Tensor, group, size: int, split_dim: int, join_dim: int):
        # Row p: the p-th piece along `split_dim`, for rank p (a view when it is already contiguous).
        send = tensor.unflatten(split_dim, (size, -1)).movedim(split_dim, 0).contiguous()
        receive = torch.empty_like(send)
        work = dist.all_to_all_single(receive, send, group=group, async_op=True)
        return work, send, receive

    def join(self, receive: torch.Tensor, join_dim: int) -> torch.Tensor:
        """Row p came from rank p: it is the p-th piece along `join_dim`."""
        return receive.movedim(0, join_dim).flatten(join_dim, join_dim + 1)


class _Placed:
    """An emulated exchange in flight: once gloo's all-to-all is done, the staged pieces go to the plan's views."""

    def __init__(self, work, receive, staged, plans, rank):
        self.work, self.receive, self.staged, self.plans, self.rank = work, receive, staged, plans, rank

    def wait(self) -> None:
        self.work.wait()
        for sender, plan in enumerate(self.plans):
            # What `sender` copied for me, at the destination its plan names in my buffer (destinations depend on
            # the shape only, which every rank shares; the staged piece is contiguous).
            mine = plan.copies[self.rank]
            staged = dataclasses.replace(mine, source_offset=0, source_strides=contiguous_strides(mine.sizes))
            block_copies(self.receive, self.staged[sender], staged)
        self.staged = None


class EmulatedCopyTransport:
    """The copy-engine plan on CPU, for tests: every rank applies its plan's source views into one staging tensor
    per peer, gloo's all-to-all moves them (standing in for the peer writes), and the receiver writes each into
    the plan's destination view of its receive buffer, the joined layout. Not a production path: on CPU the
    strategy uses `CollectiveTransport`."""

    name = "copy_engine_emulated"

    def launch(self, tensor: torch.Tensor, group, size: int, split_dim: int, join_dim: int):
        rank = dist.get_rank(group)
        plans = [plan_exchange(tensor.shape, tensor.stride(), split_dim, join_dim, size, sender)
                 for sender in range(size)]
        mine = plans[rank]
        outgoing = [torch.empty(copy.sizes, dtype=tensor.dtype) for copy in mine.copies]
        for staging, copy in zip(outgoing, mine.copies):
            block_copies(staging, tensor, dataclasses.replace(
                copy, destination_offset=0, destination_strides=contiguous_strides(copy.sizes)))
        incoming = [torch.empty_like(staging) for staging in outgoing]
        work = dist.all_to_all(incoming, outgoing, group=group, async_op=True)
        receive = tensor.new_empty(mine.output_shape)
        return _Placed(work, receive, incoming, plans, rank), outgoing, receive

    def join(self, receive: torch.Tensor, join_dim: int) -> torch.Tensor:
        return receive  # already in the joined layout


class SymmetricMemoryTransport:
    """CUDA: each rank copies its pieces into the peers' symmetric receive buffers on a side stream, between two
    barriers over the group (before: every peer's buffer is free; after: every piece has arrived), then copies its
    own buffer out (contiguous, a memcpy) because the buffer is reused and attention keeps its inputs for
    backward. Buffers are rendezvoused once per (group, dtype, elements) and reused; the side stream orders all
    exchanges of a rank, so one buffer per size serves every exchange in flight. Verified by reading only (no
    multi-GPU machine ran it yet)."""

    name = "copy_engine"

    def __init__(self):
        self._symmetric_buffers: dict[tuple, tuple[torch.Tensor, object]] = {}
        self._stream: Optional[torch.cuda.Stream] = None
        self._cudart = _cudart()

    def _buffer(self, group, dtype, numel: int, device):
        symm_mem = torch_private.symmetric_memory()
        key = (group.group_name, dtype, numel)
        if key not in self._symmetric_buffers:  # a collective: every rank reaches it at the same exchange (same shapes)
            symm_mem.enable_symm_mem_for_group(group.group_name)  # idempotent; older torch needs it before rendezvous
            buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            self._symmetric_buffers[key] = buffer, symm_mem.rendezvous(buffer, group)
        return self._symmetric_buffers[key]

    def launch(self, tensor: torch.Tensor, group, size: int, split_dim: int, join_dim: int):
        rank = dist.get_rank(group)
        if 0 in tensor.stride():  # an expanded tensor: a 2-D copy's pitch may not be below its width
            tensor = tensor.contiguous()
        plan = plan_exchange(tensor.shape, tensor.stride(), split_dim, join_dim, size, rank)
        buffer, handle = self._buffer(group, tensor.dtype, math.prod(plan.output_shape), tensor.device)
        receive = tensor.new_empty(plan.output_shape)
        self._stream = self._stream or torch.cuda.Stream(device=tensor.device)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the source is written
        with torch.cuda.stream(self._stream):
            handle.barrier(channel=0)  # every peer's buffer is free (its last copy-out is before this on its stream)
            for copy in plan.copies:
                peer = handle.get_buffer(copy.peer, plan.output_shape, tensor.dtype)
                cuda_copies(peer, tensor, copy, self._stream, self._cudart)
            handle.barrier(channel=0)  # every peer's pieces are in my buffer
            receive.copy_(buffer.view(plan.output_shape))
            done = torch.cuda.Event()
            done.record(self._stream)
        return _Arrival(done, tensor.device), tensor, receive

    def join(self, receive: torch.Tensor, join_dim: int) -> torch.Tensor:
        return receive


class _Arrival:
    def __init__(self, event, device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


# -- selection --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CopyEngineProbe:
    """What the copy-engine path needs, as this rank sees it (each field a fact the strategy looked up)."""

    cuda: bool
    group_on_one_host: bool  # every SP peer on this host (contiguous groups within a node's devices)
    peer_access: bool  # P2P access between this rank's device and every SP peer's
    symmetric_memory: bool  # torch.distributed._symmetric_memory importable, libcudart loadable
    multicast_off: bool  # MULTICAST_OFF set as given

    REASONS = ("not on CUDA devices", "the sequence-parallel group spans hosts",
               "no peer-to-peer access between the group's GPUs",
               "torch symmetric memory or the CUDA runtime's cudaMemcpy2DAsync is not available",
               "NVLink multicast is not switched off (" + ", ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items()) + ")")

    def failure(self) -> int:
        """0 when the copy engine can run here, else 1 + the index of the first missing condition in `REASONS`."""
        checks = (self.cuda, self.group_on_one_host, self.peer_access, self.symmetric_memory, self.multicast_off)
        return next((i + 1 for i, ok in enumerate(checks) if not ok), 0)


def multicast_is_off(environ=os.environ) -> bool:
    return all(environ.get(name) == value for name, value in MULTICAST_OFF.items())


def symmetric_memory_importable() -> bool:
    try:
        torch_private.symmetric_memory()
    except ImportError:
        return False
    return True


def check_exchange(value) -> str:
    if value not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES} (the all-to-all's transport), got {value!r}")
    return value


def choose_exchange(requested: str, failure: int) -> str:
    """"nccl" or "copy_engine" from the request and the failure code agreed over the SP group (the largest of
    every rank's `CopyEngineProbe.failure()`, so every rank decides alike). "auto" falls back with one log line;
    an explicit "copy_engine" that cannot run is refused."""
    check_exchange(requested)
    if requested == "nccl" or (requested == "auto" and failure == 1):  # CPU: gloo's all-to-all, as always
        return "nccl"
    if failure == 0:
        return "copy_engine"
    reason = CopyEngineProbe.REASONS[failure - 1]
    if requested == "copy_engine":
        raise RuntimeError(f'exchange="copy_engine" cannot run here: {reason}. Use exchange="nccl" (or "auto").')
    _log.info('exchange="auto": the NCCL all-to-all, not the copy engine: %s', reason)
    return "nccl"


def agreed_failure(probe: CopyEngineProbe, group, device) -> int:
    """The largest failure code over `group` (one all-reduce), so that every rank makes the same choice."""
    code = torch.tensor([probe.failure()], device=device)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    return int(code.item())


def probe_copy_engine(devices: list[torch.device], group_on_one_host: bool) -> CopyEngineProbe:
    """This rank's facts: `devices` are the SP group's devices on this host, this rank's first."""
    cuda = all(device.type == "cuda" for device in devices) and torch.cuda.is_available()
    mine = devices[0].index if cuda else None
    return CopyEngineProbe(
        cuda=cuda, group_on_one_host=group_on_one_host,
        peer_access=cuda and all(torch.cuda.can_device_access_peer(mine, device.index)
                                 for device in devices[1:] if device.index != mine),
        symmetric_memory=symmetric_memory_importable() and cuda and _cudart() is not None,
        multicast_off=multicast_is_off())


def transport_for(choice: str):
    """The transport of an agreed choice (`choose_exchange`)."""
    return SymmetricMemoryTransport() if choice == "copy_engine" else None


def agree_exchange(requested: str, group, on_cuda: bool, host_ranks: range, host_devices: Sequence[torch.device],
                   rank: int, device: torch.device) -> tuple[str, Optional[SymmetricMemoryTransport]]:
    """The exchange of a run and its transport (None: the collective one), agreed over the Ulysses `group` (None:
    nothing is exchanged): off CUDA (`on_cuda`, the same on every rank) without a collective, on CUDA by the largest
    failure code of every rank's probe (one all-reduce), so that every rank takes the same transport and an impossible
    `"copy_engine"` is refused on every rank alike. `host_ranks`: the global ranks of this host (contiguous), whose
    devices are `host_devices`; `rank`, `device`: this rank's."""
    if group is None:
        return "nccl", None
    if requested == "nccl" or not on_cuda:
        failure = 1  # not (to be) on CUDA devices
    else:
        ranks = dist.get_process_group_ranks(group)
        on_host = all(r in host_ranks for r in ranks)
        peers = [host_devices[r - host_ranks.start] for r in ranks if on_host and r != rank]
        failure = agreed_failure(probe_copy_engine([device] + peers, on_host), group, device)
    choice = choose_exchange(requested, failure)
    return choice, transport_for(choice)
