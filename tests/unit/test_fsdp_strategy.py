"""`UlyssesFSDPStrategy` without processes: its registry name, its description (`RunSpec` of backend "fsdp2"), and
what it refuses when it is built (DeepSpeed's options, a share of the optimizer on the host, unknown names), each naming
the fix."""

from __future__ import annotations

import inspect

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy, StrategyRegistry

import lightning_ulysses
from lightning_ulysses import UlyssesDeepSpeedStrategy, UlyssesFSDPStrategy
from lightning_ulysses.parallel import run_spec
from lightning_ulysses.parallel.layout import ParallelLayout
from lightning_ulysses.parallel.run_spec import RunSpec


def test_registered_beside_the_deepspeed_names():
    assert StrategyRegistry["ulysses_fsdp"]["strategy"] is UlyssesFSDPStrategy
    assert StrategyRegistry["ulysses"]["strategy"] is UlyssesDeepSpeedStrategy
    assert "UlyssesFSDPStrategy" in lightning_ulysses.__all__


def test_description_reads_as_zero3_scaled_by_sp():
    spec = RunSpec.of_fsdp_arguments({}, layout=ParallelLayout(world_size=4, sequence_parallel_size=2),
                                     precision="bf16-mixed")
    assert spec.fsdp2 and spec.zero3 and not spec.offloads_optimizer
    # FSDP2 averages its reduce-scatter over all ranks: each SP rank's share is scaled by SP (test_fsdp.py measures)
    assert spec.loss_gradient_scale == 2.0
    assert spec.fsdp_param_dtype is torch.bfloat16
    assert RunSpec.of_fsdp_arguments({}).fsdp_param_dtype is None
    assert RunSpec.of_config({}).backend == "deepspeed"


@pytest.mark.parametrize("arguments, fragments", [
    ({"stage": 2}, ["['stage'] is a DeepSpeed strategy option", "as ZeRO-3", "use strategy='ulysses'"]),
    ({"config": {"zero_optimization": {}}, "offload_optimizer": True},
     ["['config', 'offload_optimizer']", "use strategy='ulysses' (UlyssesDeepSpeedStrategy)"]),
    ({"tensor_parallel_size": 2}, ["tensor parallelism is not combined with sequence parallelism"]),
    ({"exchange": "copy_engine"}, ["collective backend only"]),
    # a share of the optimizer on the host: FSDP2's CPUOffloadPolicy offloads everything or nothing
    ({"memory": {"auto": True, "offload_optimizer": 0.3}},
     ["moves a share of the optimizer to the host", "CPUOffloadPolicy", "Leave offload_optimizer out",
      "strategy='ulysses'"]),
])
def test_refused_when_built_with_the_fix(arguments, fragments):
    with pytest.raises(ValueError) as raised:
        UlyssesFSDPStrategy(2, **arguments)
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_every_memory_feature_auto_and_the_allocator_setting_are_taken():
    UlyssesFSDPStrategy(2, memory={"expandable_segments": True})
    strategy = UlyssesFSDPStrategy(2, memory={"activation_checkpointing": True, "offload_activations": True,
                                              "keep_attention_outputs": True, "tiled_mlp": True,
                                              "tiled_logits_loss": True, "fused_elementwise": True,
                                              "low_memory_norms": True, "checkpoint_interval": 2})
    assert strategy.memory.tiled_mlp and strategy.memory.checkpoint_interval == 2 and strategy.memory.low_memory_norms
    # partial checkpointing and kept products (tests/distributed/test_fsdp.py trains them exactly), set or pinned in auto
    selective = UlyssesFSDPStrategy(2, memory={"activation_checkpointing": True, "checkpoint_layers": 1,
                                               "keep_matmul_outputs": True, "keep_token_mixer_outputs": True})
    assert selective.memory.checkpoint_layers == 1 and selective.memory.keep_token_mixer_outputs
    pinned = UlyssesFSDPStrategy(2, memory={"auto": True, "keep_matmul_outputs": True, "checkpoint_layers": 1})
    assert pinned.memory.keep_matmul_outputs and pinned.memory.checkpoint_layers == 1
    from lightning_ulysses.planning.auto import AutoMemory

    assert isinstance(UlyssesFSDPStrategy(2, memory="auto").memory, AutoMemory)
    assert UlyssesFSDPStrategy(2, memory={"auto": True, "seq_len": 8, "offload_optimizer": 0.0}).memory.seq_len == 8


def test_memory_auto_on_fsdp2_never_puts_the_optimizer_on_the_host():
    spec = RunSpec.of_fsdp_arguments({"memory": "auto"}, device="cuda", precision="bf16-mixed")
    assert spec.with_memory_choice(0.0, 10**6) is spec  # no sub-groups, no offload written
    with pytest.raises(ValueError, match="FSDP2 keeps the optimizer on the device"):
        spec.with_memory_choice(0.15, 10**6)


def test_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected argument"):
        UlyssesFSDPStrategy(2, stagee=3)


def test_precision_refused_in_the_description():
    with pytest.raises(ValueError, match="precision='16-true' is not supported by the FSDP2 strategy"):
        RunSpec.of_fsdp_arguments({}, precision="16-true")


def test_every_deepspeed_option_is_named_deepspeeds():
    """Every argument of Lightning's DeepSpeedStrategy and of UlyssesDeepSpeedStrategy that FSDP2 does not take is
    refused as DeepSpeed's (not as an unknown name)."""
    generic = {"self", "kwargs", "accelerator", "parallel_devices", "cluster_environment", "precision_plugin",
               "process_group_backend", "timeout"}
    deepspeed = set(inspect.signature(DeepSpeedStrategy.__init__).parameters)
    deepspeed |= set(inspect.signature(UlyssesDeepSpeedStrategy.__init__).parameters)
    missing = deepspeed - generic - set(run_spec.FSDP2_ARGUMENTS) - run_spec._DEEPSPEED_ARGUMENTS
    assert not missing


def test_the_lightning_method_it_calls_is_there():
    """`_lightning_private.init_model_parallel_distributed` calls `ModelParallelStrategy._setup_distributed()`."""
    assert tuple(inspect.signature(ModelParallelStrategy._setup_distributed).parameters) == ("self",)
