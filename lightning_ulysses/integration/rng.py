"""Dropout that differs from shard to shard: one random stream per sequence-parallel rank for the steps.

Lightning seeds every rank alike (`seed_everything`, and `reset_seed` each time a strategy sets up), which is what
everything that must agree across ranks needs. But the ranks of an SP group hold different slices of the same rows:
drawing from that one shared generator, every dropout of a step draws the same mask on every SP rank, so token `i`
of shard 0 is dropped exactly when token `i` of shard 1 is (hidden, residual and embedding dropout, LoRA's adapter
dropout), and after the all-to-all head group 0 exactly like head group 1 (attention-probability dropout): masks
correlated along the sequence, which no run on one device has.

`SequenceParallelRNG` gives each rank two streams of torch's default generators (the CPU one and the CUDA one of
the rank's device; Python's and numpy's stay single):

- the **shared** stream, as Lightning seeds it, identical on every rank. Everything outside the steps draws from
  it: model initialisation (also inside ZeRO-3's `zero.Init`), LoRA adapters, the data loader's base seed and any
  sampler, dataset or collator drawing from the global generator, callbacks, the strategy itself. So replicas
  start equal and every rank of an SP group still loads the same samples.
- the rank's **own** stream, for the steps on shards (`steps()`: the strategy's training step and backward, and
  validation/test/predict steps while batches are sharded): swapped in when a step starts and out when it ends, so
  a step's draws neither come from nor move the shared stream. It is seeded from the SP rank and the next value
  the shared stream would give, read without drawing it: after `seed_everything(s)` a function of `s` alone, so
  runs with the same seed draw the same masks, and every set-up (each `fit`, `validate`, ...) seeds it again, as
  Lightning's `reset_seed` does the shared one.

Data-parallel replicas of one SP rank share its stream, as plain DDP replicas share Lightning's (they hold other
samples). At SP size 1 nothing is swapped: the run draws exactly as under Lightning's own `DeepSpeedStrategy`.
The memory engine's recomputes (`lightning_ulysses.memory`) record the generator state at their forward and replay
it, so they draw the masks of the stream their forward drew from. Checkpoints save both streams per rank
(`collect`, `restore`), so a resume at the same layout continues both exactly.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial
from typing import Any, Iterator, Mapping, Optional

import torch
from lightning.fabric.utilities.seed import pl_worker_init_function

from lightning_ulysses.fences import _lightning_private as lightning_private

# The key of the rank's own stream in the RNG states a checkpoint saves (beside Lightning's "torch", "numpy", ...).
STATE_KEY = "ulysses_sequence_parallel"

_States = tuple[torch.Tensor, Optional[torch.Tensor]]  # (CPU generator state, CUDA generator state or None)


def stream_seed(shared_value: int, sequence_parallel_rank: int) -> int:
    """The seed of SP rank `sequence_parallel_rank`'s own stream, from a value of the shared stream: distinct per rank
    (numpy's `SeedSequence` hashes both), the same on every run and data-parallel replica."""
    import numpy as np

    sequence = np.random.SeedSequence(shared_value, spawn_key=(sequence_parallel_rank,))
    return int(sequence.generate_state(1, np.uint64)[0])


def next_shared_value() -> int:
    """The next 63-bit value of the default CPU generator, read from a copy: the generator itself does not move."""
    copy = torch.Generator()
    copy.set_state(torch.random.get_rng_state())
    return int(torch.randint(0, 2**63 - 1, (), generator=copy))


def _capture(device: Optional[torch.device]) -> _States:
    cuda = torch.cuda.get_rng_state(device) if device is not None else None
    return torch.random.get_rng_state(), cuda


def _install(states: _States, device: Optional[torch.device]) -> None:
    cpu, cuda = states
    torch.random.set_rng_state(cpu)
    if device is not None and cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class SequenceParallelRNG:
    """This rank's shared and own random streams (see the module docstring). Until `reset` gives it an SP rank of a
    group larger than one, it changes nothing: `steps()` draws from the shared stream and `collect`/`restore` are
    Lightning's own."""

    def __init__(self) -> None:
        self._own: Optional[_States] = None  # the own stream's states while the shared one is installed
        self._shared: Optional[_States] = None  # the shared stream's states while the own one is installed
        self._cuda_device: Optional[torch.device] = None  # the CUDA device whose generator is swapped too

    @property
    def active(self) -> bool:
        """Whether the rank's own stream is installed now (inside a step)."""
        return self._shared is not None

    def reset(self, sequence_parallel_rank: int, sequence_parallel_size: int, device: torch.device) -> None:
        """Seed the rank's own stream (SP size 1: none), from the shared stream as it is now: call it where the
        strategy sets up, after Lightning's `reset_seed`."""
        if self.active:
            raise RuntimeError("The sequence-parallel random streams cannot be reset inside a step.")
        self._cuda_device = device if device.type == "cuda" else None
        if sequence_parallel_size == 1:
            self._own = None
            return
        seed = stream_seed(next_shared_value(), sequence_parallel_rank)
        cuda = None
        if self._cuda_device is not None:
            cuda = torch.Generator(device=self._cuda_device).manual_seed(seed).get_state()
        self._own = torch.Generator().manual_seed(seed).get_state(), cuda

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """Draw from the rank's own stream inside (re-entrant: a backward inside a manual-optimisation step stays on
        it); the shared stream is back in place afterwards, also when the step raises."""
        if self._own is None or self.active:
            yield
            return
        self._shared = _capture(self._cuda_device)
        _install(self._own, self._cuda_device)
        try:
            yield
        finally:
            self._own = _capture(self._cuda_device)
            _install(self._shared, self._cuda_device)
            self._shared = None

    @contextlib.contextmanager
    def _outside_steps(self) -> Iterator[None]:
        """The shared stream installed inside, also when called from a step."""
        if not self.active:
            yield
            return
        own = _capture(self._cuda_device)
        _install(self._shared, self._cuda_device)
        try:
            yield
        finally:
            self._shared = _capture(self._cuda_device)
            _install(own, self._cuda_device)

    def collect(self) -> dict[str, Any]:
        """Every generator state a checkpoint keeps for this rank: Lightning's (`torch`, `torch.cuda`, `numpy`,
        `python`: the shared stream) and, at SP > 1, the rank's own stream under `STATE_KEY`."""
        # Inside a step the own stream is the one installed: its live state, not the one kept from the step's start.
        own = _capture(self._cuda_device) if self.active else self._own
        with self._outside_steps():
            states = lightning_private.collect_rng_states(include_cuda=torch.cuda.is_available())
        if own is not None:
            states[STATE_KEY] = {"torch": own[0], "torch.cuda": own[1]}
        return states

    def restore(self, states: Mapping[str, Any]) -> None:
        """Install what `collect` returned: the shared stream, and the own stream where both the checkpoint and this
        run have one (a checkpoint without it, e.g. written before it existed, leaves the freshly seeded one)."""
        if self.active:
            raise RuntimeError("Random states cannot be restored inside a step.")
        states = dict(states)
        own = states.pop(STATE_KEY, None)
        lightning_private.set_rng_states(states)
        if own is not None and self._own is not None:
            cuda = own["torch.cuda"] if self._cuda_device is not None and own["torch.cuda"] is not None else self._own[1]
            self._own = own["torch"], cuda


def seed_workers_by_data_parallel_rank(dataloader: object, data_parallel_rank: int) -> None:
    """Data-loader workers of the ranks of one SP group seeded alike: with `seed_everything(..., workers=True)`
    Lightning gives a loader without its own `worker_init_fn` one that seeds each worker from the *global* rank
    (`_auto_add_worker_init_fn`, after the strategy's `process_dataloader`), so a dataset or collator drawing random
    numbers in its workers would hand the ranks of one SP group different samples. Setting Lightning's own function
    with the DP rank first keeps its seeding (distinct per worker and DP replica) and makes the SP ranks agree.
    A `worker_init_fn` of the user's is left as it is."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=data_parallel_rank)
