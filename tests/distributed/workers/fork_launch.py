"""Worker: several fits in ONE plain Python process, each starting its ranks by forking (strategy="ulysses_notebook").

Run as `python fork_launch.py <spec.json> <workdir>` by test_notebook_launch.py (forked from the harness's server,
whose imports a kernel would have made too), never inside pytest (pytest's own state must not be forked). It leads
a session of its own, so that the test can end it with the ranks it forked. Each forked rank saves what its steps
saw to `<case>_rank<r>.pt`; this process saves what came back to it (trained weights, trainer state, its own
environment) to `parent.pt`.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_ulysses
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate, settle_heap


class SaveRankRecords(L.Callback):
    """Runs in each forked rank: save its step records and the MASTER_PORT it rendezvoused on."""

    def __init__(self, path_prefix: Path):
        self.path_prefix = path_prefix

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        torch.save(
            {
                "records": [{"loss": r["loss"], "sample_index": r["sample_index"]} for r in pl_module.records],
                "sequence_parallel_rank": strategy.sequence_parallel_rank,
                "data_parallel_rank": strategy.data_parallel_rank,
                "master_port": os.environ["MASTER_PORT"],
                "pid": os.getpid(),
            },
            f"{self.path_prefix}_rank{trainer.global_rank}.pt",
        )


def make_strategy(case: dict):
    if case["strategy"] == "registered":
        return "ulysses_notebook"  # ZeRO-3, SP = devices
    # ZeRO-3 with every parameter partitioned (the tiny model's parameters are below DeepSpeed's default
    # persistence threshold, which would keep them whole on every rank): the weights the parent gets back
    # must be gathered from the partitions.
    return lightning_ulysses.UlyssesDeepSpeedStrategy(
        sequence_parallel_size=case["sp"],
        start_method="fork",
        config={
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
        },
    )


def run_case(case: dict, workdir: Path) -> dict:
    module = CausalLM(num_key_value_heads=case["kv_heads"])
    initial = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu", devices=case["devices"], strategy=make_strategy(case), max_steps=case["steps"],
        precision=case.get("precision", "32-true"), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[SaveRankRecords(workdir / case["name"])],
    )
    dataset = UnevenlyMaskedTokens(case["batch_size"] * case["steps"], case["seq_len"])
    trainer.fit(module, DataLoader(dataset, batch_size=case["batch_size"], collate_fn=collate))
    return {
        "launcher": type(trainer.strategy.launcher).__name__,
        "status": str(trainer.state.status),
        "parent_pid": os.getpid(),
        "initial": initial,
        "final": {name: p.detach().clone() for name, p in module.model.named_parameters()},
        "parent_records": len(module.records),  # steps ran in the children, not here
        # The parent must stay out of torch.distributed and keep its environment, so that the next fit works.
        "parent_dist_initialized": dist.is_initialized(),
        "parent_master_port": os.environ.get("MASTER_PORT"),
    }


def main() -> None:
    os.setsid()
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    results = {}
    for case in spec["cases"]:
        settle_heap()  # the forked ranks inherit it: their ZeRO-3 set-up does not walk the imported libraries
        results[case["name"]] = run_case(case, workdir)
    torch.save(results, workdir / "parent.pt")


if __name__ == "__main__":
    main()
