"""The one place that knows the sequence-parallel (SP) × data-parallel (DP) layout.

`ParallelLayout` is pure arithmetic (sizes and ranks, validated once, no communication), so every bad
configuration is rejected before any collective runs and no rank is left hanging.
`SequenceParallelGroups` owns the process groups built from a layout and hands DeepSpeed the `mpu` it needs to
partition ZeRO state over all DP×SP ranks and reduce gradients over them.

Ranks are laid out SP-major: an SP group is a block of contiguous global ranks, so with the usual
"devices per node" ranks per node an SP group stays inside a node (its all-to-alls run over NVLink), and DP
groups stride across the SP groups.

An SP group of `P` ranks may split further into `ulysses_size × ring_size` (hybrid Ulysses + ring attention,
for SP sizes the head counts cannot follow): Ulysses is the inner, contiguous dimension (SP rank
`s = ring_rank · ulysses_size + ulysses_rank`), because its all-to-alls move every token of every layer and need
the fastest links, while the ring only passes K/V blocks to a neighbour and overlaps that with compute.
`ShardOrder` says which tokens each SP rank holds: contiguous shards for pure Ulysses, the zig-zag layout when
there is a ring (see its docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from lightning_ulysses.fences import _torch_private as torch_private


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def check_sequence_parallel_size(size: object) -> None:
    """The checks that need no world size: an integer >= 1."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"sequence_parallel_size must be an integer >= 1, got {size!r}. Use 1 to turn sequence parallelism"
            " off, or a divisor of the number of processes (devices × num_nodes)."
        )


def check_ring_size(ring_size: object, sequence_parallel_size: int) -> None:
    """`ring_size` must be a positive integer dividing the SP size (the rest of the SP group is Ulysses)."""
    if not isinstance(ring_size, int) or isinstance(ring_size, bool) or ring_size < 1:
        raise ValueError(f"ring_size must be an integer >= 1 (or None for automatic), got {ring_size!r}.")
    if sequence_parallel_size % ring_size != 0:
        raise ValueError(
            f"ring_size({ring_size}) does not divide sequence_parallel_size({sequence_parallel_size}): an SP group"
            f" splits into ulysses_size × ring_size ranks. Use a ring_size in {divisors(sequence_parallel_size)}, or None to let the"
            " strategy pick the largest Ulysses degree the model's head counts allow."
        )


@dataclass(frozen=True)
class ShardOrder:
    """Which global sequence positions each rank of an SP group holds.

    Without a ring (`ring_size == 1`) SP rank `s` holds the contiguous shard `[s·N/P, (s+1)·N/P)`.
    With a ring, causal attention would leave the ring rank holding the first tokens idle (they see almost
    nothing) while the last one does all the work; so the sequence is cut into `2·ring_size` chunks and ring rank
    `r` holds chunks `r` and `2·ring_size − 1 − r` (zig-zag): every ring rank then does the same causal work at
    every ring step. The Ulysses ranks of ring rank `r` split that pair of chunks contiguously.

    Gathering the shards in SP-rank order gives the sequence in "shard order"; `restore` puts it back.
    """

    sequence_parallel_size: int
    ring_size: int = 1

    @classmethod
    def of_groups(cls, ulysses_group, ring_group=None) -> tuple["ShardOrder", int]:
        """The order the sharder cut batches in for these sub-groups (`None`: a group of one), and this rank's SP
        rank in it (ring rank · ulysses size + Ulysses rank): what every consumer of shards asks, from one place."""
        ulysses, ring = (1 if g is None else dist.get_world_size(g) for g in (ulysses_group, ring_group))
        ulysses_rank, ring_rank = (0 if g is None else dist.get_rank(g) for g in (ulysses_group, ring_group))
        return cls(ulysses * ring, ring), ring_rank * ulysses + ulysses_rank

    @property
    def ulysses_size(self) -> int:
        return self.sequence_parallel_size // self.ring_size

    @property
    def length_multiple(self) -> int:
        """Sequence lengths must be multiples of this (the zig-zag chunks must split evenly over the Ulysses ranks)."""
        if self.ring_size == 1:
            return self.sequence_parallel_size
        return math.lcm(self.sequence_parallel_size, 2 * self.ring_size)

    def runs(self, seq_len: int, sequence_parallel_rank: int) -> list[tuple[int, int]]:
        """The `[start, stop)` runs of global positions this SP rank holds, in the order it holds them."""
        if seq_len % self.length_multiple != 0:
            raise ValueError(f"sequence length {seq_len} is not a multiple of {self.length_multiple} ({self})")
        ring_rank, ulysses_rank = divmod(sequence_parallel_rank, self.ulysses_size)
        if self.ring_size == 1:
            chunks = [(0, seq_len)]
        else:
            chunk = seq_len // (2 * self.ring_size)
            mirror = 2 * self.ring_size - 1 - ring_rank
            chunks = [(ring_rank * chunk, (ring_rank + 1) * chunk), (mirror * chunk, (mirror + 1) * chunk)]
        # This Ulysses rank's contiguous piece of the concatenated chunks (it may straddle the two).
        piece = sum(stop - start for start, stop in chunks) // self.ulysses_size
        first, last = ulysses_rank * piece, (ulysses_rank + 1) * piece
        runs, offset = [], 0
        for start, stop in chunks:
            low, high = max(first, offset), min(last, offset + stop - start)
            if low < high:
                runs.append((start + low - offset, start + high - offset))
            offset += stop - start
        return runs

    def positions(self, seq_len: int, sequence_parallel_rank: int, device=None) -> torch.Tensor:
        """Global positions of this SP rank's tokens, `[seq_len / P]`."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.runs(seq_len, sequence_parallel_rank)])

    def shard(self, tensor: torch.Tensor, sequence_parallel_rank: int, dim: int) -> torch.Tensor:
        """This SP rank's tokens of a full-length `tensor` (cut along `dim`)."""
        runs = self.runs(tensor.size(dim), sequence_parallel_rank)
        if len(runs) == 1:
            return tensor.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        return torch.cat([tensor.narrow(dim, a, b - a) for a, b in runs], dim=dim)

    def restore(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """A sequence gathered in SP-rank order (shard order) → natural order."""
        if self.ring_size == 1:
            return gathered
        seq_len = gathered.size(dim)
        shard_order = torch.cat([self.positions(seq_len, rank) for rank in range(self.sequence_parallel_size)])
        return gathered.index_select(dim, torch.argsort(shard_order).to(gathered.device))


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes and ranks of a `data_parallel_size × sequence_parallel_size` layout over `world_size` processes,
    each SP group split into `ulysses_size × ring_size` (Ulysses inner, see the module docstring)."""

    world_size: int
    sequence_parallel_size: int
    ring_size: int = 1

    def __post_init__(self) -> None:
        sp, world = self.sequence_parallel_size, self.world_size
        check_sequence_parallel_size(sp)
        if world < 1:
            raise ValueError(f"world_size must be >= 1, got {world}")
        if world % sp != 0:
            raise ValueError(
                f"sp({sp}) does not divide world_size({world}): the number of processes (devices × num_nodes) must be"
                f" a multiple of sequence_parallel_size. Valid sequence_parallel_size values here: {divisors(world)}; or"
                f" change `devices`/`num_nodes` to a multiple of {sp}."
            )
        check_ring_size(self.ring_size, sp)

    @property
    def ulysses_size(self) -> int:
        return self.sequence_parallel_size // self.ring_size

    @property
    def shard_order(self) -> ShardOrder:
        return ShardOrder(self.sequence_parallel_size, self.ring_size)

    def with_ring_size(self, ring_size: int) -> ParallelLayout:
        return replace(self, ring_size=ring_size)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.sequence_parallel_size

    def sequence_parallel_rank(self, global_rank: int) -> int:
        return global_rank % self.sequence_parallel_size

    def data_parallel_rank(self, global_rank: int) -> int:
        return global_rank // self.sequence_parallel_size

    def spans_nodes_warning(self, num_nodes: int, devices_per_node: int) -> str | None:
        """Why these SP groups are slow on `num_nodes` machines, or None. Ranks are numbered node by node and SP
        groups are blocks of consecutive ranks, so a group stays inside a node exactly when its size divides the
        devices per node (the default, SP = devices per node, always does)."""
        sp = self.sequence_parallel_size
        if num_nodes <= 1 or devices_per_node % sp == 0:
            return None
        return (f"sequence_parallel_size={sp} with {devices_per_node} devices per node: SP groups span nodes, so every"
                " attention all-to-all crosses the inter-node network (typically several times slower than the links"
                f" inside a node). Use a sequence_parallel_size that divides {devices_per_node} unless the sequence"
                " needs more devices than one node has.")

    def sequence_parallel_groups(self) -> list[list[int]]:
        """Global ranks of every SP group (contiguous blocks)."""
        sp = self.sequence_parallel_size
        return [list(range(start, start + sp)) for start in range(0, self.world_size, sp)]

    def data_parallel_groups(self) -> list[list[int]]:
        """Global ranks of every DP group (one per SP rank, striding over the SP groups)."""
        sp = self.sequence_parallel_size
        return [list(range(sp_rank, self.world_size, sp)) for sp_rank in range(sp)]

    def ulysses_groups(self) -> list[list[int]]:
        """Global ranks of every Ulysses sub-group: contiguous blocks of `ulysses_size` inside each SP group."""
        u = self.ulysses_size
        return [list(range(start, start + u)) for start in range(0, self.world_size, u)]

    def ring_groups(self) -> list[list[int]]:
        """Global ranks of every ring sub-group: stride `ulysses_size` inside each SP group."""
        sp, u = self.sequence_parallel_size, self.ulysses_size
        return [list(range(start + offset, start + sp, u)) for start in range(0, self.world_size, sp) for offset in range(u)]

    def __str__(self) -> str:
        text = f"dp({self.data_parallel_size}) × sp({self.sequence_parallel_size}) = world_size({self.world_size})"
        if self.ring_size > 1:
            text += f", sp = ulysses({self.ulysses_size}) × ring({self.ring_size})"
        return text


class SequenceParallelGroups:
    """Process groups of a `ParallelLayout` for one rank, and the `mpu` adapter DeepSpeed needs.

    Build it with `SequenceParallelGroups.build(layout)` on every rank (group creation is collective).
    The Ulysses/ring sub-groups of each ring size are created once and shared by every `with_ring_size` copy.
    `release()` destroys every group they created; sizes and ranks stay readable afterwards, the groups do not.
    """

    def __init__(self, layout: ParallelLayout, global_rank: int, sequence_parallel_group, data_parallel_group,
                 subgroups: dict | None = None, _shared: _SharedGroups | None = None):
        self.layout = layout
        self.global_rank = global_rank
        # The groups themselves live in one object that every `with_ring_size` copy shares (and `release` empties).
        self._shared = _shared if _shared is not None else _SharedGroups(
            sequence_parallel_group, data_parallel_group, subgroups if subgroups is not None else {})
        if layout.ring_size not in self._shared.subgroups:
            self._shared.subgroups[layout.ring_size] = self._build_subgroups(layout)

    def _build_subgroups(self, layout: ParallelLayout) -> tuple:
        """(ulysses group, ring group) of `layout`; None where that dimension has a single rank."""
        self._check_not_released()
        if layout.ring_size == 1:
            return self._shared.sequence_parallel, None
        if layout.ulysses_size == 1:
            return None, self._shared.sequence_parallel
        # Every rank must create every group, in the same order: with_ring_size is called alike on all ranks.
        ulysses_group, _ = dist.new_subgroups_by_enumeration(layout.ulysses_groups())
        ring_group, _ = dist.new_subgroups_by_enumeration(layout.ring_groups())
        self._shared.created += [ulysses_group, ring_group]
        return ulysses_group, ring_group

    def with_ring_size(self, ring_size: int) -> SequenceParallelGroups:
        """The same SP/DP groups with the SP group split into `ulysses_size × ring_size` (collective on first use)."""
        layout = self.layout.with_ring_size(ring_size)  # validates before any group is created
        if layout == self.layout:
            return self
        return SequenceParallelGroups(layout, self.global_rank, None, None, _shared=self._shared)

    @classmethod
    def build(cls, layout: ParallelLayout) -> SequenceParallelGroups:
        if not dist.is_initialized():
            raise RuntimeError("SequenceParallelGroups.build needs an initialised torch.distributed process group.")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"layout {layout} does not match the process group's world size {dist.get_world_size()}")
        # Every rank must create every group, in the same order.
        sequence_parallel_group, _ = dist.new_subgroups_by_enumeration(layout.sequence_parallel_groups())
        data_parallel_group, _ = dist.new_subgroups_by_enumeration(layout.data_parallel_groups())
        shared = _SharedGroups(sequence_parallel_group, data_parallel_group, {},
                               created=[sequence_parallel_group, data_parallel_group])
        return cls(layout, dist.get_rank(), None, None, _shared=shared)

    MESH_DIMENSIONS = ("data_parallel", "sequence_parallel")  # a device mesh's dimension names, outer first

    @classmethod
    def build_device_mesh(cls, layout: ParallelLayout, device_type: str) -> tuple["SequenceParallelGroups", object]:
        """The groups of `layout` as the two dimensions of a DTensor `DeviceMesh` (`MESH_DIMENSIONS`: DP outer, SP
        inner, so an SP group is a block of contiguous ranks as `build` makes it), and that mesh. Collective, on every
        rank; the groups are the mesh's own, and `release` destroys them as it destroys those `build` creates."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
            raise ValueError(f"layout {layout} needs an initialised process group of {layout.world_size} ranks.")
        mesh = init_device_mesh(device_type, (layout.data_parallel_size, layout.sequence_parallel_size),
                                mesh_dim_names=cls.MESH_DIMENSIONS)
        sequence_parallel_group = mesh.get_group("sequence_parallel")
        data_parallel_group = mesh.get_group("data_parallel")
        # A dimension spanning the whole world is the default group itself (torch reuses it): never destroyed here.
        world = torch_private.default_process_group()
        created = [group for group in (sequence_parallel_group, data_parallel_group) if group is not world]
        shared = _SharedGroups(sequence_parallel_group, data_parallel_group, {}, created=created)
        return cls(layout, dist.get_rank(), None, None, _shared=shared), mesh

    @property
    def released(self) -> bool:
        return self._shared.released

    def release(self) -> None:
        """Destroy every process group these groups created (SP, DP, then the Ulysses/ring sub-groups in the order
        they were built) and drop this object's references to them; a second call does nothing.

        Call it on every rank of the world, in the same order relative to other group creations and destructions,
        once no collective on these groups is pending on any rank (e.g. after a barrier): NCCL's communicator
        destruction may wait for the peers' (`destroy_process_group` shuts each group's backend down). Each rank
        destroys the groups it belongs to, in creation order, which is the same order on every member. Through
        DeepSpeed's `destroy_process_group` when DeepSpeed's communication backend is up, so that DeepSpeed forgets
        any reference it cached to them; torch's otherwise. A group's threads and connections (gloo) end when the
        last reference to it goes, which may be held elsewhere (a DeepSpeed engine keeps the SP group it trained on).
        """
        shared = self._shared
        if shared.released:
            return
        shared.released = True
        destroy = _destroy_process_group()
        registered = torch_private.registered_process_groups()
        for group in shared.created:
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and group in registered:
                destroy(group)
        shared.created.clear()
        shared.sequence_parallel = shared.data_parallel = None
        shared.subgroups.clear()

    def _check_not_released(self) -> None:
        if self._shared.released:
            raise RuntimeError(
                "These sequence-parallel process groups were released (the strategy releases its groups when each"
                " fit/validate/test/predict ends): use them inside such a run (e.g. in LightningModule.setup,"
                " configure_model or a step). Their sizes and this rank's ranks stay readable.")

    # -- the names this project uses ------------------------------------------------------------------------
    @property
    def sequence_parallel_group(self):
        self._check_not_released()
        return self._shared.sequence_parallel

    @property
    def sequence_parallel_rank(self) -> int:
        return self.layout.sequence_parallel_rank(self.global_rank)

    @property
    def sequence_parallel_world_size(self) -> int:
        return self.layout.sequence_parallel_size

    @property
    def ulysses_group(self):
        """The ranks that trade heads for tokens (all-to-all); None when `ulysses_size == 1` (pure ring)."""
        self._check_not_released()
        return self._shared.subgroups[self.layout.ring_size][0] if self.layout.sequence_parallel_size > 1 else None

    @property
    def ring_group(self):
        """The ranks that pass K/V blocks around; None when `ring_size == 1` (pure Ulysses)."""
        self._check_not_released()
        return self._shared.subgroups[self.layout.ring_size][1]

    @property
    def ulysses_size(self) -> int:
        return self.layout.ulysses_size

    @property
    def ring_size(self) -> int:
        return self.layout.ring_size

    @property
    def shard_order(self) -> ShardOrder:
        return self.layout.shard_order

    @property
    def data_parallel_group(self):
        self._check_not_released()
        return self._shared.data_parallel

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(self.global_rank)

    @property
    def data_parallel_world_size(self) -> int:
        return self.layout.data_parallel_size

    def deepspeed_mpu(self) -> DeepSpeedSequenceParallelMPU:
        """The object to pass as `deepspeed.initialize(mpu=...)`."""
        return DeepSpeedSequenceParallelMPU(self)


@dataclass
class _SharedGroups:
    """The process groups of a `SequenceParallelGroups` and of its `with_ring_size` copies."""

    sequence_parallel: object
    data_parallel: object
    subgroups: dict  # ring_size → (ulysses group, ring group)
    created: list = field(default_factory=list)  # what `build` and the sub-group splits created, in creation order
    released: bool = False


def _destroy_process_group():
    """DeepSpeed's `destroy_process_group` (which also drops DeepSpeed's cached references to the group) when its
    communication backend is up, torch's otherwise."""
    import deepspeed.comm

    return deepspeed.comm.destroy_process_group if deepspeed.comm.is_initialized() else dist.destroy_process_group


class DeepSpeedSequenceParallelMPU:
    """Exactly the interface of DeepSpeed's own SP mpu (`deepspeed/runtime/sequence_parallel/parallel_state_sp.py`).

    DeepSpeed recognises an SP-style mpu by `initialize_sequence_parallel` (`deepspeed/utils/groups.py`) and then
    partitions ZeRO state and reduces gradients over `get_sequence_data_parallel_group()`: all DP×SP ranks.
    It deliberately has no `get_data_parallel_group`: ZeRO-3 partitions parameters over that group when an mpu
    offers it (`runtime/zero/parameter_offload.py`), while its optimizer reduce-scatters over the DP×SP group;
    the mismatch silently corrupts every gradient that differs between ranks (measured: SGD updates off by ~100%).
    The model-parallel getters alias the SP group, as in DeepSpeed's: stage-0 gradient clipping then counts a
    gradient replicated over the SP group once.
    """

    def __init__(self, groups: SequenceParallelGroups):
        self._groups = groups

    def initialize_sequence_parallel(self, *args, **kwargs):  # the marker DeepSpeed looks for
        raise RuntimeError("The sequence-parallel groups are already initialised by lightning_ulysses.")

    def get_sequence_parallel_group(self):
        return self._groups.sequence_parallel_group

    def get_sequence_parallel_rank(self) -> int:
        return self._groups.sequence_parallel_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self._groups.sequence_parallel_world_size

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD

    def get_sequence_data_parallel_rank(self) -> int:
        return self._groups.global_rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._groups.layout.world_size

    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_rank = get_sequence_parallel_rank
    get_model_parallel_world_size = get_sequence_parallel_world_size
