"""Layer activation checkpointing: kept inputs (optionally in host memory), sparser checkpoints, kept attention.

Each checkpointed decoder layer runs its forward without keeping activations and recomputes itself in backward. What
it keeps is tunable, because at long sequences even the kept tensors add up (Llama 8B, 360K tokens: one layer input
is 2.9 GB, 94 GB for 32 layers):
- `offload` (a `HostActivationStore`): kept tensors are copied to pinned host memory while the layer's forward runs,
  and back while the layer after it runs its backward (the copies overlap with compute, on a side stream);
- `interval` k: only every k-th layer keeps its input; a layer between two kept inputs gets its input back by
  re-running the layers before it (without gradients) from the nearest kept one, once per stretch: the inputs
  of a stretch are recomputed together when its last layer's backward needs them, and each is kept on the device
  until its own layer's backward. Costs k − 1 extra layer forwards per k layers; saves (k − 1)/k of the kept inputs;
- `keep_attention_outputs`: the fused attention kernels' outputs (attention output and log-sum-exp) are recorded in
  the forward and replayed in every recompute, so the most expensive kernel of a long-sequence layer runs once in
  forward instead of twice (costs one more hidden-sized tensor per layer, where the inputs are kept).

Written as a re-entrant autograd function (like DeepSpeed's own checkpointing) rather than with
`torch.utils.checkpoint`: the non-re-entrant checkpoint keeps its inputs alive on the device in a closure, where no
offload can reach them. Parameter gradients accumulate through a normal `backward` of the recomputed layer, once
per parameter, so ZeRO's hooks see what they see without checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref
from collections import defaultdict
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from lightning_ulysses.attention import fa4  # noqa: F401  (registers the operator recorded below)
from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.fences import _torch_private as torch_private
from lightning_ulysses.fences import _transformers_private as transformers_private
from lightning_ulysses.memory.autocast_state import AutocastState
from lightning_ulysses.memory.tiled_mlp import TiledMLP, deferred_recompute, tiled_mlps
from lightning_ulysses.parallel.recompute_regions import MARK, TILED, TOKEN_MIXER
from lightning_ulysses.parallel.views import view_key

# The fused attention kernels whose outputs `keep_attention_outputs` records (what F.scaled_dot_product_attention
# dispatches to on CUDA and CPU, and FlashAttention-4's operator: attention/fa4.py). The math fallback decomposes
# into ordinary ops and simply runs again.
_ATTENTION_KERNELS = frozenset(
    [getattr(torch.ops.aten, name).default
     for name in torch_private.SDPA_KERNEL_NAMES
     if hasattr(torch.ops.aten, name)]
    + [torch.ops.lightning_ulysses.fa4_attention.default]
)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor` covers its memory without gaps or overlaps (then `empty_like` copies its strides)."""
    return torch.empty_like(tensor, device="meta").stride() == tensor.stride()


def _with_log_sumexp(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The kernel call with `compute_log_sumexp=True` where the kernel has that flag (cuDNN, memory-efficient).

    F.scaled_dot_product_attention sets it only when an input requires grad, i.e. never in the checkpointed forward
    (run without gradients); the backward of the recompute then needs the log-sum-exp the recording skipped.
    """
    names = [argument.name for argument in torch_private.op_schema(func).arguments]
    if "compute_log_sumexp" not in names:
        return args, kwargs
    position = names.index("compute_log_sumexp")
    if position < len(args):
        return args[:position] + (True,) + args[position + 1:], kwargs
    return args, {**kwargs, "compute_log_sumexp": True}


class Stashed(NamedTuple):
    """A tensor in a `HostActivationStore`: its host buffer, and what the device copy needs."""

    buffer: torch.Tensor
    device: torch.device
    requires_grad: bool


class Fetch:
    """A stashed tensor on its way back to the device: `wait()` gives it, once its copy is done for the caller's
    stream."""

    def __init__(self, tensor: torch.Tensor, done: Optional[torch.cuda.Event]) -> None:
        self.tensor, self.done = tensor, done

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(self.done)
        return self.tensor


class HostActivationStore:
    """Pinned host buffers for offloaded activations, reused from step to step; the copies overlap with compute.

    Buffers are pinned with `cudaHostRegister` on plain host tensors: the caching host allocator behind
    `pin_memory=True` rounds every block up to a power of two (a 2.9 GB hidden state would take 4 GB).
    Without CUDA the buffers are plain host tensors (the copies are then what the tests check).

    Copies run on one side stream per device (`overlap_transfers`), in both directions: a layer's forward goes on
    while its input and attention output go to the host, and the previous layer's come back while a layer runs its
    backward (`fetch` early, `Fetch.wait` when needed). One stream orders every copy of a buffer, so a buffer given
    back is only overwritten after the copy that read it. Device memory stays the compute stream's: a copy's
    destination is allocated there, and `record_stream` keeps a source or destination from being reused while the
    side stream still uses it. On the compute stream the copies would stop compute for as long as they take:
    68 GB per step for Llama 8B at 128K tokens (results: benchmarks/results/2026-12-02-h200-offload-overlap).

    Buffers are reused by layout (shape, strides, dtype). A tensor of a layout with no idle buffer first frees the
    idle buffers of every other layout: batches whose length varies would otherwise keep (and pin) a full set of
    buffers for every length seen, until the host runs out of memory.
    """

    # False: copies on the compute stream, as before the overlap (the benchmarks' baseline, same results).
    overlap_transfers: bool = True

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._pinned: dict[int, torch.Tensor] = {}  # by data pointer
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype

    def _allocate(self, tensor: torch.Tensor) -> torch.Tensor:
        # Same strides as the device tensor: kernels such as cuDNN attention's backward expect their own layout.
        buffer = torch.empty_like(tensor, device="cpu")
        if torch.cuda.is_available() and torch.cuda.is_initialized() and buffer.numel():
            torch_private.pin_memory(buffer.data_ptr(), buffer.untyped_storage().nbytes())
            self._pinned[buffer.data_ptr()] = buffer
        return buffer

    def _drop_idle(self, keep: Optional[tuple] = None) -> None:
        """Unpin and drop the idle buffers of every layout but `keep`."""
        # Swapped out first: a buffer given back meanwhile (a dropped graph freed by the garbage collector) is kept.
        free, self._free = self._free, defaultdict(list)
        if keep is not None:
            self._free[keep] += free.pop(keep, [])
        pinned = [self._pinned.pop(buffer.data_ptr()) for buffers in free.values() for buffer in buffers
                  if buffer.data_ptr() in self._pinned]
        if pinned:
            torch.cuda.synchronize()  # no copy may still be reading or writing a buffer
            for buffer in pinned:
                torch_private.unpin_memory(buffer.data_ptr())

    def _copy_stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        """The side stream of `device`, after everything queued so far on the compute stream (None: copy there)."""
        if device.type != "cuda" or not self.overlap_transfers:
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def stash(self, tensor: torch.Tensor) -> Stashed:
        if not _dense(tensor):  # a copy of its own layout, so that its buffer is found again under that layout
            tensor = tensor.contiguous()
        key = self._key(tensor)
        if not self._free[key]:
            self._drop_idle(keep=key)
        free = self._free[key]
        buffer = free.pop() if free else self._allocate(tensor)
        stream = self._copy_stream(tensor.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        if stream is not None:
            tensor.record_stream(stream)
        return Stashed(buffer, tensor.device, tensor.requires_grad)

    def settle(self, device: torch.device) -> None:
        """Make the compute stream wait for the copies queued so far (a layer's forward does not outrun them)."""
        if device in self._streams:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])

    def fetch(self, stashed: Stashed) -> Fetch:
        """Start the copy of a stashed tensor back to its device; the host copy stays for a later fetch."""
        buffer, device, requires_grad = stashed
        if device.type == "cpu":
            return Fetch(buffer.clone().requires_grad_(requires_grad), None)
        tensor = torch.empty_like(buffer, device=device)  # on the compute stream, where the memory is used
        stream = self._copy_stream(device)
        if stream is None:
            return Fetch(tensor.copy_(buffer, non_blocking=True).requires_grad_(requires_grad), None)
        with torch.cuda.stream(stream):
            tensor.copy_(buffer, non_blocking=True)
        tensor.record_stream(stream)
        return Fetch(tensor.requires_grad_(requires_grad), stream.record_event())

    def peek(self, stashed: Stashed) -> torch.Tensor:
        """A device copy of a stashed tensor; the host copy stays for a later `peek` or `restore`."""
        return self.fetch(stashed).wait()

    def restore(self, stashed: Stashed) -> torch.Tensor:
        """A device copy of a stashed tensor; its host buffer is free again."""
        tensor = self.peek(stashed)
        self.give_back(stashed)
        return tensor

    def give_back(self, stashed: Stashed) -> None:
        # The buffer's next use is a device-to-host copy queued on the same stream after any copy reading it.
        self._free[self._key(stashed.buffer)].append(stashed.buffer)

    @property
    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for buffers in self._free.values() for b in buffers)

    def release(self) -> None:
        """Unpin and drop every buffer. Call it between steps (no stashed activation in flight); memory freed while
        still registered would make a later registration of the same addresses fail."""
        self._drop_idle()
        if self._pinned:  # buffers still stashed (a forward without backward not yet freed): no longer reused
            torch.cuda.synchronize()
            for buffer in self._pinned.values():
                torch_private.unpin_memory(buffer.data_ptr())
        self._pinned = {}

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass

    def __deepcopy__(self, memo):  # host buffers are a cache, not state
        return self


_CHANGED_IN_PLACE = (
    "offload_activations: {layer} changed its {what} in place during its forward, while the copy to the host was"
    " under way (the copies overlap with compute): backward would recompute from a torn copy. Switch"
    " offload_activations off for this model (MemoryOptions(offload_activations=False); recipes:"
    " strategy.memory.offload_activations=false), or keep the tensor unchanged (an out-of-place op)."
)


class _Kept:
    """A tensor a record keeps: on the device, or stashed in a `HostActivationStore`."""

    def __init__(self, tensor: torch.Tensor, store: Optional[HostActivationStore], what: str) -> None:
        self.store, self.what = store, what
        self.value = store.stash(tensor) if store is not None else tensor.detach()
        # Until the layer's forward ends: the tensor and its version, to refuse an in-place change racing the copy.
        self.source = (tensor, torch_private.version_counter(tensor)) if store is not None else None
        self.fetched: Optional[Fetch] = None  # a copy back to the device already under way
        # On the device, the kept tensor shares the source's storage and version counter: an in-place change of it
        # after recording (in the forward, or by a replay's user) must refuse the replay, not replay changed values.
        self.version = torch_private.version_counter(tensor) if store is None else None
        self.nbytes = tensor.untyped_storage().nbytes() if store is None else tensor.numel() * tensor.element_size()
        self.address = tensor.untyped_storage().data_ptr()  # of the source: what the in-place check watches

    def unchanged(self) -> bool:
        return self.version is None or self.value is None or torch_private.version_counter(self.value) == self.version

    def check_unchanged(self, layer: str) -> None:
        if self.source is not None:
            tensor, version = self.source
            self.source = None
            if torch_private.version_counter(tensor) != version:
                raise RuntimeError(_CHANGED_IN_PLACE.format(layer=layer, what=self.what))

    def prefetch(self) -> None:
        if self.store is not None and self.value is not None and self.fetched is None:
            self.fetched = self.store.fetch(self.value)

    def get(self) -> torch.Tensor:
        if self.store is None:
            return self.value
        self.prefetch()
        fetched, self.fetched = self.fetched, None
        return fetched.wait()

    def drop(self) -> None:
        if self.store is not None and getattr(self, "value", None) is not None:
            self.store.give_back(self.value)
        self.value = self.fetched = self.source = None

    def __del__(self) -> None:
        # A forward whose graph is dropped without backward (a skipped step, an exception, a second forward that is
        # never backpropagated) frees its calls here: their host buffers go back to the store, not pinned forever.
        self.drop()


_MISMATCH = ("kept outputs: a checkpointed layer's forward ran {recorded} where its recompute ran {now}. The recompute"
             " must pick the same SDPA kernels as the forward, and run the same products on the same shapes and"
             " dtypes: run forward and backward under one kernel priority (UlyssesDeepSpeedStrategy(sdpa_kernel_priority=...)"
             " wraps both), or switch keep_attention_outputs / keep_matmul_outputs / keep_token_mixer_outputs off for"
             " this model.")
_KEPT_CHANGED = ("kept outputs: {op}'s output, kept from a checkpointed layer's forward for its recompute, was changed"
                 " in place afterwards (by the layer's own forward or an earlier recompute): replaying it would be"
                 " wrong. Switch keep_matmul_outputs / keep_token_mixer_outputs off for this model.")

# The products whose outputs `keep_matmul_outputs` (outside any marked region) and `keep_token_mixer_outputs`
# (inside a token mixer's region) keep: what linear layers (`mm`, `addmm`), batched products (`bmm`, `baddbmm`:
# `@` of 3-D and more), grouped products (transformers' `grouped_mm` experts) and triangular solves dispatch to,
# forward and without gradients alike (checked: torch 2.13).
_PRODUCTS = frozenset(getattr(torch.ops.aten, name).default
                      for name in ("mm", "addmm", "bmm", "baddbmm", torch_private.GROUPED_MM_NAME,
                                   "linalg_solve_triangular")
                      if hasattr(torch.ops.aten, name))
# What each keep group keeps (`checkpoint_layers`' `keep` set): by operator, and by the region it runs in.
ATTENTION, MATMULS, TOKEN_MIXERS = "attention", "matmuls", "token_mixers"


def _generator_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.random.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.random.set_rng_state(state)


@functools.lru_cache(maxsize=None)
def _written(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments `func` writes to (`Tensor(a!)` in its schema): in-place and `out=` ops."""
    return tuple((index, argument.name) for index, argument in enumerate(torch_private.op_schema(func).arguments)
                 if argument.alias_info is not None and argument.alias_info.is_write)


def _shapes(args: tuple) -> tuple:
    """What a replay checks of a kept operation's inputs: their shapes and dtypes (and the other arguments' values).
    A dtype too: a recompute under another autocast state runs the same product on the same shapes in fp32 where
    the forward ran it in bf16."""
    return tuple((tuple(a.shape), a.dtype) if torch.is_tensor(a) else a for a in args)


class _KeptOutputs(torch_private.TorchDispatchMode):
    """Records the outputs of the operations a checkpointed layer keeps in its forward; replays them in its
    recomputes, which run everything else again. One mode for every kept kind (`keep`):
    - `"attention"`: the fused attention kernels (output and log-sum-exp): the most expensive kernel of a long row;
    - `"matmuls"`: the products outside any marked region (projections, MLPs, experts): the step's matmul FLOPs;
    - `"token_mixers"`: the products inside a token mixer's region (`recompute_regions.TOKEN_MIXER`: the chunked
      delta rule), slow per byte to recompute; the elementwise work around them runs again.
    Nothing is kept inside a tiled MLP's region (`TILED`). What the recompute runs again (norms, activations, the
    elementwise ops) is cheap per byte it would keep.

    A dispatch mode works below autograd, so a recompute with gradients still builds every backward node, which saves
    the replayed tensors exactly as if the operation had run again: gradients are unchanged. A kernel with attention
    dropout draws from its device's generator (the CUDA kernels advance the Philox offset, and return the seed and
    offset their backward regenerates the mask from): the generator's state after the kernel is recorded too and set
    in the replay, so the dropout after the attention (GPT-2's `resid_pdrop`, the MLP's) draws in the recompute what
    it drew in the forward. A replay checks the operator and its input shapes and dtypes, and that nobody changed a kept output
    in place since it was recorded; anything else is refused, never replayed wrong.
    """

    def __init__(self, store: Optional[HostActivationStore], keep: frozenset) -> None:
        super().__init__()
        self.store, self.keep = store, keep
        # (operator, input shapes, outputs, device, generator state after the kernel or None, output versions)
        self.recorded: list[tuple] = []
        self.next_replayed: Optional[int] = None  # None while recording
        self.regions: list[str] = []  # the marked regions the layer is inside, innermost last
        # The storages of the outputs kept (recorded) or replayed in the current forward or recompute, by address,
        # with a tensor that holds each alive: an operation that writes into one is refused. Version counters do not
        # see it all: a linear layer's 3-D output is an `_unsafe_view` of its product, with a counter of its own.
        self.watched: dict[int, torch.Tensor] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, dynamo runs every torch.compile'd function called under the mode eagerly, and a function's
        # first call under it marks its code "skip" for good (torch 2.13, `inline_torch_dispatch_torch_compile`):
        # `fused_elementwise` would silently compile nothing. The mode is then off while dynamo compiles and on when
        # the compiled code runs; what is compiled holds no kept operation (those run eagerly).
        return True

    def _keeps(self, func) -> bool:
        region = self.regions[-1] if self.regions else None
        if region == TILED:
            return False
        if func in _ATTENTION_KERNELS:
            return ATTENTION in self.keep
        if func in _PRODUCTS:
            return (TOKEN_MIXERS if region == TOKEN_MIXER else MATMULS) in self.keep
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is MARK:
            kind, enter = (list(args) + [kwargs.get("kind"), kwargs.get("enter")][len(args):])[:2]
            if enter:
                self.regions.append(kind)
            elif self.regions and self.regions[-1] == kind:
                self.regions.pop()
            return func(*args, **kwargs)
        if self.watched and _written(func):
            for index, name in _written(func):
                value = args[index] if index < len(args) else kwargs.get(name)
                if torch.is_tensor(value) and value.untyped_storage().data_ptr() in self.watched:
                    self._written_into(value.untyped_storage().data_ptr(), func)
        if not self._keeps(func):
            return func(*args, **kwargs)
        attention = func in _ATTENTION_KERNELS
        device = args[0].device  # the query's: where the kernel runs, whose generator its dropout draws from
        if self.next_replayed is None:
            if attention:
                args, kwargs = _with_log_sumexp(func, tuple(args), kwargs)
            outputs = func(*args, **kwargs)
            single = torch.is_tensor(outputs)
            kept = tuple(_Kept(o, self.store, "kept output") if torch.is_tensor(o) and o.dim() > 0 else o
                         for o in ((outputs,) if single else outputs))
            # The large outputs go where the layer inputs go; the scalars (seeds, sizes) stay as they are.
            self.recorded.append((func, _shapes(args), kept, single, device,
                                  _generator_state(device) if attention else None))
            self._watch(outputs if single else [o for o in outputs if torch.is_tensor(o)])
            return outputs
        recorded = self.recorded[self.next_replayed] if self.next_replayed < len(self.recorded) else None
        if recorded is None or recorded[0] is not func or recorded[1] != _shapes(args):
            raise RuntimeError(_MISMATCH.format(recorded=recorded[0] if recorded else "nothing more", now=func))
        _, _, outputs, single, device, state_after = recorded
        self.next_replayed += 1
        if outputs is None:  # written into in the forward: not kept, run again
            return func(*args, **kwargs)
        if state_after is not None:
            _set_generator_state(device, state_after)  # as if the kernel had drawn its dropout again
        for output in outputs:
            if isinstance(output, _Kept) and not output.unchanged():
                raise RuntimeError(_KEPT_CHANGED.format(op=func))
        replayed = tuple(o.get() if isinstance(o, _Kept) else o for o in outputs)
        self._watch([o for o in replayed if torch.is_tensor(o)])
        return replayed[0] if single else replayed

    def _written_into(self, address: int, writer) -> None:
        """An operation writes into a kept output. In the forward (DeepSpeed ZeRO-3's linear adds its bias in place
        into the product): that output is not kept after all, and the recompute runs its operation again. In a
        recompute: refused (the forward did not write there, so the recompute runs something else)."""
        if self.next_replayed is not None:
            raise RuntimeError(_KEPT_CHANGED.format(op=writer))
        for position, (func, shapes, outputs, single, device, state) in enumerate(self.recorded):
            if outputs is not None and any(isinstance(o, _Kept) and o.address == address for o in outputs):
                if func in _ATTENTION_KERNELS:  # (its log-sum-exp was asked for: running it again would differ)
                    raise RuntimeError(_KEPT_CHANGED.format(op=writer))
                for output in outputs:
                    if isinstance(output, _Kept):
                        self.watched.pop(output.address, None)
                        output.drop()
                self.recorded[position] = (func, shapes, None, single, device, state)
                return

    def _watch(self, tensors) -> None:
        for tensor in [tensors] if torch.is_tensor(tensors) else tensors:
            if tensor.dim() > 0:
                self.watched[tensor.untyped_storage().data_ptr()] = tensor

    def unwatch(self) -> None:
        """At the end of a forward or recompute: the tensors held for the in-place check are let go."""
        self.watched = {}

    @contextlib.contextmanager
    def replaying(self):
        self.next_replayed, self.regions = 0, []
        try:
            with self:
                yield
            if self.next_replayed != len(self.recorded):
                raise RuntimeError(_MISMATCH.format(recorded=self.recorded[self.next_replayed][0], now="nothing"))
        finally:
            self.next_replayed, self.regions = None, []
            self.unwatch()

    def kept(self) -> list[_Kept]:
        return [output for _, _, outputs, _, _, _ in self.recorded for output in outputs or ()
                if isinstance(output, _Kept)]

    def check_unchanged(self, layer: str) -> None:
        """After the layer's forward: no kept output was changed in place while (or after) it was recorded."""
        for func, _, outputs, _, _, _ in self.recorded:
            for output in outputs or ():
                if isinstance(output, _Kept):
                    output.check_unchanged(layer)
                    if not output.unchanged():
                        raise RuntimeError(_KEPT_CHANGED.format(op=func))

    @property
    def kept_bytes(self) -> int:
        """Bytes of the kept outputs (each storage once), on the device or the host."""
        return sum(output.nbytes for output in self.kept())

    def drop(self) -> None:
        for output in self.kept():
            output.drop()
        self.recorded = []


class _LayerCall:
    """One checkpointed call of one layer: what its backward, and later layers' backward, need to recompute it."""

    def __init__(self, run: Callable, layer: str, earlier: list["_LayerCall"], previous: Optional[weakref.ref],
                 store: Optional[HostActivationStore], keep: frozenset, mlps: list[TiledMLP],
                 module: Optional[nn.Module] = None) -> None:
        # The calls before this one in its stretch. Only later calls refer to earlier ones (no cycle): each call lives
        # exactly as long as its autograd node needs it, so a graph dropped without backward frees what it kept.
        self.run, self.layer, self.earlier, self.store = run, layer, earlier, store
        self.module = module  # the layer itself: a stretch's recompute gathers an FSDP2 unit's parameters
        self.mlps = mlps  # the layer's tiled MLPs: their forward can be left out of the recompute with gradients
        # The call checkpointed just before this one, whatever its stretch: the next to run backward, whose kept
        # tensors this call's backward starts bringing back (weak, like the stretches').
        self.previous = previous
        self.position = len(earlier)  # 0: this call keeps its input; k > 0: recomputed from the stretch's first
        self.kept_outputs = _KeptOutputs(store, keep) if keep else None  # what the recompute replays
        self.kept_input: Optional[_Kept] = None
        self.recomputed_input: Optional[torch.Tensor] = None

    def forward(self, args: tuple) -> Any:
        self.other_arguments = (None, *args[1:])  # rotary tables, masks: shared by all layers, kept where they are
        self.requires_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        self.devices = sorted({a.device.index for a in args if torch.is_tensor(a) and a.is_cuda})
        self.rng = torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices]
        self.autocast = AutocastState.of(args[0].device)  # bf16-mixed on FSDP2: the recompute runs under it too
        if self.position == 0:
            self.kept_input = _Kept(args[0], self.store, "input (hidden states)")
        with torch.no_grad(), (self.kept_outputs if self.kept_outputs is not None else contextlib.nullcontext()):
            outputs = self.run(*args)
        if self.kept_outputs is not None:  # nothing changed what was kept (nor what the copies to the host read)
            self.kept_outputs.unwatch()
            self.kept_outputs.check_unchanged(self.layer)
        if self.store is not None:  # the copies to the host are done, and nothing changed what they read
            if self.kept_input is not None:
                self.kept_input.check_unchanged(self.layer)
            self.store.settle(args[0].device)
        return outputs

    def prefetch_input(self) -> None:
        """Start bringing back the kept input this call's backward recomputes from (its own, or its stretch's first),
        so that the copy overlaps with the backward running now. One hidden-sized tensor: the attention outputs come
        back when the recompute starts (`recompute`), while it runs the layer up to the attention kernel."""
        first = self.earlier[0] if self.position > 0 and self.recomputed_input is None else self
        if first.kept_input is not None:
            first.kept_input.prefetch()

    def recompute(self, hidden: torch.Tensor, with_grad: bool) -> tuple[Any, list]:
        """Run the layer again on `hidden` exactly as in forward (same random draws and autocast state, replayed
        attention)."""
        args = [hidden if i == 0 else a for i, a in enumerate(self.other_arguments)]
        if with_grad:
            # Only what needs a gradient is cut from the forward's graph; the rest (masks, positions) is passed on as
            # the very objects the forward got: the "ulysses" mask interface's window marker lives on its object.
            args = [a.detach().requires_grad_(needs) if torch.is_tensor(a) and (needs or a.requires_grad) else a
                    for a, needs in zip(args, self.requires_grad)]
        cpu_rng, cuda_rngs = self.rng
        for kept in self.kept_outputs.kept() if self.kept_outputs is not None else []:
            kept.prefetch()
        replay = self.kept_outputs.replaying() if self.kept_outputs is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=self.devices), torch.set_grad_enabled(with_grad), \
                self.autocast.restored(), replay:
            torch.random.set_rng_state(cpu_rng)  # dropout in the recompute draws what the forward drew
            for device, state in zip(self.devices, cuda_rngs):
                torch.cuda.set_rng_state(state, device)
            return self.run(*args), args

    def input_for_backward(self) -> torch.Tensor:
        if self.position == 0:
            hidden = self.kept_input.get()
            self.kept_input.drop()
            return hidden
        if self.recomputed_input is None:
            # The stretch's last layer to run backward first: recompute the inputs of every layer before it.
            calls = [*self.earlier, self]
            hidden = calls[0].kept_input.get()
            for call, following in itertools.pairwise(calls):
                with _parameters_gathered(call.module):
                    outputs, _ = call.recompute(hidden, with_grad=False)
                hidden = outputs[0] if isinstance(outputs, tuple) else outputs
                following.recomputed_input = hidden
        hidden, self.recomputed_input = self.recomputed_input, None
        return hidden

    def release(self) -> None:
        """After this call's backward: drop what it kept (the rotary tables and masks in `run`'s arguments, its
        earlier calls) now rather than when its autograd node goes."""
        if self.kept_outputs is not None:
            self.kept_outputs.drop()
        self.other_arguments = self.run = None
        self.earlier = []


@contextlib.contextmanager
def _parameters_gathered(layer: Optional[nn.Module]):
    """`layer`'s parameters whole while a stretch recomputes it inside a later layer's backward. FSDP2 gathers a
    `fully_shard` unit's parameters in its forward and backward hooks only, and this recompute runs the layer's own
    forward outside both: without this it meets its sharded `DTensor`s. The unit is gathered (in its
    `MixedPrecisionPolicy`'s dtype, as its forward was) and sharded again after; its own backward gathers it again
    (verified exact against the plain model: tests/distributed/test_fsdp.py). DeepSpeed ZeRO-3 gathers through its
    per-submodule hooks, which the recompute does call; a leaf layer is refused in `checkpoint_layers`."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(layer, FSDPModule):
        yield
        return
    layer.unshard()
    try:
        yield
    finally:
        layer.reshard()


class _CheckpointedLayer(torch.autograd.Function):
    """Runs a layer without keeping activations; recomputes it in backward (see `_LayerCall`)."""

    @staticmethod
    def forward(ctx, call: _LayerCall, gradient_anchor: Optional[torch.Tensor], *args: Any):
        ctx.call = call
        return call.forward(args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        call, ctx.call = ctx.call, None
        if call is None:
            raise RuntimeError(
                "A checkpointed layer ran backward twice (backward(retain_graph=True) followed by another backward, or"
                " a double backward): activation checkpointing frees what it kept after the first. Run one backward"
                " per forward, or switch the memory option activation_checkpointing off."
            )
        hidden = call.input_for_backward()
        previous = call.previous() if call.previous is not None else None
        if previous is not None:
            previous.prefetch_input()
        # The recompute's outputs only carry gradients back: a tiled MLP need not produce its values.
        with deferred_recompute(call.mlps) as deferred:
            outputs, args = call.recompute(hidden, with_grad=True)
        deferred.check(outputs)
        call.release()
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if torch.is_tensor(a) and needs else None
                              for a, needs in zip(args, call.requires_grad)))


# Arguments of Hugging Face decoder layers that carry a KV cache (or a recurrent state): a recompute must not update
# it a second time (the recompute's keys and values would be appended again, and attend to the forward's detached
# copies, so their gradients would be lost).
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past", "cache_params")


def _without_cache(layer: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with every cache set to None and `use_cache` off, whether passed by position or by name.

    Bound to the layer's signature because models pass the cache either way: GPT-2's model calls
    `block(hidden_states, cache, causal_mask, ...)`. Layers that only read the cache (Hugging Face's
    `_can_checkpoint_with_cache`) keep it: the recompute reads the same states. The arguments come back in
    `BoundArguments` order: the hidden states first, even when passed by name.
    """
    bound = signature.bind(*args, **kwargs)
    var_keyword = next((name for name, parameter in signature.parameters.items()
                        if parameter.kind is inspect.Parameter.VAR_KEYWORD), None)
    for arguments in (bound.arguments, bound.arguments.get(var_keyword, {})):
        if arguments.get("use_cache"):
            arguments["use_cache"] = False
        if not transformers_private.checkpoints_with_cache(layer):
            for name in _CACHE_ARGUMENTS:
                if arguments.get(name) is not None:
                    arguments[name] = None
    return bound.args, bound.kwargs


class _Stretches:
    """Groups the checkpointed calls of the forward passes into stretches of at most `interval` consecutive layers.

    A stretch continues only while a layer is handed, unchanged, the hidden states the previous checkpointed layer
    returned (or an alias of them): that is what its recompute will feed it. Anything else (a new forward pass, a
    layer stack of another model part, hidden states transformed between layers) starts a new stretch, whose first
    layer keeps its input.
    """

    def __init__(self, interval: int, store: Optional[HostActivationStore], keep: frozenset) -> None:
        self.interval, self.store, self.keep = interval, store, keep
        self.current: list[weakref.ref] = []
        self.last_output: Optional[tuple] = None  # `view_key` of the last call's hidden-state output
        self.last_call: Optional[weakref.ref] = None

    def call(self, hidden: torch.Tensor, run: Callable, layer: nn.Module, mlps: list[TiledMLP]) -> _LayerCall:
        earlier = [reference() for reference in self.current]
        # A call whose graph is already gone (its output was detached, say) cannot recompute the next one's input.
        continues = (self.last_output is not None and self.last_output == view_key(hidden)
                     and len(earlier) < self.interval and None not in earlier)
        call = _LayerCall(run, type(layer).__name__, earlier if continues else [], self.last_call, self.store,
                          self.keep, mlps, layer)
        # Weak: the calls live in their autograd nodes, and a dropped graph must free them at once.
        self.current = [*self.current, weakref.ref(call)] if continues else [weakref.ref(call)]
        self.last_call = weakref.ref(call)
        return call

    def returned(self, outputs: Any) -> Any:
        hidden = outputs[0] if isinstance(outputs, tuple) else outputs
        self.last_output = view_key(hidden) if torch.is_tensor(hidden) else None
        return outputs


def _checkpointed_forward(layer: nn.Module, original: Callable, signature: inspect.Signature, stretches: _Stretches,
                          mlps: list[TiledMLP], *args: Any, **kwargs: Any):
    if not (layer.training and torch.is_grad_enabled()):
        return original(*args, **kwargs)
    args, kwargs = _without_cache(layer, signature, args, kwargs)
    if not args or not torch.is_tensor(args[0]):
        raise ValueError(f"activation_checkpointing needs {type(layer).__name__}'s hidden states as its first"
                         " argument.")
    call = stretches.call(args[0], functools.partial(original, **kwargs), layer, mlps)
    # A layer whose inputs need no gradient (frozen embeddings, adapters on a frozen base) may still have trainable
    # parameters: an input that requires grad makes autograd run its backward, which accumulates theirs.
    needs_anchor = (not any(torch.is_tensor(a) and a.requires_grad for a in args)
                    and any(p.requires_grad for p in layer.parameters()))
    anchor = torch.empty(0, device=args[0].device, requires_grad=True) if needs_anchor else None
    return stretches.returned(_CheckpointedLayer.apply(call, anchor, *args))


def checkpoint_layers(layers: list[nn.Module], store: Optional[HostActivationStore], interval: int = 1,
                      keep_attention_outputs: bool = False, keep_matmul_outputs: bool = False,
                      keep_token_mixer_outputs: bool = False) -> list[Callable[[], None]]:
    """Checkpoint `layers` (in call order); keep every `interval`-th input (in `store` if given), and the outputs of
    the kinds of operations named (`_KeptOutputs`); return the undos."""
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            raise ValueError(
                f"{type(layer).__name__} already has the model's own gradient checkpointing enabled; with the memory"
                " option activation_checkpointing=True the layer would be recomputed twice. Disable one of them (for"
                " the recipes: model.activation_checkpointing=false)."
            )
    if interval > 1 and any(deepspeed_private.is_z3_leaf(layer) for layer in layers):
        raise ValueError("checkpoint_interval > 1 recomputes a stretch's earlier layers inside a later layer's"
                         " backward, where a DeepSpeed ZeRO-3 leaf layer's parameters are not gathered; these decoder"
                         " layers are marked leaves (the strategy's zero3_leaf_layers, or set_z3_leaf_modules). Use"
                         " checkpoint_interval=1, or leave the layers unmarked (zero3_leaf_layers=False).")
    signatures = []
    for layer in layers:
        try:
            signatures.append(inspect.signature(layer.forward))
        except (TypeError, ValueError) as error:  # without it a cache passed by position could not be found
            raise ValueError(f"activation_checkpointing reads the arguments of {type(layer).__name__}.forward to drop"
                             f" its KV cache in the recompute, but its signature cannot be read ({error}). Switch"
                             " activation_checkpointing off for this model.") from error
    keep = frozenset(name for name, on in ((ATTENTION, keep_attention_outputs), (MATMULS, keep_matmul_outputs),
                                           (TOKEN_MIXERS, keep_token_mixer_outputs)) if on)
    stretches = _Stretches(interval, store, keep)
    restores = []
    for layer, signature in zip(layers, signatures):
        # the layer's tiled MLPs (tiled before it is checkpointed), found once rather than on every call
        layer.forward = functools.partial(_checkpointed_forward, layer, layer.forward, signature, stretches,
                                          tiled_mlps(layer))
        restores.append(functools.partial(layer.__dict__.pop, "forward", None))
    return restores
