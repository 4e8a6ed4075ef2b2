"""Hydra/OmegaConf helpers shared by the recipes and the config tests."""

import hashlib
import re
import sys
from datetime import datetime
from typing import Optional, Sequence

from omegaconf import OmegaConf

from lightning_ulysses.integration.faults import slurm_job_id

# Arguments that do not change what a run trains: how it resumes, Hydra's own (Lightning's script launcher adds
# `hydra.run.dir=...` for the ranks it starts), flags such as `-m`.
_RUN_CONTROL = re.compile(r"^(\+{0,2}(resume|run_name)=|\+{0,2}hydra\.|-)")


def default_run_name(argv: Optional[Sequence[str]] = None, job_id: Optional[str] = None) -> str:
    """The folder name (`outputs/<run_name>`) of a run not named with `run_name=`: the launch's date and time, or,
    under SLURM, the job's id and a digest of the command's overrides (`argv`: `sys.argv`), `slurm-<job>/<digest>`.
    A requeued SLURM job runs its job script again under the same job id, so the same command finds the folder it
    was preempted in and continues (`resume=auto`); another command of the same job gets a folder of its own."""
    job_id = slurm_job_id() if job_id is None else job_id
    if not job_id:
        return datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    overrides = [argument for argument in (sys.argv if argv is None else argv)[1:] if not _RUN_CONTROL.match(argument)]
    return f"slurm-{job_id}/{hashlib.sha256(chr(0).join(overrides).encode()).hexdigest()[:8]}"


def register_resolvers() -> None:
    """`${half:${data.seq_len}}` in YAML: integer half of a value (the copy task's second half starts there);
    `${default_run_name:}`: `default_run_name()`."""
    if not OmegaConf.has_resolver("half"):
        OmegaConf.register_new_resolver("half", lambda value: int(value) // 2)
    if not OmegaConf.has_resolver("default_run_name"):
        # use_cache: one name per process, however often the config reads it (the time would move on)
        OmegaConf.register_new_resolver("default_run_name", default_run_name, use_cache=True)
