"""Worker: several runs in one process, then plain torch, each recording what it found of the process-wide state.

The runs (train_parity's `run_case`, in the spec's order), a run refused in its first step (the exception path)
among them, then one plain torch SGD step on the reference model (no Lightning, no DeepSpeed). Recorded: the process
state (`process_state()`) before everything, while each run trains and after each run; the plain step's loss,
weights and autograd nodes. `tests/distributed/test_process_state.py` compares them with a process that ran nothing.
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
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, build_model, collate
from tests.distributed.workers.train_parity import run_case

# What `torch.nn.functional.linear` is in a process where nothing replaced it (torch defines it as this builtin).
TORCHS_LINEAR = torch._C._nn.linear


def _hooks(modules) -> int:
    return sum(len(getattr(m, name)) for m in modules for name in (
        "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
        "_load_state_dict_pre_hooks"))


def process_state(module: torch.nn.Module | None = None) -> dict:
    """What a run may leave changed for the whole process, and the hooks left on `module`'s modules."""
    from deepspeed.utils import groups
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module_hooks = torch.nn.modules.module
    return {
        "linear_is_torchs": torch.nn.functional.linear is TORCHS_LINEAR,
        "allocator_variable": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "sdpa_order": [int(kernel) for kernel in torch._C._get_sdp_priority_order()],
        "attention_functions": {name: ALL_ATTENTION_FUNCTIONS[name].__qualname__
                                for name in ALL_ATTENTION_FUNCTIONS.valid_keys()},
        "global_module_hooks": sum(len(getattr(module_hooks, name)) for name in dir(module_hooks)
                                   if name.startswith("_global_") and name.endswith("hooks")),
        "deepspeed_mpu": groups.mpu is not None,
        "module_hooks": None if module is None else _hooks(module.modules()),
    }


class Observed(L.Callback):
    """The process state as a run's first step finds it, and after the run's teardown (a callback's `teardown` comes
    after the strategy's; an exception skips it): plain values, no reference to the run."""

    def __init__(self):
        self.in_training, self.after = None, None

    def on_train_start(self, trainer, pl_module):
        self.in_training = process_state()

    def teardown(self, trainer, pl_module, stage):
        self.after = process_state(pl_module.model)
        for name in ("log", "log_dict"):  # (Lightning's bound methods: the run's module and Trainer)
            vars(self).pop(name, None)


def refused_run(case: dict, world_size: int) -> dict:
    """A run that raises in its first step (a loss of the shard alone, `hand_written` at SP 2): what it said."""
    module = CausalLM(num_key_value_heads=case["kv_heads"], kind=case["model"], step="hand_written")
    trainer = L.Trainer(accelerator="cpu", devices=world_size, max_steps=case["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=case["sp"],
                                                                            stage=case["stage"]),
                        callbacks=[observed := Observed()])
    dataset = UnevenlyMaskedTokens(case["batch_size"] * case["steps"] * (world_size // case["sp"]), case["seq_len"])
    try:
        trainer.fit(module, DataLoader(dataset, batch_size=case["batch_size"], collate_fn=collate))
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    return {"refusal": refusal, "state_in_training": observed.in_training, "state_after": process_state(module)}


def plain_step(step: dict) -> dict:
    """One SGD step of the reference model in plain torch: loss, weights after it, and its graph's node names."""
    model = build_model(step["model"], step["kv_heads"], reference=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=step["lr"])
    dataset = UnevenlyMaskedTokens(10_000, step["seq_len"])
    batch = collate([dataset[i] for i in step["samples"]])
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    seen, pending = set(), [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is not None and node not in seen:
            seen.add(node)
            pending += [next_node for next_node, _ in node.next_functions]
    loss.backward()
    optimizer.step()
    return {"loss": loss.item(), "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
            "graph_nodes": sorted({type(node).__name__ for node in seen}),
            "module_hooks_of_a_new_model": _hooks(build_model(step["model"], step["kv_heads"]).modules())}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    world_size = int(spec["world_size"])
    results = {"state_before": process_state(), "runs": {}}
    for case in spec["runs"]:
        if case.get("refused"):
            results["runs"][case["name"]] = refused_run(case, world_size)
            continue
        observed = Observed()
        result = run_case(dict(case, workdir=str(workdir)), world_size, callbacks=(observed,))
        result.update(state_in_training=observed.in_training, state_after=observed.after)
        results["runs"][case["name"]] = result
    results["plain_step"] = plain_step(spec["plain_step"])
    results["state_after_plain_step"] = process_state()
    torch.save(results, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
