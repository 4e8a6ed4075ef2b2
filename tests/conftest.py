import os
from pathlib import Path

import pytest
import torch

# DeepSpeed JIT-builds a shared-memory comm op on first use: keep its cache in the project's ignored folders.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))

# What runs in this process (unit tests, the single-process references) works on tiny tensors: one intra-op thread,
# like every launched rank (OMP_NUM_THREADS=1). Two threads gain nothing on such ops and, whenever the other core
# is busy, spin at every barrier: a 3-step reference that takes 0.2 s took 10-20 s that way. Only this process:
# subprocesses (notebook kernel, recipes) keep their own environment.
torch.set_num_threads(1)


# Tests that bound how long their own processes take (the notebook's 180 s budget, the fault tests' 120 s, the fork
# launch's worker 240 s, the torchrun nodes 400 s): run last, once the shared launches are done, with the machine to
# themselves as before. Measured: next to the background 4-rank launch, the fork launch's worker ran past its 240 s
# (87 s alone) and the torchrun nodes took 330 s.
TIMED = ("tests.test_notebook", "tests.distributed.test_faults", "tests.distributed.test_notebook_launch",
         "tests.distributed.test_multinode")


def pytest_collection_modifyitems(session, config, items):
    """The shared launches start in the background with the first test (`shared_launches`, tests/distributed/pool.py)
    and keep the machine busy while everything else runs: first the unit tests (in this process, on one core), then
    the tests with launches and subprocesses of their own, then the tests that read the shared launches (they wait
    for them), then TIMED."""
    import sys

    pool = sys.modules.get("tests.distributed.pool")
    pooled = pool.POOL.modules() if pool is not None else set()

    def phase(item) -> int:
        module = item.module.__name__ if item.module is not None else ""
        return 0 if module.startswith("tests.unit.") else 3 if module in TIMED else 2 if module in pooled else 1

    items.sort(key=phase)  # stable: within a phase, the files and their tests keep their order


@pytest.fixture(scope="session", autouse=True)
def shared_launches(tmp_path_factory):
    """Start the shared launches of the selected tests in the background (tests/distributed/pool.py)."""
    import sys

    pool = sys.modules.get("tests.distributed.pool")
    if pool is not None:
        pool.start_in_background(tmp_path_factory)


def pytest_collection_finish(session):
    """Tell the shared launches (tests/distributed/pool.py) which test modules have selected tests: a launch runs
    the jobs of those only."""
    import sys

    pool = sys.modules.get("tests.distributed.pool")
    if pool is not None:
        pool.POOL.selected_modules = {item.module.__name__ for item in session.items if item.module is not None}


def pytest_unconfigure(config):
    """Reap the server the launches fork their ranks from (tests/distributed/harness.py), with their CPU time."""
    import sys

    harness = sys.modules.get("tests.distributed.harness")
    if harness is not None:
        harness.stop_forkserver()
