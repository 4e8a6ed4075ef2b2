"""A user's own training script, written as the README's contract says (tests/test_user_script.py runs it and reads
its console): 3 steps, a checkpoint, 3 more steps resumed from it in the middle of the epoch, a configuration the
strategy refuses, then a run that a scheduler's SIGTERM stops (the script lets Lightning's exception through, as
scripts do). `python tests/user_script.py <folder>`."""

import os
import signal
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_ulysses  # noqa: F401  (registers strategy="ulysses")
from lightning_ulysses import UlyssesDeepSpeedStrategy


class LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        # Eager attention, which the strategy runs exactly and warns about (its scores grow with the whole sequence).
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager"))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


folder = sys.argv[1]
tokens = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(0))  # the same in every rank
data = DataLoader([{"input_ids": row, "labels": row} for row in tokens], batch_size=2)  # 8 batches an epoch


def trainer(max_steps, strategy="ulysses"):
    return L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=max_steps, log_every_n_steps=1,
                     default_root_dir=folder, enable_checkpointing=False)


class Scheduler(L.Callback):
    """A scheduler's SIGTERM (a time limit, a preemption), reaching every rank while batch 2 trains."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            os.kill(os.getpid(), signal.SIGTERM)


first = trainer(3)
first.fit(LM(), data)
first.save_checkpoint(f"{folder}/step3.ckpt")
trainer(6).fit(LM(), data, ckpt_path=f"{folder}/step3.ckpt")  # continues at batch 4 of 8
try:
    trainer(6, UlyssesDeepSpeedStrategy(sequence_parallel_size=3)).fit(LM(), data)  # 3 does not divide 2 ranks
except ValueError as refused:
    print(f"{type(refused).__name__}: {refused}", flush=True)
preempted = trainer(6)
preempted.callbacks.append(Scheduler())
preempted.fit(LM(), data)  # saves hpc_ckpt_1.ckpt at step 3; the script then exits 79 (not finished), not 0
