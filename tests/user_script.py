"""A user's own training script, written as the README's contract says (tests/test_user_script.py runs it and reads
its console): 3 steps, a checkpoint, 3 more steps resumed from it in the middle of the epoch, then a configuration
the strategy refuses. `python tests/user_script.py <folder>`."""

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


first = trainer(3)
first.fit(LM(), data)
first.save_checkpoint(f"{folder}/step3.ckpt")
trainer(6).fit(LM(), data, ckpt_path=f"{folder}/step3.ckpt")  # continues at batch 4 of 8
trainer(6, UlyssesDeepSpeedStrategy(sequence_parallel_size=3)).fit(LM(), data)  # 3 does not divide 2 ranks
