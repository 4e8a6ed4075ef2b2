"""Worker: DeepSpeed ZeRO-3 with the optimizer offloaded to the host (CPU Adam), one training step; saves the
optimizer's sub-group sizes and every host buffer it holds, for the planner's host terms to be checked against."""

import json
import sys
from pathlib import Path

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

spec = json.loads(Path(sys.argv[1]).read_text())
config = LlamaConfig(**spec["config"])
torch.manual_seed(0)
model = LlamaForCausalLM(config)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "sub_group_size": spec["sub_group_size"],
                          "offload_optimizer": {"device": "cpu", "pin_memory": False, "ratio": spec["ratio"]}},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": False}}})
optimizer = engine.optimizer
input_ids = torch.randint(0, config.vocab_size, (1, 16))
engine.backward(engine(input_ids=input_ids, labels=input_ids).loss)
engine.step()


def placement(tensor: torch.Tensor) -> tuple:
    return tensor.device.type, tensor.numel(), tensor.element_size()


masters = optimizer.fp32_partitioned_groups_flat
torch.save({
    "sub_groups": [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel],
    "optimizer": type(optimizer.optimizer).__name__,
    "fp32_masters": [placement(master) for master in masters],
    "fp32_gradients": [placement(master.grad) for master in masters],
    "gradient_partitions": placement(optimizer.grad_partitions_flat_buffer),
    # every tensor CPU Adam keeps per sub-group (a copy of its own would show up here)
    "adam_states": [{name: placement(value) for name, value in optimizer.optimizer.state[master].items()
                     if torch.is_tensor(value) and value.dim()} for master in masters],
}, Path(sys.argv[2]) / f"result_{engine.global_rank}.pt")
