"""The planner's host terms for DeepSpeed's optimizer offload against the buffers a real ZeRO-3 engine holds (CPU,
two gloo ranks, fp32): the sub-group cut, and bytes per sub-group of fp32 master, Adam moments and fp32 gradients,
and the gradient partitions of all parameters. (The GPU/host split by sub-group count and the pinned rounding need
a GPU: `lightning_ulysses/planning/planner.py` cites the H200 measurements they reproduce.)"""

from __future__ import annotations

from pathlib import Path

from lightning_ulysses.planning.planner import ModelShape, TrainingSetup, optimizer_sub_groups, plan_memory
from tests.distributed.pool import shared

WORKER = Path(__file__).parent / "workers" / "optimizer_offload.py"
CONFIG = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
SUB_GROUP_SIZE = 1000
# In the shared 2-rank launch (pool.py). On a clone's first run this part JIT-builds DeepSpeed's CPU Adam (~150 s of
# CPU on 2 cores); on a busy machine that alone ran past the default 300 s.
JOB = shared(2, "optimizer_offload", WORKER, {"config": CONFIG, "sub_group_size": SUB_GROUP_SIZE, "ratio": 1.0},
             timeout=600)


def test_host_buffers_of_offloaded_optimizer_match_the_planner(tmp_path_factory):
    from transformers import LlamaConfig

    sub_group_size = SUB_GROUP_SIZE
    results = JOB.ranks(tmp_path_factory)
    shape = ModelShape.from_hf_config(LlamaConfig(**CONFIG))
    setup = TrainingSetup(seq_len=16, data_parallel_size=2, offload_optimizer=1.0, sub_group_size=sub_group_size,
                          compute_bytes=4, offload_pin_memory=False, host_process_bytes=0)
    groups = optimizer_sub_groups(shape, setup)
    plan = plan_memory(shape, setup)
    for result in results:
        assert result["optimizer"] == "DeepSpeedCPUAdam"
        assert result["sub_groups"] == groups and len(groups) > 5
        assert result["fp32_masters"] == [("cpu", n, 4) for n in groups]
        assert result["fp32_gradients"] == [("cpu", n, 4) for n in groups]
        assert result["adam_states"] == [{"exp_avg": ("cpu", n, 4), "exp_avg_sq": ("cpu", n, 4)} for n in groups]
        # the gradient partitions of every parameter, in the model's dtype (fp32 here), on the host
        assert result["gradient_partitions"] == ("cpu", sum(groups), 4)
        held = {"optimizer: fp32 master + Adam m, v": sum(n * size for _, n, size in result["fp32_masters"])
                + sum(n * size for state in result["adam_states"] for _, n, size in state.values()),
                "fp32 gradients of offloaded sub-groups": sum(n * size for _, n, size in result["fp32_gradients"]),
                "16-bit gradient partitions": sum(groups) * 4}
        assert {name: plan.host[name] for name in held} == held
        assert plan.host["pinned staging blocks left in the allocator's cache"] == 0
