"""Ending a job promptly when one of its ranks dies.

When a rank is killed (out-of-memory killer, hardware fault, preemption of one node), the others block in their
next collective until the process-group timeout (30 minutes by default), or forever in a barrier of a teardown.
`RankWatchdog` runs a thread in every rank that increments a counter in the job's rendezvous store every few
seconds and watches everyone else's. A counter that stops moving for `timeout` seconds means its process is gone
(or frozen): the watchdog prints which rank, on which host and with which pid, and ends its own process with
`EXIT_PEER_LOST`. The thread needs no progress from the main thread, so a long step or a slow checkpoint write
is not mistaken for a death; torch releases the GIL inside collectives and kernels, so a waiting rank still
beats.

A rank that finishes normally marks itself finished first, so ranks leaving at slightly different times after
`fit` (or after a SIGTERM checkpoint) are not reported.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: "try again" for schedulers that requeue on it
_PREFIX = "lightning_ulysses/watchdog"


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

    def start(self) -> None:
        # A client connection of our own: the main thread's store calls (barriers, new groups) never wait on ours.
        self._store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=max(30.0, self.timeout)))
        info = {"host": socket.gethostname(), "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK")}
        self._store.set(self._key("info", self.rank), json.dumps(info))
        self._store.set(self._key("finished", self.rank), "0")
        self._thread = threading.Thread(target=self._run, name="lightning-ulysses-watchdog", daemon=True)
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

    def wait_for_lost_peer(self) -> None:
        """After a communication error in the main thread: give the watchdog time to name the rank that is gone
        (it then ends the process with that message). Returns if every rank is still beating after a full
        timeout, i.e. the error had another cause."""
        if self._thread is None:
            return
        log.error("lightning_ulysses: a collective failed; checking which rank is gone (up to %.0f s).", self.timeout)
        self._thread.join(timeout=self.timeout + 2 * self.interval)

    def _key(self, kind: str, rank: int) -> str:
        return f"{_PREFIX}/{kind}/{rank}"

    def _run(self) -> None:
        store = self._store
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        last_value = {rank: -1 for rank in others}
        last_change = {rank: time.monotonic() for rank in others}
        while not self._stop.wait(self.interval):
            try:
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

    def _finished(self, store, rank: int) -> bool:
        return store.add(self._key("finished", rank), 0) != 0  # set to "1" by `stop`

    def _describe(self, store, rank: int, silent_for: float) -> str:
        try:
            info = json.loads(store.get(self._key("info", rank)))
            where = f" (host {info['host']}, pid {info['pid']}, local rank {info['local_rank']})"
        except Exception:
            where = ""
        return f"rank {rank}{where} has sent no heartbeat for {silent_for:.0f} s: it died or is frozen"

    @property
    def _lost_key(self) -> str:
        return f"{_PREFIX}/lost"

    def _abort(self, reason: str, announce: bool = True) -> None:
        if self._stop.is_set():
            return
        try:
            # Tell everyone, so that ranks whose store connection dies with us (rank 0 hosts it) still name the
            # lost rank rather than us; the store host waits until the others had a chance to read it.
            if announce and self._store is not None:
                self._store.set(self._lost_key, reason)
            if self.rank == 0:
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
        # The main thread may be blocked inside a collective that will never return: only _exit ends it.
        os._exit(EXIT_PEER_LOST)


_PEER_FAILURE_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "nccl", "gloo")


def is_peer_failure(exception: BaseException) -> bool:
    """Whether an exception looks like a collective that failed because another rank went away."""
    if isinstance(exception, dist.DistError):
        return True
    return isinstance(exception, RuntimeError) and any(m in str(exception).lower() for m in _PEER_FAILURE_MARKERS)
