import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig

import lightning_ulysses  # registers "ulysses", "ulysses_stage_{1,2,3}", "ulysses_stage_3_offload", "ulysses_notebook"


class LM(L.LightningModule):  # exactly as without sequence parallelism
    def __init__(self):
        super().__init__()
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss  # batch = {"input_ids", "labels", ...} at FULL length
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def rows(count=64, seq_len=128):
    tokens = torch.randint(0, 256, (count, seq_len), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


if __name__ == "__main__":
    trainer = L.Trainer(strategy="ulysses", accelerator="cpu", devices=2, max_steps=8)  # SP = devices per node
    trainer.fit(LM(), DataLoader(rows(), batch_size=2))
