import json

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

import lightning_ulysses
from lightning_ulysses import UlyssesDeepSpeedStrategy


def test_registry_names_and_deepspeed_names_survive():
    for name in ("ulysses", "ulysses_stage_1", "ulysses_stage_2", "ulysses_stage_3", "ulysses_stage_3_offload"):
        assert StrategyRegistry[name]["strategy"] is UlyssesDeepSpeedStrategy
    assert StrategyRegistry["deepspeed_stage_3"]["strategy"] is DeepSpeedStrategy
    assert StrategyRegistry["ulysses_stage_2"]["init_params"] == {"stage": 2}


def test_registration_is_idempotent():
    import importlib

    importlib.reload(lightning_ulysses)  # a second import must not raise "already present"


def test_defaults():
    strategy = UlyssesDeepSpeedStrategy()
    assert strategy.config["zero_optimization"]["stage"] == 3
    assert strategy.sequence_padding == "pad"


def test_ulysses_block_is_read_and_stripped(tmp_path):
    user_config = {"zero_optimization": {"stage": 2}, "ulysses": {"enable": True, "sequence_parallel_world_size": 4}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user_config))
    for config in (user_config, str(path)):
        strategy = UlyssesDeepSpeedStrategy(config=config)
        assert "ulysses" not in strategy.config
        assert strategy.runtime.parallel.requested_sequence_parallel_size == 4
    assert "ulysses" in user_config  # the caller's dict is left alone


def test_disabled_block_means_sp_1():
    strategy = UlyssesDeepSpeedStrategy(config={"ulysses": {"enable": False, "sequence_parallel_world_size": 4}})
    assert strategy.runtime.parallel.requested_sequence_parallel_size == 1


def test_block_disagreeing_with_argument():
    with pytest.raises(ValueError, match="sequence_parallel_size=2 disagrees.*sequence_parallel_world_size=4"):
        UlyssesDeepSpeedStrategy(sequence_parallel_size=2, config={"ulysses": {"sequence_parallel_world_size": 4}})


def test_malformed_block():
    with pytest.raises(ValueError, match='"ulysses" block must look like'):
        UlyssesDeepSpeedStrategy(config={"ulysses": {"sp_size": 4}})


@pytest.mark.parametrize("size", [0, -1, "4"])
def test_bad_sequence_parallel_size(size):
    with pytest.raises(ValueError, match="sequence_parallel_size must be an integer >= 1"):
        UlyssesDeepSpeedStrategy(sequence_parallel_size=size)


def test_groups_used_too_early_explain_when():
    with pytest.raises(RuntimeError, match="created when the Trainer sets up distributed training"):
        UlyssesDeepSpeedStrategy(sequence_parallel_size=2).sequence_parallel_rank


def test_single_rank_runs_in_a_notebook_and_several_ranks_point_to_ulysses_notebook(monkeypatch):
    import lightning as L
    from lightning.fabric.utilities import imports
    from lightning.pytorch.trainer.connectors import accelerator_connector

    monkeypatch.setattr(imports, "_IS_INTERACTIVE", True)
    monkeypatch.setattr(accelerator_connector, "_IS_INTERACTIVE", True)
    trainer = L.Trainer(strategy=UlyssesDeepSpeedStrategy(), accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.launcher is None  # one rank: trains in the notebook's own process
    with pytest.raises(RuntimeError, match="strategy='ulysses_notebook'"):
        L.Trainer(strategy=UlyssesDeepSpeedStrategy(), accelerator="cpu", devices=2, logger=False)


def test_on_cpu_the_process_group_starts_without_building_deepspeeds_shared_memory_op(monkeypatch):
    """DeepSpeed's CPU backend would compile its shared-memory all-reduce (inference only) when the group starts."""
    import deepspeed.ops
    import lightning as L
    from deepspeed.comm.torch import build_shm_op

    from lightning_ulysses.fences import _lightning_private

    class Started(Exception):
        pass

    def init_deepspeed_distributed(strategy):  # what DeepSpeed's TorchBackend would build at this point
        raise Started(build_shm_op())

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)  # whatever ran before
    monkeypatch.setattr(_lightning_private, "init_deepspeed_distributed", init_deepspeed_distributed)
    trainer = L.Trainer(strategy=UlyssesDeepSpeedStrategy(), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(Started) as started:
        trainer.strategy.setup_distributed()
    assert started.value.args == (None,)


@pytest.mark.parametrize("hook", ["training_step", "backward", "validation_step", "test_step", "predict_step"])
def test_sdpa_kernel_priority_holds_in_every_step_and_backward(hook, monkeypatch):
    """Forward and backward (where checkpointed layers recompute) run under the same SDPA kernel order."""
    import torch

    seen = []
    monkeypatch.setattr(DeepSpeedStrategy, hook, lambda self, *a, **k: seen.append(torch._C._get_sdp_priority_order()),
                        raising=False)
    default = torch._C._get_sdp_priority_order()
    getattr(UlyssesDeepSpeedStrategy(sdpa_kernel_priority=["cudnn", "math"]), hook)()
    getattr(UlyssesDeepSpeedStrategy(), hook)()
    cudnn, math, flash, efficient = 3, 0, 1, 2  # torch's SDPBackend values
    assert seen == [[cudnn, math, flash, efficient, 4], default]
    assert torch._C._get_sdp_priority_order() == default  # restored after the step
    with pytest.raises(ValueError, match="distinct SDPA kernels"):
        UlyssesDeepSpeedStrategy(sdpa_kernel_priority=["cudnn", "cudnn"])


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_bad_overlap_head_groups_name_the_fix(value):
    with pytest.raises(ValueError, match="overlap_head_groups must be a whole number >= 1"):
        UlyssesDeepSpeedStrategy(overlap_head_groups=value)


def test_overlap_head_groups_of_a_module_win_over_the_strategy():
    from lightning_ulysses import UlyssesAttention

    own, inherits = UlyssesAttention("sdpa", overlap_head_groups=4), UlyssesAttention("sdpa")
    for attention in (own, inherits):
        attention.bind_head_groups(2)
    assert (own.head_groups, inherits.head_groups) == (4, 2)
    inherits.bind_head_groups(None)
    assert inherits.head_groups == 1
    for bad in (0, 1.5, True):  # the same check as the strategy's
        with pytest.raises(ValueError, match="overlap_head_groups must be a whole number >= 1"):
            UlyssesAttention("sdpa", overlap_head_groups=bad)


def test_preflight_run_carries_the_run_and_the_parameters():
    """The start-up preflight gets the strategy's run description (its ZeRO stage, ratio, sub-group size and
    pin_memory: `test_run_spec.py`) and the trainable parameter tensors (registration order), so its host check counts
    DeepSpeed's buffers."""
    from types import SimpleNamespace

    import torch

    from lightning_ulysses.parallel.layout import ParallelLayout
    from lightning_ulysses.planning.preflight import PlannedRun
    from lightning_ulysses.parallel.run_spec import RunSpec

    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    module[0].bias.requires_grad_(False)  # frozen: not in the optimizer
    config = {"zero_optimization": {"stage": 3, "sub_group_size": 1000,
                                    "offload_optimizer": {"device": "cpu", "ratio": 0.5, "pin_memory": False}}}
    spec = RunSpec.of_config(config, layout=ParallelLayout(world_size=4, sequence_parallel_size=2),
                             precision="bf16-mixed")
    stub = SimpleNamespace(run_spec=spec, num_processes=2, local_rank=0, num_nodes=2, lightning_module=module)
    run = PlannedRun.of_strategy(stub)
    assert run.spec is spec
    assert run.parameter_numels == (12, 6, 2)
    assert run.num_parameters == 23
    assert (run.local_world_size, run.num_nodes) == (2, 2)
    assert run.sub_group_size == 1000  # ZeRO-3's, the unit of the partial offload


def test_the_run_is_described_at_set_up_not_before():
    with pytest.raises(RuntimeError, match="when the Trainer sets up distributed training"):
        UlyssesDeepSpeedStrategy().run_spec
