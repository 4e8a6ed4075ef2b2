import os
import random
from pathlib import Path

import pytest
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


# What one test may leave in this process for the next: torch's functions replaced (DeepSpeed's zero.Init replaces
# torch.nn.functional.linear and keeps it so), global settings, the random streams. The references computed here
# (tests/distributed/reference.py) and every later test must start from torch's own. Put back after every test,
# with a warning naming what was left, so that a test run alone starts as it does in the full suite.
_MODULES_KEPT = (torch, torch.nn.functional)
_SETTINGS = {"default dtype": (torch.get_default_dtype, torch.set_default_dtype),
             "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
             "deterministic algorithms": (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
             "intra-op threads": (torch.get_num_threads, torch.set_num_threads)}


@pytest.fixture(autouse=True)
def _process_state_put_back(request):
    attributes = [dict(vars(module)) for module in _MODULES_KEPT]
    settings = {name: read() for name, (read, _) in _SETTINGS.items()}
    streams = torch.get_rng_state(), random.getstate()
    yield
    left = []
    for module, before in zip(_MODULES_KEPT, attributes):
        for name, value in before.items():
            if vars(module).get(name) is not value:
                left.append(f"{module.__name__}.{name}")
                setattr(module, name, value)
    for name, (read, write) in _SETTINGS.items():
        if read() != settings[name]:
            left.append(name)
            write(settings[name])
    torch.set_rng_state(streams[0])  # (drawing from them is no leftover: put back without a word)
    random.setstate(streams[1])
    if left:
        request.node.warn(pytest.PytestWarning(f"left changed in the test process, put back: {', '.join(left)}"))


def pytest_configure(config):
    from tests.deepspeed_builds import build_cpu_adam_without_debug_info

    build_cpu_adam_without_debug_info()


def pytest_unconfigure(config):
    """Reap the server the launches fork their ranks from (tests/distributed/harness.py), with their CPU time."""
    import sys

    harness = sys.modules.get("tests.distributed.harness")
    if harness is not None:
        harness.stop_forkserver()
