"""Launches shared between test files: one launch per world size runs the jobs of every test file that asks.

A test file registers its job when it is imported (`shared(world_size, name, script, spec)`), i.e. at collection,
before any test runs. The first test that needs a job of world size N launches, in one go, every registered job
of that world size whose file has a selected test (harness.launch_parts); the other files' tests then read their
ranks' results from that launch. A failed launch fails every test that depends on it, with the launch's error
(the log of every rank, each part's start marked): it is not run again.

Why: every launch sets up a process group, and every rank pays once for what its first Trainer and ZeRO engine set
up; ranks forked from harness.py's server no longer import torch, Lightning, DeepSpeed and transformers each (that
was 15-17 s of CPU per rank), but one launch for many jobs still starts fewer of them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tests.distributed.harness import launch_parts


@dataclass
class _Job:
    world_size: int
    name: str
    script: Path
    spec: dict
    timeout: float
    module: str  # the test module that registered it


@dataclass
class _Pool:
    jobs: dict[int, dict[str, _Job]] = field(default_factory=dict)
    # world size -> {name: (ranks' results, the job's workdir)}, or the launch's error
    outcomes: dict[int, object] = field(default_factory=dict)
    selected_modules: Optional[set[str]] = None  # set by tests/conftest.py once the selection is known


POOL = _Pool()


class SharedJob:
    """A handle a test file keeps; `ranks(tmp_path_factory)` gives its ranks' results (launching on first use),
    `workdir(tmp_path_factory)` the folder the job ran in (its checkpoints, its ranks' logs are one level up)."""

    def __init__(self, job: _Job):
        self.job = job

    def ranks(self, tmp_path_factory) -> list[dict]:
        return self._outcome(tmp_path_factory)[0]

    def workdir(self, tmp_path_factory) -> Path:
        return self._outcome(tmp_path_factory)[1]

    def _outcome(self, tmp_path_factory) -> tuple[list[dict], Path]:
        world = self.job.world_size
        if world not in POOL.outcomes:
            jobs = [job for job in POOL.jobs[world].values()
                    if POOL.selected_modules is None or job.module in POOL.selected_modules or job is self.job]
            workdir = tmp_path_factory.mktemp(f"shared_world{world}")
            try:
                POOL.outcomes[world] = _launch(world, jobs, workdir)
            except Exception as error:  # noqa: BLE001 - every dependent test reports it
                POOL.outcomes[world] = error
        outcome = POOL.outcomes[world]
        if isinstance(outcome, Exception):
            raise outcome
        if self.job.name not in outcome:  # registered after the launch (not at import): a launch of its own
            outcome.update(_launch(world, [self.job], tmp_path_factory.mktemp(f"{self.job.name}_alone")))
        return outcome[self.job.name]


def _launch(world_size: int, jobs: list[_Job], workdir: Path) -> dict[str, tuple[list[dict], Path]]:
    results = launch_parts(world_size, {job.name: (job.script, job.spec, job.timeout) for job in jobs}, workdir)
    return {name: (ranks, workdir / name) for name, ranks in results.items()}


def shared(world_size: int, name: str, script: Path, spec: dict, timeout: float = 300) -> SharedJob:
    """Register a job (at import of the test module) for the shared launch of `world_size` ranks."""
    module = inspect.currentframe().f_back.f_globals["__name__"]
    jobs = POOL.jobs.setdefault(world_size, {})
    assert name not in jobs or jobs[name].module == module, f"two shared jobs named {name!r}"
    job = jobs[name] = _Job(world_size, name, Path(script), dict(spec, world_size=world_size), timeout, module)
    return SharedJob(job)
