"""A rank killed mid-step or mid-save: every other rank exits promptly, non-zero, naming it; no partial
checkpoint ever loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ulysses import checkpoint as checkpoints
from lightning_ulysses.faults import EXIT_PEER_LOST
from tests.distributed.harness import run_ranks

WORKER = Path(__file__).parent / "workers" / "faults.py"
HEARTBEAT_TIMEOUT = 10
BOUND = 120  # seconds from launch (start-up included) until every process is gone


def killed_run(tmp_path, world_size, **spec):
    outcome = run_ranks(WORKER, world_size, dict(spec, heartbeat_timeout=HEARTBEAT_TIMEOUT), tmp_path,
                        timeout=BOUND + 60, stop_on_first_failure=False)
    assert outcome.failure != "timeout" and outcome.seconds < BOUND, outcome.logs
    victim = spec["victim"]
    assert outcome.returncodes[victim] == -9
    for rank, (code, log) in enumerate(zip(outcome.returncodes, outcome.logs)):
        if rank != victim:
            assert code == EXIT_PEER_LOST, log[-3000:]
            assert f"lightning_ulysses: rank {victim} (host" in log, log[-3000:]
    return outcome


def test_a_rank_killed_mid_step_ends_every_rank_naming_it(tmp_path):
    # Rank 2 dies before step 3's collectives: its SP partner fails in the all-to-all, the other DP group in the
    # gradient reduce-scatter, and all of them report rank 2 rather than gloo's "connection closed by peer".
    outcome = killed_run(tmp_path, 4, kill="step", victim=2, at=3, sp=2)
    # The start-up preflight report is logged once per node, by its local rank 0.
    assert "lightning_ulysses preflight (node 0):" in outcome.logs[0]
    assert all("lightning_ulysses preflight" not in log for log in outcome.logs[1:])


def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint(tmp_path):
    killed_run(tmp_path, 2, kill="save", victim=1, at=3, sp=2)
    last = tmp_path / "checkpoints" / "last.ckpt"
    # The third save (after step 3) never committed: `last.ckpt` is still the one of step 2, complete...
    assert checkpoints.resolve_checkpoint(last) == last
    assert checkpoints.read_manifest(last).epoch_samples_consumed == 2  # 2 steps × batch 1 × DP 1
    # ...and the half-written save is refused with a message naming the good one.
    with pytest.raises(checkpoints.IncompleteCheckpointError, match="load last.ckpt"):
        checkpoints.resolve_checkpoint(checkpoints.staging_path(last))


def test_rank_0_leaving_first_at_the_end_of_a_job_is_not_a_failure(tmp_path):
    # Rank 0 hosts the rendezvous store; here it finishes and exits while rank 1 still lingers after training. The
    # watchdog of rank 1 loses the store but must wait for its own rank to finish rather than report a death.
    linger = HEARTBEAT_TIMEOUT / 2
    outcome = run_ranks(WORKER, 2, {"kill": "none", "victim": 1, "linger": linger, "sp": 2, "steps": 2,
                                    "heartbeat_timeout": HEARTBEAT_TIMEOUT}, tmp_path, timeout=BOUND)
    assert outcome.returncodes == [0, 0], outcome.logs[1][-3000:]
