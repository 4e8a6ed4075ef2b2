"""Worker for test_dropout.py (world 4, SP 2 × DP 2): train a GPT-2 with dropout and record every mask drawn.

A GPT-2 with dropout on its embeddings, attention probabilities (drawn after the all-to-all, on this rank's heads of
the whole rows), attention output and MLP. A dispatch mode inside the training step records every Bernoulli draw
(`aten.bernoulli_`: what every dropout on CPU draws its mask with, nn.Dropout and SDPA's math kernel alike), in the
order drawn. Cases: a run after `seed_everything(7)`, the same again in a fresh Trainer (same seed), and with the
memory engine's checkpointed layers (their forward draws in the step, their recomputes replay in backward).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import lightning_ulysses
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate
from tests.distributed.families import tiny_model
from tests.distributed.workers.train_parity import CaptureWeights

DROPOUT = 0.2
SEQ_LEN = 16
_DRAWS = {torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli_.Tensor, torch.ops.aten.bernoulli.default,
          torch.ops.aten.bernoulli.p, torch.ops.aten.native_dropout.default}


def dropout_gpt2(attn_implementation: str = "sdpa"):
    """The same weights for the ranks (sdpa: the strategy's attention) and the reference (eager)."""
    return tiny_model("gpt2", attn_implementation, resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT)


class RecordDraws(TorchDispatchMode):
    """Every random draw of a dropout, as a boolean mask (below autograd: what the kernel drew)."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _DRAWS:
            assert func is torch.ops.aten.bernoulli_.float, f"a dropout drew through {func}: record it"
            self.masks.append(out.detach() != 0)
        return out


class DropoutLM(CausalLM):
    def __init__(self):
        super().__init__(2, lr=0.5, in_configure_model=True)
        self.model = dropout_gpt2()

    def training_step(self, batch, batch_idx):
        with RecordDraws() as draws:
            loss = super().training_step(batch, batch_idx)
        self.records[-1]["masks"] = draws.masks
        return loss


def run_case(case: dict, world_size: int) -> dict:
    L.seed_everything(case["seed"], verbose=False)
    module = DropoutLM()
    strategy = lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=2, stage=case["stage"],
                                                         memory=case.get("memory"))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=case["steps"],
                        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[CaptureWeights()])
    dataset = UnevenlyMaskedTokens(case["steps"] * (world_size // 2), SEQ_LEN)
    trainer.fit(module, DataLoader(dataset, batch_size=1, collate_fn=collate))
    return {
        "records": [{key: record[key] for key in ("loss", "sample_index", "masks")} for record in module.records],
        "sequence_parallel_rank": strategy.sequence_parallel_rank,
        "data_parallel_rank": strategy.data_parallel_rank,
        "weights": module.final_weights if dist.get_rank() == 0 else None,
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    results = {case["name"]: run_case(case, int(spec["world_size"])) for case in spec["cases"]}
    torch.save(results, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
