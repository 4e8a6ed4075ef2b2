"""How the tests have DeepSpeed JIT-build its CPU Adam (the optimizer-offload tests): without debug information.

DeepSpeed compiles the op with `-g`, which no test reads and which is 40% of a build that every fresh clone pays in
full (cpu_adam.cpp alone on a 2-core machine: 101 s with it, 62 s without); gcc's `-g` does not change the code
it generates. Applied in the pytest process (tests/conftest.py) and in every rank the harness forks
(tests/distributed/harness.py), so that all of them build and load one library; its cache is a folder of the
tests' own (tests/conftest.py), so that a product run, which builds with DeepSpeed's flags, never shares it.
"""

from __future__ import annotations


def build_cpu_adam_without_debug_info() -> None:
    """Once per process: the pytest process at configure, each rank as it starts (forked from a server that never
    calls it)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder  # the builder this accelerator's DeepSpeedCPUAdam loads

    with_debug_info = CPUAdamBuilder.cxx_args
    CPUAdamBuilder.cxx_args = lambda self: [flag for flag in with_debug_info(self) if flag != "-g"]
