"""Launch N real CPU ranks (gloo) of a worker script, the way torchrun would, and collect what they wrote.

Each rank is a process of its own (forked from a server that imported the libraries once, see _PRELOAD) running the
script as `python <script>` would, with MASTER_ADDR/PORT, RANK, LOCAL_RANK and WORLD_SIZE set, so Lightning
treats the processes as externally launched. A rank that fails or hangs takes the whole launch down: the
others are killed and the log tails of every rank are raised, so a test can never hang the suite.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tests.deepspeed_builds import build_cpu_adam_without_debug_info

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DistributedLaunchError(RuntimeError):
    pass


@dataclass
class LaunchOutcome:
    returncodes: list[int]
    logs: list[str]
    seconds: float
    failure: Optional[str]  # "timeout", "a rank failed" or None


def torchrun_variables(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun gives every process of a single node."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                NODE_RANK="0")


# Ranks are forked from one process that imported torch, Lightning, DeepSpeed and transformers once (multiprocessing's
# forkserver): a fresh interpreter per rank spent ~15-17 s of CPU on those imports (DeepSpeed's Muon module, imported
# by the first ZeRO engine, `torch.compile`s at import), a fork ~0.05 s. Each rank is still `python <script> <args>`
# with its own environment, folder, output and exit status (a signal's: negative, as with a subprocess). The server
# runs nothing of any case: every rank starts from its state after these imports (server_preload.py: warm, settled).
_PRELOAD = ["lightning_ulysses", "deepspeed.runtime.zero.muon.muon_optimizer", "tests.distributed.common",
            "tests.distributed.server_preload"]


@functools.cache
def _forkserver() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    # The server imports _PRELOAD with its own sys.path, built from PYTHONPATH: this checkout's package first, not an
    # installed one.
    with _environment(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])):
        multiprocessing.forkserver.ensure_running()
    return context


def stop_forkserver() -> None:
    """End the server (tests/conftest.py, at the end of the session): it is reaped, with the CPU time of its ranks."""
    if _forkserver.cache_info().currsize:
        multiprocessing.forkserver._forkserver._stop()


@contextlib.contextmanager
def _environment(**variables: str):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def _as_script(script: str, args: list[str], env: dict, cwd: str, log: str, error_log: Optional[str] = None) -> None:
    """In the forked rank: what `python <script> <args>` with `env`, in `cwd`, output to `log` (its stderr to
    `error_log` if given) would do."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    if error_log is not None:  # (else both into one open file, one offset: no output overwrites another)
        os.close(output)
        output = os.open(error_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 2)
    os.close(output)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # what a fresh interpreter takes from OMP_NUM_THREADS
    build_cpu_adam_without_debug_info()  # as in the pytest process (tests/deepspeed_builds.py)
    sys.argv = [script, *args]
    # A fresh interpreter's path: the script's folder, then PYTHONPATH, then the rest.
    sys.path[:0] = [os.path.dirname(script), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # an interpreter's exit runs them; a forked process's does not


class _Rank:
    """One rank forked from the server, with the part of `subprocess.Popen` that run_ranks uses."""

    def __init__(self, script: Path, args: list[str], env: dict, cwd: Path, log: Path, error_log: Optional[Path] = None):
        self.process = _forkserver().Process(
            target=_as_script, args=(str(script), args, env, str(cwd), str(log), error_log and str(error_log)))
        # multiprocessing would have the rank run this process's main module first (as `__mp_main__`: pytest's, or
        # the script that launched): a rank is `python <script>` alone, however the session was started.
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:
            self.process.start()
        finally:
            sys.modules["__main__"] = main

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.process.exitcode

    def poll(self) -> Optional[int]:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode


def run_script(script: Path, args: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, script, *args], env=env, cwd=cwd, capture_output=True, text=True,
    timeout=timeout)` gives, with the process forked from the server (its imports done) instead of a fresh
    interpreter (~15 s of CPU importing torch, Lightning, DeepSpeed and transformers). Processes it starts itself
    (Lightning's launcher re-running the script for the other local ranks) are fresh interpreters as usual."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = start_script(script, args, env, cwd, out, err)
        process.process.join(timeout)
        if process.poll() is None:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired([sys.executable, str(script), *args], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess([sys.executable, str(script), *args], process.wait(), out.read_text(),
                                           err.read_text())


def start_script(script: Path, args: list[str], env: dict, cwd: Path, stdout: Path, stderr: Optional[Path]) -> _Rank:
    """`run_script` without waiting: the started process (`pid`, `poll`, `wait`, `kill`), its output written to
    `stdout` and `stderr` (None: into `stdout`) as it runs (a test can watch it, signal the process, then wait)."""
    return _Rank(script, args, env, cwd, stdout, stderr)


def run_ranks(script: Path, world_size: int, spec: dict, workdir: Path, timeout: float = 300,
              stop_on_first_failure: bool = True, launcher_variables=torchrun_variables,
              records: Optional[Path] = None) -> LaunchOutcome:
    """Run `script` on `world_size` ranks in `workdir`; return their exit statuses and logs. Ranks still running at
    the timeout (or, with `stop_on_first_failure`, shortly after one rank fails) are killed. `launcher_variables(rank,
    world_size)` gives the variables a launcher would set (torchrun's by default; SLURM's srun in a test). The spec
    file and the ranks' logs are written to `records` (default: `workdir`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    records = records or workdir
    records.mkdir(parents=True, exist_ok=True)
    spec_path = records / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = _free_port()
    processes = []
    start = time.monotonic()
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
            **launcher_variables(rank, world_size),
        )
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
        processes.append(_Rank(script, [str(spec_path), str(workdir)], env, workdir, records / f"rank_{rank}.log"))
    deadline = start + timeout
    failure = None
    while running := [p.process.sentinel for p in processes if p.poll() is None]:
        if time.monotonic() > deadline:
            failure = "timeout"
            break
        if stop_on_first_failure and any(p.returncode not in (None, 0) for p in processes):
            failure = "a rank failed"
            settle = time.monotonic() + 2  # let the failing rank's siblings report their own errors first
            while (running := [p.process.sentinel for p in processes if p.poll() is None]) and time.monotonic() < settle:
                multiprocessing.connection.wait(running, timeout=settle - time.monotonic())
            break
        multiprocessing.connection.wait(running, timeout=0.5)  # (until a rank ends)
    seconds = time.monotonic() - start
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
    if failure is None and any(p.returncode != 0 for p in processes):
        failure = "a rank failed"
    texts = [(records / f"rank_{rank}.log").read_text() for rank in range(world_size)]
    return LaunchOutcome([p.returncode for p in processes], texts, seconds, failure)


def launch(script: Path, world_size: int, spec: dict, workdir: Path, timeout: float = 300) -> list[dict]:
    """Run `script` on `world_size` ranks with `spec` (JSON) and return what each rank saved to `result_<rank>.pt`."""
    _run_or_raise(script, world_size, spec, workdir, timeout)
    return [torch.load(workdir / f"result_{rank}.pt") for rank in range(world_size)]


def launch_case(script: Path, world_size: int, spec: dict, workdir: Path, case: str, timeout: float = 300) -> list[dict]:
    """`launch` of one case of a job whose cases run one launch each in the job's `workdir` (a case may read what an
    earlier one wrote there: a checkpoint to resume). Its spec, its ranks' logs and what they saved are kept in
    `workdir / "launches" / case`."""
    records = workdir / "launches" / case
    results = [workdir / f"result_{rank}.pt" for rank in range(world_size)]
    for path in results:  # (an earlier case's, already kept)
        path.unlink(missing_ok=True)
    _run_or_raise(script, world_size, spec, workdir, timeout, records, f"case {case}: ")
    kept = [path.rename(records / path.name) for path in results]
    return [torch.load(path) for path in kept]


def _run_or_raise(script: Path, world_size: int, spec: dict, workdir: Path, timeout: float,
                  records: Optional[Path] = None, label: str = "") -> None:
    outcome = run_ranks(script, world_size, spec, workdir, timeout, records=records)
    if outcome.failure:
        tails = [f"--- rank {rank} (exit {code}) ---\n{text[-4000:]}"
                 for rank, (code, text) in enumerate(zip(outcome.returncodes, outcome.logs))]
        raise DistributedLaunchError(f"{label}{outcome.failure}\n" + "\n".join(tails))
