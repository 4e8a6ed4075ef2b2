"""Ending a job promptly when one of its ranks dies.

When a rank is killed (out-of-memory killer, hardware fault, preemption of one node), the others block in their
next collective until the process-group timeout (30 minutes by default), or forever in a barrier of a teardown.
`RankWatchdog` runs a thread in every rank that increments a counter in the job's rendezvous store every few
seconds and watches everyone else's. A counter that stops moving for `timeout` seconds means its process is gone
(or frozen): the watchdog prints which rank, on which host and with which pid, and ends its own process with
`EXIT_PEER_LOST`. The thread needs no progress from the main thread, so a long step or a slow checkpoint write
is not mistaken for a death; torch releases the GIL inside collectives and kernels, so a waiting rank still
beats.

A rank that *raises* (an out-of-memory error on one DP group, a save that fails on rank 0 only) is still alive
and beating while the others wait for it in a collective. It records its failure in the store
(`report_failure`, called from the strategy's `on_exception`): rank, host, pid, exception type and message. Every
other rank's watchdog sees it within `_POLL` seconds and ends its process with the same status and a message
naming it; the reporting rank stays until they have (a few seconds at most). Refusals that every rank raises
alike (a bad configuration) are not mistaken for one rank's failure: a rank whose own main thread reports a
failure within `_GRACE` seconds of seeing another's leaves by its own error.

A rank that finishes normally marks itself finished first, so ranks leaving at slightly different times after
`fit` (or after a SIGTERM checkpoint) are not reported.

A scheduler's SIGTERM (and SLURM's requeue signal) is the orderly kind of ending: `SchedulerSignals` makes every
rank save one checkpoint together at an optimizer-step boundary, requeue the job under SLURM and exit.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_ulysses.fences import _lightning_private as lightning_private

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: "try again" for schedulers that requeue on it
# What a job exits with after a scheduler's signal made every rank save (`SchedulerSignals`), a plain script's `fit`
# as `recipes/train.py`: the run is not finished, and its newest checkpoint is at the step it stopped. Not 0 (a
# scheduler or script would take the job for done), not 75 (a lost rank: work since the last checkpoint is gone),
# outside sysexits' 64-78 and the shells' 128+signal range (143 would say the signal killed it, saving nothing).
EXIT_PREEMPTED = 79
# Set by a process before Lightning's script launcher starts the other ranks of its node from it (they inherit it):
# its pid. A rank whose parent it names exits 0 after a preemption (see `RunFaults.on_exception`).
_LAUNCHING_PROCESS = "LIGHTNING_ULYSSES_LAUNCHING_PID"
_PREFIX = "lightning_ulysses/watchdog"
_POLL = 0.5  # seconds between two looks for a failure another rank reported (a single cheap store call)
_GRACE = 2.0  # seconds a rank gives its own main thread to raise the same error before blaming another rank
_MESSAGE_LIMIT = 500  # characters of an exception message carried to the other ranks


class RankWatchdog:
    """Args:
        host, port: the rendezvous store every rank already reaches (MASTER_ADDR / MASTER_PORT).
        rank, world_size: this process's global rank and the number of ranks.
        timeout: seconds without a heartbeat after which a rank counts as dead.
        interval: seconds between heartbeats (default: a tenth of the timeout, at most 5 s).
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float,
                 interval: Optional[float] = None) -> None:
        if timeout <= 0:
            raise ValueError(f"The rank heartbeat timeout must be positive (seconds), got {timeout}.")
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.timeout = timeout
        self.interval = interval if interval is not None else min(5.0, timeout / 10)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[dist.Store] = None
        self._generation = 0

    # Watchdogs started so far in this process. Every rank starts one per fit/validate/test/predict, in the same
    # order, so the count names the same run on every rank: keys of an earlier Trainer in the same process (a
    # failure it reported, say) never reach a later one.
    _starts = 0

    def start(self) -> None:
        RankWatchdog._starts += 1
        self._generation = RankWatchdog._starts
        # A client connection of our own: the main thread's store calls (barriers, new groups) never wait on ours.
        self._store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=max(30.0, self.timeout)))
        info = {"host": socket.gethostname(), "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK")}
        self._store.set(self._key("info", self.rank), json.dumps(info))
        self._store.set(self._key("finished", self.rank), "0")
        self._thread = threading.Thread(target=self._watch, name="lightning-ulysses-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Mark this rank finished (not dead) and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
            self._thread = None
        if self._store is not None:
            try:
                self._store.set(self._key("finished", self.rank), "1")
            except Exception:  # the store's host may already be gone at the very end of a job
                pass
            self._store = None

    def report_failure(self, exception: BaseException) -> None:
        """Tell every other rank that this one raised `exception` and is leaving the job, so that they exit at
        once (naming it) instead of waiting in a collective for it. Stops this rank's own watchdog first."""
        store = self._store
        if store is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
            self._thread = None
        message = str(exception).strip().replace("\n", " ")
        if len(message) > _MESSAGE_LIMIT:
            message = message[:_MESSAGE_LIMIT] + " [...]"
        reason = f"{self._where(store, self.rank)} raised {type(exception).__name__}: {message}"
        try:
            store.set(self._key("failed", self.rank), "1")
            store.compare_set(self._failure_key, "", reason)  # the first failure is the one everybody names
            self._stay_until_named(store)
        except Exception:  # the store's host may be gone already; this rank raises its own error anyway
            pass

    def _stay_until_named(self, store) -> None:
        """Wait (a few seconds at most) until every other rank has named this failure, reported one of its own or
        finished. The store usually lives in rank 0; and a launcher that ends the job when one of its processes exits
        (Lightning's script launcher kills every rank 0-5 s after a child's non-zero exit) would otherwise end the
        others before they say which rank failed."""
        deadline = time.monotonic() + 4 * _POLL + 2 * _GRACE
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        while time.monotonic() < deadline and not all(
                store.check([self._key("named", rank)]) or store.check([self._key("failed", rank)])
                or self._finished(store, rank) for rank in others):
            time.sleep(_POLL / 5)

    def _keep_store_until_read(self, store) -> None:
        """On rank 0, where the store usually lives: wait (a few seconds at most) until every other rank has read
        the failure report, reported a failure of its own or finished, so that none loses the store unread."""
        if self.rank != 0:
            return
        deadline = time.monotonic() + 4 * _POLL + _GRACE
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        while time.monotonic() < deadline and not all(
                store.check([self._key("seen", rank)]) or store.check([self._key("failed", rank)])
                or self._finished(store, rank) for rank in others):
            time.sleep(_POLL / 5)

    def wait_for_lost_peer(self) -> None:
        """After a communication error in the main thread: give the watchdog time to name the rank that is gone
        (it then ends the process with that message). Returns if every rank is still beating after a full
        timeout, i.e. the error had another cause."""
        if self._thread is None:
            return
        log.error("lightning_ulysses: a collective failed; checking which rank is gone (up to %.0f s).", self.timeout)
        self._thread.join(timeout=self.timeout + 2 * self.interval)

    def _key(self, kind: str, rank: int) -> str:
        return f"{_PREFIX}/{self._generation}/{kind}/{rank}"

    def _watch(self) -> None:
        store = self._store
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        last_value = {rank: -1 for rank in others}
        last_change = {rank: time.monotonic() for rank in others}
        next_beat = time.monotonic()
        while not self._stop.wait(min(_POLL, self.interval)):
            try:
                if store.check([self._failure_key]):
                    self._blame_reported_failure(store)
                if time.monotonic() < next_beat:
                    continue
                next_beat = time.monotonic() + self.interval
                store.add(self._key("beat", self.rank), 1)
                if store.check([self._lost_key]):  # another rank already found the lost one: say the same
                    self._abort(store.get(self._lost_key).decode(), announce=False)
                now = time.monotonic()
                for rank in others:
                    value = store.add(self._key("beat", rank), 0)  # reads, creating the key at 0 if missing
                    if value != last_value[rank]:
                        last_value[rank], last_change[rank] = value, now
                    elif now - last_change[rank] > self.timeout and not self._finished(store, rank):
                        self._abort(self._describe(store, rank, now - last_change[rank]))
            except Exception as error:  # the store lives in rank 0 or the launcher: it is gone with them
                # At the normal end of a job the store's host (rank 0) may leave its script while this rank is
                # still finishing: wait one timeout for this rank to finish too before calling it a failure.
                if self._stop.wait(self.timeout):
                    return
                self._abort(
                    f"the rendezvous store at {self.host}:{self.port} stopped answering ({type(error).__name__}:"
                    f" {error}) and this rank did not finish within {self.timeout:.0f} s; the store lives in global"
                    " rank 0 (or in torchrun's agent), which has most likely died"
                )

    def _blame_reported_failure(self, store) -> None:
        """Another rank reported that it raised: leave naming it, unless this rank's own main thread reports an
        error within the grace period (every rank refusing the same configuration reaches here too)."""
        reason = store.get(self._failure_key).decode()
        store.set(self._key("seen", self.rank), "1")  # lets the store's host (rank 0) leave
        if self._stop.wait(_GRACE):
            return
        self._keep_store_until_read(store)
        self._abort(reason, announce=False, linger=False)

    def _finished(self, store, rank: int) -> bool:
        return store.add(self._key("finished", rank), 0) != 0  # set to "1" by `stop`

    def _where(self, store, rank: int) -> str:
        try:
            info = json.loads(store.get(self._key("info", rank)))
            return f"rank {rank} (host {info['host']}, pid {info['pid']}, local rank {info['local_rank']})"
        except Exception:
            return f"rank {rank}"

    def _describe(self, store, rank: int, silent_for: float) -> str:
        return f"{self._where(store, rank)} has sent no heartbeat for {silent_for:.0f} s: it died or is frozen"

    @property
    def _lost_key(self) -> str:
        return f"{_PREFIX}/{self._generation}/lost"

    @property
    def _failure_key(self) -> str:
        return f"{_PREFIX}/{self._generation}/failure"

    def _abort(self, reason: str, announce: bool = True, linger: bool = True) -> None:
        if self._stop.is_set():
            return
        try:
            # Tell everyone, so that ranks whose store connection dies with us (rank 0 hosts it) still name the
            # lost rank rather than us; the store host waits until the others had a chance to read it.
            if announce and self._store is not None:
                self._store.set(self._lost_key, reason)
            if self.rank == 0 and linger:
                time.sleep(3 * self.interval)
        except Exception:
            pass
        message = (
            f"lightning_ulysses: {reason}. Ending rank {self.rank} with exit status {EXIT_PEER_LOST} instead of"
            " waiting for the collective timeout. Restart the job from its last checkpoint."
        )
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        try:  # said: a rank that reported a failure may leave now (`_stay_until_named`)
            if self._store is not None:
                self._store.set(self._key("named", self.rank), "1")
        except Exception:
            pass
        # The main thread may be blocked inside a collective that will never return: only _exit ends it.
        os._exit(EXIT_PEER_LOST)


_PEER_FAILURE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "nccl", "gloo")


def is_peer_failure(exception: BaseException) -> bool:
    """Whether an exception looks like a collective that failed because another rank went away."""
    if isinstance(exception, dist.DistError):
        return True
    return isinstance(exception, RuntimeError) and any(m in str(exception).lower() for m in _PEER_FAILURE_MARKERS)


def check_heartbeat_timeout(timeout: Optional[float]) -> Optional[float]:
    if timeout is not None and timeout <= 0:
        raise ValueError(f"heartbeat_timeout must be a positive number of seconds or None, got {timeout}.")
    return timeout


def start_watchdog(environment: Any, rank: int, world_size: int, timeout: Optional[float]) -> Optional[RankWatchdog]:
    """A started `RankWatchdog` on the job's rendezvous store, or None (turned off, one rank, store unreachable)."""
    if timeout is None or world_size == 1:
        return None
    watchdog = RankWatchdog(environment.main_address, environment.main_port, rank, world_size, timeout)
    try:
        watchdog.start()
    except Exception as error:  # a launcher whose store we cannot reach: train anyway, without the watchdog
        rank_zero_warn(f"lightning_ulysses: the rank watchdog could not reach the rendezvous store at"
                       f" {environment.main_address}:{environment.main_port} ({error}); a killed rank will"
                       " leave the others waiting for the collective timeout.")
        return None
    return watchdog


def on_rank_exception(watchdog: Optional[RankWatchdog], exception: BaseException) -> None:
    """What a rank that is leaving by `exception` tells the others (the strategy's `on_exception`)."""
    if watchdog is None:
        return
    if is_peer_failure(exception):
        # gloo/NCCL only say "connection closed by peer": let the watchdog name the rank (it exits if it can).
        watchdog.wait_for_lost_peer()
    elif isinstance(exception, Exception):
        # This rank leaves while the others may wait for it inside a collective (an OOM on one DP group, a
        # save failing on rank 0 only): tell them, so they exit at once naming it.
        watchdog.report_failure(exception)


def mark_launching_process(strategy: Any) -> None:
    """Before Lightning's script launcher starts this node's other ranks from this process (a plain `python
    script.py` with `devices=N`): they inherit the mark, and know that their exit status is read by it."""
    if strategy.launcher is not None and not strategy.cluster_environment.creates_processes_externally:
        os.environ[_LAUNCHING_PROCESS] = str(os.getpid())


def started_by_launching_process() -> bool:
    """Whether Lightning's script launcher in this process's parent started it (see `mark_launching_process`)."""
    return os.environ.get(_LAUNCHING_PROCESS) == str(os.getppid())


def is_launching_process() -> bool:
    """Whether this process was started as a script by hand (or by a scheduler's job script), not as a rank by a
    launcher: the one whose command runs the job again (see `mark_launching_process`; also a later Trainer's)."""
    return os.environ.get(_LAUNCHING_PROCESS) == str(os.getpid())


def relaunch_command() -> str:
    """The command line this process runs, as a shell takes it (`-m` for a module), for the launching process of
    a script launch; how to start ranks that something else started (torchrun, srun) is that launcher's."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return shlex.join([sys.executable, *program, *sys.argv[1:]])


# A path component a script names anew at every launch: a date (2026-12-04, 20261204), a time (13-27-54), a logger's
# version folder. A requeued job's script computes another; the hpc_ckpt_<n>.ckpt saved in this one is not found.
_LAUNCH_STAMPS = re.compile(r"(?<!\d)(20\d\d[-_]?(0[1-9]|1[0-2])[-_]?(0[1-9]|[12]\d|3[01])"
                            r"|([01]\d|2[0-3])[-_:][0-5]\d[-_:][0-5]\d)(?!\d)|^version_\d+$")


def launch_stamped_component(folder: Path, job_id: Optional[str]) -> Optional[str]:
    """The first component of `folder` named for this launch (`_LAUNCH_STAMPS`), unless the folder is keyed by the
    SLURM job (`job_id` in its path: a requeued job keeps its id); None if there is none."""
    if job_id and job_id in str(folder):
        return None
    return next((part for part in folder.parts if _LAUNCH_STAMPS.search(part)), None)


@dataclass(frozen=True)
class Preemption:
    """A checkpoint every rank saved together on a scheduler's signal."""

    path: str
    global_step: int

    def note(self, command: Optional[str]) -> str:
        """The one line that tells a plain script's user how to continue (`command`: the command to run again; None:
        relaunch the job as it was launched)."""
        how = f"run `{command}` again" if command is not None else "relaunch the job as it was launched"
        return (f"lightning_ulysses: preempted at step {self.global_step}, exit status {EXIT_PREEMPTED} (not finished);"
                f" every rank saved {self.path}. To continue, {how} with trainer.fit(..., ckpt_path=\"{self.path}\")"
                " (or ckpt_path=\"hpc\": the newest hpc_ckpt_<n>.ckpt of default_root_dir; under SLURM ckpt_path=None"
                " finds it too).")


class RunFaults:
    """What the strategy does about faults over its runs: the rank watchdog (started at the first distributed set-up,
    stopped at every teardown), a scheduler's signals (`SchedulerSignals`: installed when training starts, agreed at
    every batch, saved and turned into the job's exit status) and, when a rank leaves by an exception, what it tells
    the others."""

    def __init__(self, heartbeat_timeout: Optional[float]) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.watchdog: Optional[RankWatchdog] = None
        self.signals = SchedulerSignals()
        # The one-line note after a preemption (`Preemption.note`); the recipes print their own continue command.
        self.preemption_note = True
        self.preemption: Optional[Preemption] = None  # saved in this run, until its teardown has said so

    def start_watchdog(self, environment: Any, rank: int, world_size: int) -> None:
        if self.watchdog is None:
            self.watchdog = start_watchdog(environment, rank, world_size, self.heartbeat_timeout)

    def stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def on_exception(self, exception: BaseException, trainer: Callable[[], "pl.Trainer"], environment: Any,
                     is_global_zero: bool, groups_built: bool) -> None:
        """A scheduler's signal, raised on every rank at the same step boundary (`SchedulerSignals.agree`): all ranks
        save together, and the exception, a `SystemExit` without status that a plain script lets through (exit 0: a
        finished job to its scheduler, never requeued or resumed), gets `EXIT_PREEMPTED`; except on the ranks
        Lightning's script launcher started, which exit 0 because the launcher kills every process when one exits
        otherwise: the launching process exits 79 once they have ended (`after_teardown`). Anything else: the other
        ranks leave at once, naming this one (`on_rank_exception`)."""
        if isinstance(exception, SIGTERMException) and groups_built:
            self.preemption = self.signals.save_and_requeue(trainer(), environment, is_global_zero)
            exception.code = 0 if started_by_launching_process() else EXIT_PREEMPTED
        else:
            on_rank_exception(self.watchdog, exception)

    def after_teardown(self, launcher: Any, is_global_zero: bool, wait_for_ranks: float = 120.0) -> None:
        """After a preemption's save, at the end of the strategy's teardown: the launching process of a script launch
        waits (up to `wait_for_ranks` seconds) for the ranks it started, so that its exit status (79) is the whole
        job's; then global rank 0 says how to continue, in one line (unless `preemption_note` is off)."""
        preemption, self.preemption = self.preemption, None
        if preemption is None:
            return
        # Lightning's script launcher's ranks, where this run's launcher started them (a later Trainer in the same
        # process finds them started: they end on their own, after the save every rank has completed)
        for process in getattr(launcher, "procs", None) or []:
            try:
                process.wait(timeout=wait_for_ranks)
            except subprocess.TimeoutExpired:
                pass  # its save is complete (collective): leaving it to end on its own loses nothing
        if is_global_zero and self.preemption_note:
            print(preemption.note(relaunch_command() if is_launching_process() else None), flush=True)


# -- a scheduler's signals ------------------------------------------------------------------------------------------
class SchedulerSignals:
    """SIGTERM (and SLURM's requeue signal) turned into one checkpoint that every rank saves together.

    Lightning's SIGTERM handler broadcasts from rank 0 *inside the signal handler*, i.e. wherever the main thread
    happens to be: with a scheduler's signal arriving mid-step, that broadcast pairs with another rank's
    all-to-all or reduce-scatter (a hang, or silently wrong data). `install` replaces it by one that only records
    the signal privately; `agree` turns it into Lightning's flag on every rank at once. (Lightning's end-of-batch
    check reads each rank's own flag, so a flag set directly in the handler would stop only the ranks the signal
    reached.)

    SLURM's auto-requeue signal (SIGUSR1 unless `SLURMEnvironment(requeue_signal=...)` says otherwise) is worse:
    Lightning's handler saves a whole checkpoint inside the handler, its collectives paired with whatever the
    other ranks are doing. It takes the same route: recorded, agreed, then saved by every rank at the same
    optimizer-step boundary, the job requeued and every rank exits (`save_and_requeue`); the requeued job resumes
    with `ckpt_path="hpc"`.
    """

    def __init__(self) -> None:
        self.pending = False  # a signal this rank received, not yet agreed on (see `agree`)

    def install(self, trainer: "pl.Trainer", environment: Any) -> None:
        """Once Lightning has registered its handlers (they exist from `on_train_start` on)."""
        self.pending = False
        if threading.current_thread() is not threading.main_thread():
            return
        # Lightning's handlers that collect (broadcast, save) inside the handler; the others keep running.
        replaced = lightning_private.collective_signal_handlers(trainer)
        signals = [signal.SIGTERM]
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            signals.append(environment.requeue_signal)
        for signum in signals:
            handlers = lightning_private.composed_signal_handlers(signum)
            if signum != signal.SIGTERM and not any(getattr(h, "__func__", None) in replaced for h in handlers or []):
                continue  # the user's own requeue handler, which Lightning left in place: not ours to change
            signal.signal(signum, functools.partial(self._record, handlers or [], replaced))

    def _record(self, handlers: list, replaced: tuple, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        rank_zero_info(f"lightning_ulysses: {name} received; saving at the next optimizer-step boundary.")
        self.pending = True
        # Lightning's own non-collective handlers (SLURM's SIGTERM "bypass") and the user's handlers keep running.
        for handler in handlers:
            if getattr(handler, "__func__", None) not in replaced and callable(handler):
                handler(signum, frame)

    def agree(self, trainer: "pl.Trainer", world_size: int, device: torch.device) -> None:
        """Whether any rank got a signal, agreed by all ranks at the same batch (one all-reduce; call it at every
        training batch start), and handed to Lightning's end-of-batch check on every rank together only at an
        optimizer-step boundary: a checkpoint holds no gradients accumulated inside a window, so saving there
        would lose them on resume."""
        pending = self.pending
        if world_size > 1:
            flag = torch.tensor([int(pending)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            pending = bool(flag.item())
        self.pending = pending
        if pending and not lightning_private.should_accumulate(trainer):
            lightning_private.flag_sigterm(trainer)

    @staticmethod
    def save_and_requeue(trainer: "pl.Trainer", environment: Any, is_global_zero: bool) -> Preemption:
        """On every rank together (Lightning raises `SIGTERMException` at the same step boundary everywhere, since
        `agree` set every rank's flag in the same batch): save `hpc_ckpt_<n>.ckpt` and, under SLURM with
        auto-requeue, requeue the job. Under SLURM, a save into a folder named for this launch (a date, a time) is
        one the requeued job does not look in: said once, by global rank 0."""
        path = os.path.abspath(lightning_private.hpc_save_path(trainer))
        trainer.save_checkpoint(path)
        # How to continue depends on how the run was started (`fit(ckpt_path="hpc")`, the recipe's command with
        # `resume=auto`): said at the end of the teardown (`RunFaults.after_teardown`) or by the recipe.
        rank_zero_info(f"lightning_ulysses: every rank saved {path} at step {trainer.global_step} on a scheduler's"
                       " signal.")
        if isinstance(environment, SLURMEnvironment):
            _warn_unfound_by_requeue(Path(path))
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and is_global_zero:
            job_id = slurm_job_id()
            try:
                subprocess.call(["scontrol", "requeue", job_id])
            except FileNotFoundError:  # saved anyway; the job just is not requeued
                rank_zero_warn(f"lightning_ulysses: `scontrol` not found; SLURM job {job_id} was not requeued.")
        return Preemption(path, trainer.global_step)


def slurm_job_id() -> Optional[str]:
    """This SLURM job's id as `scontrol requeue` names it (an array task: `<array job>_<task>`), which a requeued job
    keeps; None outside SLURM."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job:
        return f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    return os.environ.get("SLURM_JOB_ID")


def _warn_unfound_by_requeue(path: Path) -> None:
    """A requeued SLURM job runs the job script again and resumes (`fit(ckpt_path=None)`) from the newest
    hpc_ckpt_<n>.ckpt in *its* `default_root_dir`: one named for the launch is a new, empty folder then."""
    job_id = slurm_job_id()
    stamp = launch_stamped_component(path.parent, job_id)
    if stamp is None:
        return
    keyed = "os.environ['SLURM_JOB_ID']" if not os.environ.get("SLURM_ARRAY_JOB_ID") else \
        "os.environ['SLURM_ARRAY_JOB_ID'] + '_' + os.environ['SLURM_ARRAY_TASK_ID']"
    rank_zero_warn(
        f"lightning_ulysses: the preemption checkpoint {path} is in a folder named for this launch ({stamp!r}): when"
        f" SLURM requeues job {job_id}, the job script runs again and Lightning resumes only from the hpc_ckpt_<n>.ckpt"
        " of the new launch's default_root_dir, a new folder, so it starts afresh. Name the folder by the job instead"
        f" (Trainer(default_root_dir=f\"runs/{{{keyed}}}\")), or continue this run with"
        f" trainer.fit(..., ckpt_path=\"{path}\").")
