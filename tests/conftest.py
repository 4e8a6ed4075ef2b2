import os
from pathlib import Path

import torch

# DeepSpeed JIT-builds its ops on first use (CPU Adam, for the optimizer-offload tests): their cache goes in the
# project's ignored folders, in a folder of the tests' own, which build CPU Adam with other flags
# (tests/deepspeed_builds.py): a product run sharing the folder would rebuild it whenever the other ran.
os.environ["TORCH_EXTENSIONS_DIR"] = str(
    Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
    / "tests")

# What runs in this process (unit tests, the single-process references) works on tiny tensors: one intra-op thread,
# like every launched rank (OMP_NUM_THREADS=1). Two threads gain nothing on such ops and, whenever the other core
# is busy, spin at every barrier: a 3-step reference that takes 0.2 s took 10-20 s that way. Only this process:
# subprocesses (notebook kernel, recipes) keep their own environment.
torch.set_num_threads(1)


def pytest_configure(config):
    from tests.deepspeed_builds import build_cpu_adam_without_debug_info

    build_cpu_adam_without_debug_info()


def pytest_unconfigure(config):
    """Reap the server the launches fork their ranks from (tests/distributed/harness.py), with their CPU time."""
    import sys

    harness = sys.modules.get("tests.distributed.harness")
    if harness is not None:
        harness.stop_forkserver()
