"""The one place that knows the sequence-parallel (SP) × data-parallel (DP) layout.

`ParallelLayout` is pure arithmetic (sizes and ranks, validated once, no communication), so every bad
configuration is rejected before any collective runs and no rank is left hanging.
`SequenceParallelGroups` owns the process groups built from a layout and hands DeepSpeed the `mpu` it needs to
partition ZeRO state over all DP×SP ranks and reduce gradients over them.

Ranks are laid out SP-major: an SP group is a block of contiguous global ranks, so with the usual
"devices per node" ranks per node an SP group stays inside a node (its all-to-alls run over NVLink), and DP
groups stride across the SP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


def check_sequence_parallel_size(size: object) -> None:
    """The checks that need no world size: an integer >= 1."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"sequence_parallel_size must be an integer >= 1, got {size!r}. Use 1 to turn sequence parallelism"
            " off, or a divisor of the number of processes (devices × num_nodes)."
        )


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes and ranks of a `data_parallel_size × sequence_parallel_size` layout over `world_size` processes."""

    world_size: int
    sequence_parallel_size: int

    def __post_init__(self) -> None:
        sp, world = self.sequence_parallel_size, self.world_size
        check_sequence_parallel_size(sp)
        if world < 1:
            raise ValueError(f"world_size must be >= 1, got {world}")
        if world % sp != 0:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ValueError(
                f"sp({sp}) does not divide world_size({world}): the number of processes (devices × num_nodes) must be"
                f" a multiple of sequence_parallel_size. Valid sequence_parallel_size values here: {divisors}; or"
                f" change `devices`/`num_nodes` to a multiple of {sp}."
            )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.sequence_parallel_size

    def sequence_parallel_rank(self, global_rank: int) -> int:
        return global_rank % self.sequence_parallel_size

    def data_parallel_rank(self, global_rank: int) -> int:
        return global_rank // self.sequence_parallel_size

    def sequence_parallel_groups(self) -> list[list[int]]:
        """Global ranks of every SP group (contiguous blocks)."""
        sp = self.sequence_parallel_size
        return [list(range(start, start + sp)) for start in range(0, self.world_size, sp)]

    def data_parallel_groups(self) -> list[list[int]]:
        """Global ranks of every DP group (one per SP rank, striding over the SP groups)."""
        sp = self.sequence_parallel_size
        return [list(range(sp_rank, self.world_size, sp)) for sp_rank in range(sp)]

    def __str__(self) -> str:
        return f"dp({self.data_parallel_size}) × sp({self.sequence_parallel_size}) = world_size({self.world_size})"


class SequenceParallelGroups:
    """Process groups of a `ParallelLayout` for one rank, and the `mpu` adapter DeepSpeed needs.

    Build it with `SequenceParallelGroups.build(layout)` on every rank (group creation is collective).
    """

    def __init__(self, layout: ParallelLayout, global_rank: int, sequence_parallel_group, data_parallel_group):
        self.layout = layout
        self.global_rank = global_rank
        self._sequence_parallel_group = sequence_parallel_group
        self._data_parallel_group = data_parallel_group

    @classmethod
    def build(cls, layout: ParallelLayout) -> "SequenceParallelGroups":
        if not dist.is_initialized():
            raise RuntimeError("SequenceParallelGroups.build needs an initialised torch.distributed process group.")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"layout {layout} does not match the process group's world size {dist.get_world_size()}")
        # Every rank must create every group, in the same order.
        sequence_parallel_group, _ = dist.new_subgroups_by_enumeration(layout.sequence_parallel_groups())
        data_parallel_group, _ = dist.new_subgroups_by_enumeration(layout.data_parallel_groups())
        return cls(layout, dist.get_rank(), sequence_parallel_group, data_parallel_group)

    # -- the names this project uses ------------------------------------------------------------------------
    @property
    def sequence_parallel_group(self):
        return self._sequence_parallel_group

    @property
    def sequence_parallel_rank(self) -> int:
        return self.layout.sequence_parallel_rank(self.global_rank)

    @property
    def sequence_parallel_world_size(self) -> int:
        return self.layout.sequence_parallel_size

    @property
    def data_parallel_group(self):
        return self._data_parallel_group

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(self.global_rank)

    @property
    def data_parallel_world_size(self) -> int:
        return self.layout.data_parallel_size

    def deepspeed_mpu(self) -> "DeepSpeedSequenceParallelMPU":
        """The object to pass as `deepspeed.initialize(mpu=...)`."""
        return DeepSpeedSequenceParallelMPU(self)


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
