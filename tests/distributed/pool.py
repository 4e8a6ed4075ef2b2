"""Distributed jobs whose cases each run on ranks of their own: nothing of one case is in the process of another.

A test file registers its job when it is imported (`shared(world_size, name, script, spec)`). A job whose spec
lists `cases` (each with its `name`; the worker saves its results keyed by it) runs every case in a launch of its
own, on ranks freshly forked from harness.py's server (no process group, DeepSpeed global, patched function, random
state or cache of an earlier case), when a test first reads that case's results: `ranks(...)[rank][name]`. So a
test selected alone runs exactly the cases it reads, as they run in the full suite, and a case that fails fails
only the tests reading it (with its launch's error: every rank's log). The cases of one job share its folder, so a
case can read what another wrote (a checkpoint to resume): a case naming another's folder in `READS` runs after it
(`workdir(...) / "<case>/..."` runs that case too). A job without `cases` runs whole in one launch of its own.

Cost: a case's launch forks its ranks (~0.05 s each), sets up a process group and its first Trainer or engine; the
server has imported and warmed what those need (server_preload.py), measured in tests/README.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from tests.distributed.harness import DistributedLaunchError, launch, launch_case

# A case's keys whose value names a folder another case of its job wrote (workers/resume.py: the checkpoint to
# resume, the root of a requeued run): its first path component is that case's name.
READS = ("resume", "root")


@dataclass
class _Job:
    world_size: int
    name: str
    script: Path
    spec: dict
    timeout: float  # of each launch (a case's, or the whole job's)
    module: str  # the test module that registered it
    folder: Optional[Path] = None  # made at the first launch
    # case name (None: the whole job) -> the ranks' results, or the launch's error
    outcomes: dict[Optional[str], object] = field(default_factory=dict)

    @property
    def cases(self) -> dict[str, dict]:
        return {case["name"]: case for case in self.spec.get("cases", ())}

    def needs(self, name: str) -> list[str]:
        """The other cases whose folders case `name` reads."""
        cases = self.cases
        named = [str(cases[name][key]).split("/")[0] for key in READS if key in cases[name]]
        return [other for other in named if other in cases and other != name]

    def outcome(self, name: Optional[str], tmp_path_factory) -> list[dict]:
        """The ranks' results of case `name` (None: of the whole job), launching it (after what it reads) first."""
        if name not in self.outcomes:
            for needed in self.needs(name) if name is not None else ():
                try:
                    self.outcome(needed, tmp_path_factory)
                except DistributedLaunchError as error:
                    self.outcomes[name] = DistributedLaunchError(f"case {name} reads what case {needed} wrote, and "
                                                                 f"case {needed} failed:\n{error}")
                    break
            else:
                self.outcomes[name] = self._launch(name, tmp_path_factory)
        outcome = self.outcomes[name]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _launch(self, name: Optional[str], tmp_path_factory) -> object:
        if self.folder is None:
            self.folder = tmp_path_factory.mktemp(f"{self.name}_world{self.world_size}")
        try:
            if name is None:
                return launch(self.script, self.world_size, self.spec, self.folder, self.timeout)
            return launch_case(self.script, self.world_size, dict(self.spec, cases=[self.cases[name]]), self.folder,
                               name, self.timeout)
        except DistributedLaunchError as error:  # every test reading this case reports it
            return error


class CaseResults(Mapping):
    """What one rank saved, case name -> results, each case launched on first read."""

    def __init__(self, job: _Job, rank: int, tmp_path_factory):
        self.job, self.rank, self.tmp_path_factory = job, rank, tmp_path_factory

    def __getitem__(self, name: str):
        if name not in self.job.cases:
            raise KeyError(name)
        return self.job.outcome(name, self.tmp_path_factory)[self.rank][name]

    def __contains__(self, name) -> bool:  # (without launching it)
        return name in self.job.cases

    def __iter__(self) -> Iterator[str]:
        return iter(self.job.cases)

    def __len__(self) -> int:
        return len(self.job.cases)


class JobFolder:
    """The folder a job's cases run in: `folder / "<case>/..."` is the path once case `<case>` has run."""

    def __init__(self, job: _Job, tmp_path_factory):
        self.job, self.tmp_path_factory = job, tmp_path_factory

    def __truediv__(self, path: str) -> Path:
        case = str(path).split("/")[0]
        if case in self.job.cases:
            self.job.outcome(case, self.tmp_path_factory)
        elif self.job.folder is None:
            self.job.folder = self.tmp_path_factory.mktemp(f"{self.job.name}_world{self.job.world_size}")
        return self.job.folder / path


class SharedJob:
    """A handle a test file keeps; `ranks(tmp_path_factory)` gives its ranks' results (per case, launched on first
    read), `workdir(tmp_path_factory)` the folder its cases ran in (their files; each case's spec, logs and results
    under `launches/<case>`)."""

    def __init__(self, job: _Job):
        self.job = job

    def ranks(self, tmp_path_factory) -> list:
        if "cases" in self.job.spec:
            return [CaseResults(self.job, rank, tmp_path_factory) for rank in range(self.job.world_size)]
        return self.job.outcome(None, tmp_path_factory)

    def workdir(self, tmp_path_factory):
        if "cases" in self.job.spec:
            return JobFolder(self.job, tmp_path_factory)
        self.job.outcome(None, tmp_path_factory)
        return self.job.folder


_JOBS: dict[tuple[int, str], _Job] = {}


def shared(world_size: int, name: str, script: Path, spec: dict, timeout: float = 300) -> SharedJob:
    """Register a job of `world_size` ranks (at import of the test module, or later: nothing runs before a test
    reads it). `timeout`: of each launch (one case's; without `cases`, the whole job's)."""
    module = inspect.currentframe().f_back.f_globals["__name__"]
    known = _JOBS.get((world_size, name))
    assert known is None or known.module == module, f"two jobs named {name!r}"
    job = _JOBS[world_size, name] = _Job(world_size, name, Path(script), dict(spec, world_size=world_size), timeout,
                                         module)
    return SharedJob(job)
