"""`UlyssesRuntime`: what a Ulysses strategy's runs are made of, built in one place, whatever shards the parameters.

A strategy is an adapter of its backend (`UlyssesDeepSpeedStrategy`: DeepSpeed's engine; `UlyssesFSDPStrategy`:
FSDP2's `fully_shard`) around one runtime, which owns every collaborator both need:

- `parallel` (`parallel_run.ParallelRun`): the layout and groups, the run's description, the sharder, the module
  pipeline (preparation, the loss) and evaluation on whole rows;
- `auto` (`planning.auto.AutoDecisions`): `memory="auto"` and `sdpa_kernel_priority="auto"`;
- `batch_check` (`batch.check.SameBatchCheck`) and `value_check` (`logged_values.SameValueCheck`: the training loss
  and the logged values): what the ranks of an SP group must agree on, compared by value;
- `random_streams` (`rng.SequenceParallelRNG`), `checkpoints` (`checkpoint.resume.StrategyCheckpoints`) and
  `faults` (`faults.RunFaults`: signals, requeue, the rank watchdog);
- `process_state` (`process_state.ProcessWideState`): what a run replaces for the whole process, put back at its
  teardown;
- `micro_batches_accumulated`: micro-batches whose gradients are held without a step yet (a checkpoint saved inside
  an accumulation window records it, and a resume from it is refused).

The Lightning hooks that drive it are `sequence_parallel_hooks.SequenceParallelHooks`, shared by both strategies;
what differs per backend is a handful of small methods there (`_start_backward`, `_adopt_run`, ...). A third backend
is a strategy class that builds a runtime and fills those in.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from lightning_ulysses.attention.backends import check_sdpa_kernel_priority
from lightning_ulysses.attention.core import check_overlap_head_groups
from lightning_ulysses.batch.check import CheckBatches, SameBatchCheck
from lightning_ulysses.batch.sharding import SequencePadding, check_sequence_padding
from lightning_ulysses.integration import console, faults
from lightning_ulysses.integration.checkpoint.resume import StrategyCheckpoints
from lightning_ulysses.integration.logged_values import PerRankValues, SameValueCheck
from lightning_ulysses.integration.parallel_run import ParallelRun
from lightning_ulysses.integration.process_state import ProcessWideState
from lightning_ulysses.integration.rng import SequenceParallelRNG
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.planning import auto


class UlyssesRuntime:
    """The collaborators of one strategy (see the module docstring), from the arguments both strategies take; every
    argument is checked here, in the launching process, before Lightning starts any rank. `strategy`: the strategy
    the checkpoints save through."""

    def __init__(self, strategy: Any, *, sequence_parallel_size: Optional[int], ring_size: Optional[int],
                 sequence_padding: SequencePadding,
                 memory: Union[MemoryOptions, "auto.AutoMemory", str, Mapping[str, Any], None],
                 sdpa_kernel_priority: Union[str, Sequence[str], None], overlap_head_groups: int,
                 check_batches: CheckBatches, per_rank_values: Optional[PerRankValues],
                 heartbeat_timeout: Optional[float],
                 sequence_parallel_in_evaluation: bool, quiet_third_party: bool) -> None:
        if quiet_third_party:  # first: Lightning's Trainer prints its notes, and DeepSpeed is first imported, later
            console.quiet_third_party()
        self.quiet_third_party = quiet_third_party
        memory = auto.coerce_memory(memory)
        if sdpa_kernel_priority != "auto":
            sdpa_kernel_priority = check_sdpa_kernel_priority(sdpa_kernel_priority)
        self.overlap_head_groups = check_overlap_head_groups(overlap_head_groups)
        check_sequence_padding(sequence_padding)
        self.faults = faults.RunFaults(faults.check_heartbeat_timeout(heartbeat_timeout))
        self.parallel = ParallelRun(sequence_parallel_size, ring_size, sequence_padding)
        self.sequence_parallel_in_evaluation = sequence_parallel_in_evaluation
        self.auto = auto.AutoDecisions(memory, sdpa_kernel_priority)  # decided in the first run's `setup`
        self.batch_check = SameBatchCheck(check_batches)
        self.value_check = SameValueCheck(check_batches, per_rank_values)
        # Dropout masks differ between the SP ranks: the steps draw from a stream of their own (`rng.py`).
        self.random_streams = SequenceParallelRNG()
        # Atomic saves with a manifest, exact resume (data position, random streams) at the same or another split.
        self.checkpoints = StrategyCheckpoints(strategy, self.random_streams, quiet=quiet_third_party)
        self.micro_batches_accumulated = 0
        # What a run replaces for the whole process (DeepSpeed's linear, the allocator's setting), as it was found.
        self.process_state = ProcessWideState()

    def count_micro_batch(self, ends_window: bool) -> None:
        """One more micro-batch's gradients held, or none once its window ends (its step follows)."""
        self.micro_batches_accumulated = 0 if ends_window else self.micro_batches_accumulated + 1
