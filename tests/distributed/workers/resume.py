"""Worker: train, checkpoint, stop (max_steps or SIGTERM) and resume at the same or another SP × DP split.

The data is shuffled (Lightning's DistributedSampler: one permutation per epoch), so a resume that continues on
another epoch's permutation shows in the samples. Checkpoints come from every save path: ModelCheckpoint every n
steps and at epoch end, `trainer.save_checkpoint` from a callback at a step and after `fit` returned (max_steps),
and the SIGTERM save.

Every run records, per training step: the loss, the sample indices of the step's batch, Lightning's epoch, and
one draw from the global torch RNG (a probe: equal draws after a resume mean the generator states were restored
exactly, without dropout changing the model's math). Rank 0 records the final weights and the initial ones.
"""

import json
import os
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_ulysses
from tests.distributed.common import VOCAB, CausalLM, collate
from tests.distributed.workers.train_parity import CaptureWeights

SEQ_LEN = 16


class FullyLabelledTokens(Dataset):
    """Every position is a target, so the global token mean is the same at every DP size (uneven masks would make
    DP's mean-of-means differ from the token mean and hide what the test is about)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict:
        input_ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(7000 + index))
        return {"input_ids": input_ids, "labels": input_ids.clone(), "sample_index": torch.tensor(index)}


class ResumableLM(CausalLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.records[-1].update(rng_probe=torch.rand(1).item(), global_step=self.trainer.global_step,
                                epoch=self.trainer.current_epoch)
        return loss

    def configure_optimizers(self):
        # Momentum makes the optimizer state matter; the schedule makes the scheduler state matter.
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)]


class SaveAtStep(L.Callback):
    """`trainer.save_checkpoint` from user code in the middle of training (after the optimizer step of `step`)."""

    def __init__(self, step: int, path: Path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class SigtermInStep(L.Callback):
    """What a scheduler's SIGTERM (or SLURM's requeue signal) looks like to a rank: it arrives while a step runs.
    With `ranks` a subset: a scheduler that signals only the launching process, or ranks skewed in time when the
    signal lands."""

    def __init__(self, batch_idx: int, ranks: list, signum: int = signal.SIGTERM):
        self.batch_idx, self.ranks, self.signum = batch_idx, ranks, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx and trainer.global_rank in self.ranks:
            os.kill(os.getpid(), self.signum)


@contextmanager
def slurm_job(world_size: int):
    """What `srun --ntasks <world_size>` on one node adds to a rank's environment (Lightning then picks its
    SLURMEnvironment, auto-requeue on); removed again afterwards, for the next case of the same process."""
    rank = os.environ["RANK"]
    variables = dict(SLURM_NTASKS=str(world_size), SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NODEID="0",
                     SLURM_NNODES="1", SLURM_NTASKS_PER_NODE=str(world_size), SLURM_JOB_ID="4244",
                     SLURM_JOB_NAME="ulysses-test", SLURM_NODELIST="127.0.0.1")
    os.environ.update(variables)
    try:
        yield
    finally:
        for name in variables:
            del os.environ[name]


def run(case: dict, workdir: Path, world_size: int) -> dict:
    if case.get("slurm"):
        with slurm_job(world_size):
            return train(case, workdir, world_size)
    return train(case, workdir, world_size)


def train(case: dict, workdir: Path, world_size: int) -> dict:
    # Every case seeds alike (Lightning's sampler reads the seed from PL_GLOBAL_SEED), as one script run again does:
    # a shared launch may have run other jobs in this process first (the dropout job seeds 7), and a checkpoint saved
    # there would otherwise be resumed by a launch of its own under another epoch order.
    L.seed_everything(0, verbose=False)
    module = ResumableLM(num_key_value_heads=2, lr=0.2, kind=case.get("model", "llama"))
    initial = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    callbacks = [CaptureWeights()]
    if case.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=workdir / case["name"], every_n_train_steps=case["save_every"],
                                         save_top_k=-1, filename="{step}"))
    if case.get("save_epoch_end"):  # also where max_steps ends fit inside an epoch (Lightning's epoch-end hooks run)
        callbacks.append(ModelCheckpoint(dirpath=workdir / case["name"] / "epoch_end", every_n_epochs=1,
                                         save_on_train_epoch_end=True, save_top_k=-1, filename="{step}"))
    if case.get("save_at_step"):
        callbacks.append(SaveAtStep(case["save_at_step"], workdir / case["name"] / "callback.ckpt"))
    if case.get("sigterm_in_batch") is not None:
        callbacks.append(SigtermInStep(case["sigterm_in_batch"], case.get("sigterm_ranks", list(range(world_size))),
                                       getattr(signal, case.get("signal", "SIGTERM"))))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=case["steps"], precision="32-true",
        accumulate_grad_batches=case.get("accumulate", 1), logger=False,
        # False: the DataLoader's own RandomSampler (shuffle=True) draws each epoch's order as its iteration starts
        use_distributed_sampler=case.get("distributed_sampler", True),
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        default_root_dir=workdir / case.get("root", case["name"]),
        strategy=(lightning_ulysses.UlyssesFSDPStrategy(sequence_parallel_size=case["sp"])
                  if case.get("backend") == "fsdp2"
                  else lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=case["sp"],
                                                                  stage=case.get("stage", 3))),
    )
    loader = DataLoader(FullyLabelledTokens(), batch_size=case["batch_size"], shuffle=True, collate_fn=collate)
    ckpt_path = case.get("resume")
    if ckpt_path and ckpt_path != "hpc":
        ckpt_path = str(workdir / ckpt_path)
    exit_status, error = None, None
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            trainer.fit(module, loader, ckpt_path=ckpt_path)
            if case.get("save_after_fit"):
                trainer.save_checkpoint(workdir / case["name"] / "after_fit.ckpt")
    except SystemExit as stop:  # Lightning's SIGTERMException
        exit_status = stop.code
    except ValueError as refused:
        if not case.get("expect_error"):
            raise
        error = str(refused)
    return {
        "records": [{k: v for k, v in r.items() if k in ("loss", "sample_index", "rng_probe", "global_step", "epoch")}
                    for r in module.records],
        "weights": getattr(module, "final_weights", None) if dist.get_rank() == 0 else None,
        "initial": initial if dist.get_rank() == 0 else None,
        "exit_status": exit_status,  # what the SIGTERMException carries out of a script that lets it through
        "warnings": [str(w.message) for w in warned if "lightning_ulysses" in str(w.message)],
        "error": error,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
        "token_mixers": getattr(module, "token_mixers", None),  # how a hybrid's mixers trained (CaptureWeights)
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    results = {case["name"]: run(case, workdir, spec["world_size"]) for case in spec["cases"]}
    torch.save(results, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
