"""A rank killed mid-step or mid-save: every other rank exits promptly, non-zero, naming it; no partial
checkpoint ever loads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lightning_ulysses.integration.checkpoint import protocol
from lightning_ulysses.integration.faults import EXIT_PEER_LOST
from tests.distributed.harness import run_ranks

WORKER = Path(__file__).parent / "workers" / "faults.py"
HEARTBEAT_TIMEOUT = 10
BOUND = 120  # seconds from launch (start-up included) until every process is gone


def _killed_launch(workdir: Path, world_size: int, **spec):
    return run_ranks(WORKER, world_size, dict(spec, heartbeat_timeout=HEARTBEAT_TIMEOUT), workdir,
                     timeout=BOUND + 60, stop_on_first_failure=False)


def check_killed_run(outcome, victim: int) -> None:
    assert outcome.failure != "timeout" and outcome.seconds < BOUND, outcome.logs
    assert outcome.returncodes[victim] == -9
    for rank, (code, log) in enumerate(zip(outcome.returncodes, outcome.logs)):
        if rank != victim:
            assert code == EXIT_PEER_LOST, log[-3000:]
            assert f"lightning_ulysses: rank {victim} (host" in log, log[-3000:]


# The launches that wait on the heartbeat's clock (a death is noticed HEARTBEAT_TIMEOUT after it; a rank lingers),
# (world size, spec) each. Mid-step: rank 2 dies before step 3's collectives: its SP partner fails in the all-to-all,
# the other DP group in the gradient reduce-scatter, and all of them report rank 2 rather than gloo's "connection
# closed by peer". Mid-save: rank 1 dies in the third save. Rank 0 leaving first: rank 0 hosts the rendezvous store;
# here it finishes and exits while rank 1 still lingers after training. The watchdog of rank 1 loses the store but
# must wait for its own rank to finish rather than report a death.
CLOCKED = {
    "killed_mid_step": (4, {"kill": "step", "victim": 2, "at": 3, "sp": 2}),
    "killed_mid_save": (2, {"kill": "save", "victim": 1, "at": 3, "sp": 2}),
    "rank_0_leaves_first": (2, {"kill": "none", "victim": 1, "linger": HEARTBEAT_TIMEOUT / 2, "sp": 2, "steps": 2}),
}


@pytest.fixture(scope="module")
def clocked_runs(tmp_path_factory):
    """The three launches at once (each its own job, rendezvous and port): most of their time is spent waiting on
    the heartbeat's clock, which side by side they wait out together. {name: (outcome, workdir)}"""
    with ThreadPoolExecutor(len(CLOCKED)) as pool:
        runs = {}
        for name, (world_size, spec) in CLOCKED.items():
            workdir = tmp_path_factory.mktemp(name)
            runs[name] = (pool.submit(_killed_launch, workdir, world_size, **spec), workdir)
        return {name: (run.result(), workdir) for name, (run, workdir) in runs.items()}


def test_a_rank_killed_mid_step_ends_every_rank_naming_it(clocked_runs):
    outcome, _ = clocked_runs["killed_mid_step"]
    check_killed_run(outcome, victim=2)
    # The start-up preflight report is logged once per node, by its local rank 0.
    assert "lightning_ulysses preflight (node 0):" in outcome.logs[0]
    assert all("lightning_ulysses preflight" not in log for log in outcome.logs[1:])


def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint(clocked_runs):
    outcome, workdir = clocked_runs["killed_mid_save"]
    check_killed_run(outcome, victim=1)
    last = workdir / "checkpoints" / "last.ckpt"
    # The third save (after step 3) never committed: `last.ckpt` is still the one of step 2, complete...
    assert protocol.resolve_checkpoint(last) == last
    assert protocol.read_manifest(last).epoch_samples_consumed == 2  # 2 steps × batch 1 × DP 1
    # ...and the half-written save is refused with a message naming the good one.
    with pytest.raises(protocol.IncompleteCheckpointError, match="load last.ckpt"):
        protocol.resolve_checkpoint(protocol.staging_path(last))


def test_rank_0_leaving_first_at_the_end_of_a_job_is_not_a_failure(clocked_runs):
    outcome, _ = clocked_runs["rank_0_leaves_first"]
    assert outcome.failure != "timeout" and outcome.seconds < BOUND, outcome.logs
    assert outcome.returncodes == [0, 0], outcome.logs[1][-3000:]


def lightning_launcher_variables(rank: int, world_size: int) -> dict[str, str]:
    """None: the user starts one process and Lightning's own launcher starts the other ranks."""
    return {}


def srun_variables(rank: int, world_size: int) -> dict[str, str]:
    """What `srun --ntasks 2` on one node gives each task."""
    return dict(SLURM_NTASKS=str(world_size), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                SLURM_NNODES="1", SLURM_NTASKS_PER_NODE=str(world_size), SLURM_JOB_ID="4243",
                SLURM_JOB_NAME="ulysses-test", SLURM_NODELIST="127.0.0.1")


# (launcher, processes started, ranks, spec, what the others must print).
RAISED = {
    # Rank 2 raises in training_step; its SP partner waits in an all-to-all, the other DP group in the reduction.
    "torchrun": (None, 4, 4, {"victim": 2, "at": 2}, "rank 2 (host {host}, pid {pid}, local rank 2) raised"
                 " RuntimeError: simulated out of memory on rank 2 at step 2"),
    # Rank 0, which hosts the rendezvous store, fails to commit a checkpoint while the others wait in a barrier.
    "srun": (srun_variables, 2, 2, {"victim": 0, "at": 2, "raise_in": "commit", "devices": 2},
             "rank 0 (host {host}, pid {pid}, local rank 0) raised OSError: [Errno 28] simulated: no space left"),
    "lightning": (lightning_launcher_variables, 1, 2, {"victim": 1, "at": 2, "devices": 2},
                  "rank 1 (host {host}, pid {pid}, local rank 1) raised RuntimeError: simulated out of memory"),
}


def _raising_run(workdir: Path, launcher: str):
    variables, processes, _, spec, _ = RAISED[launcher]
    # Found only by its silence, the victim would keep the others waiting for 600 s: the launch would time out.
    return run_ranks(WORKER, processes, dict(spec, kill="raise", sp=2, heartbeat_timeout=600), workdir,
                     timeout=300, stop_on_first_failure=False,
                     **({"launcher_variables": variables} if variables else {}))


@pytest.fixture(scope="module")
def raising_runs(tmp_path_factory):
    """The three launches at once (each its own job, rendezvous and port): none of them waits on a clock, and
    side by side they keep both cores busy through each other's start-up and teardown."""
    with ThreadPoolExecutor(len(RAISED)) as pool:
        runs = {launcher: pool.submit(_raising_run, tmp_path_factory.mktemp(f"raise_{launcher}"), launcher)
                for launcher in RAISED}
        return {launcher: run.result() for launcher, run in runs.items()}


@pytest.mark.parametrize("launcher", list(RAISED))
def test_a_rank_that_raises_ends_every_other_rank_naming_it(raising_runs, launcher):
    _, processes, ranks, spec, expected = RAISED[launcher]
    outcome = raising_runs[launcher]
    assert outcome.failure != "timeout", outcome.logs
    log = "\n".join(outcome.logs)
    host, pid = next(line.split()[1:] for line in log.splitlines() if line.startswith("victim "))
    message = f"lightning_ulysses: {expected.format(host=host, pid=pid)}"
    victim = spec["victim"]
    # Every rank but the victim ends with the watchdog's status and names the victim, its error and where it ran.
    assert message in log, log[-6000:]
    for rank in range(ranks):
        assert (f"Ending rank {rank} with exit status {EXIT_PEER_LOST}" in log) == (rank != victim), log[-6000:]
    if processes > 1:
        assert all(message in text for rank, text in enumerate(outcome.logs) if rank != victim), log[-6000:]
    for rank, code in enumerate(outcome.returncodes):
        # The victim leaves with its own traceback (status 1); Lightning's launcher shows only its process, rank 0.
        assert code == (1 if rank == victim else EXIT_PEER_LOST), (rank, log[-6000:])
