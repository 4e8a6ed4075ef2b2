"""Worker: one rank is SIGKILLed mid-step or mid-save; what do the others do?

`spec["kill"]`: "step" kills `victim` at the start of training step `at` (before its collectives); "save" kills it
inside the `at`-th checkpoint save, after DeepSpeed wrote its shards and before the save was committed; "none"
kills nobody, and `victim` lingers `linger` seconds after training before the strategy tears down, so that rank 0
(which hosts the rendezvous store) leaves first, as it may at the end of any job. "raise" keeps every process
alive but makes `victim` raise: in `training_step` at step `at` (an out-of-memory error on one rank), or with
`raise_in: "commit"` in the `at`-th save's commit, which only global rank 0 runs (a full disk on rank 0).
`spec["devices"]`: the number of ranks, where WORLD_SIZE is not set (srun; Lightning launching the other ranks).
"""

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_ulysses
from lightning_ulysses.integration.checkpoint import resume
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate


def die() -> None:
    print(f"rank {os.environ['RANK']}: killing myself (pid {os.getpid()})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class LingerAfterTraining(L.Callback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_end(self, trainer, pl_module):
        time.sleep(self.seconds)


class KillAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            die()


class RaiseAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated out of memory on rank {trainer.global_rank} at step {self.step}")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    # RANK is unset in the process the user started under Lightning's own launcher (it is global rank 0).
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or os.environ.get("LOCAL_RANK") or 0
    is_victim = int(rank) == spec["victim"]
    if is_victim:
        print(f"victim {socket.gethostname()} {os.getpid()}", flush=True)
    callbacks = [ModelCheckpoint(dirpath=workdir / "checkpoints", save_last=True, every_n_train_steps=1, save_top_k=0)]
    if spec["kill"] == "step" and is_victim:
        callbacks.append(KillAtStep(spec["at"]))
    if spec["kill"] == "none" and is_victim:
        callbacks.append(LingerAfterTraining(spec["linger"]))
    if spec["kill"] == "save" and is_victim:
        save_rng_state, calls = resume.save_rng_state, []

        def save_then_die(directory, rank, *rest):
            calls.append(directory)
            if len(calls) == spec["at"]:
                die()
            save_rng_state(directory, rank, *rest)

        resume.save_rng_state = save_then_die  # where StrategyCheckpoints.save looks it up
    if spec["kill"] == "raise" and is_victim and spec.get("raise_in") == "commit":
        commit, commits = resume.commit, []

        def commit_or_fail(*args, **kwargs):
            commits.append(args)
            if len(commits) == spec["at"]:
                raise OSError(28, "simulated: no space left on device")
            return commit(*args, **kwargs)

        resume.commit = commit_or_fail
    elif spec["kill"] == "raise" and is_victim:
        callbacks.append(RaiseAtStep(spec["at"]))
    world_size = int(spec.get("devices") or os.environ["WORLD_SIZE"])
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=spec.get("steps", 50), precision="32-true", logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(
            sequence_parallel_size=spec["sp"], heartbeat_timeout=spec["heartbeat_timeout"]),
    )
    dataset = UnevenlyMaskedTokens(200, 16)
    trainer.fit(CausalLM(num_key_value_heads=2), DataLoader(dataset, batch_size=1, collate_fn=collate))


if __name__ == "__main__":
    main()
