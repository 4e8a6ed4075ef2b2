"""`RunSpec`, the one description of the run: each field read from a DeepSpeed config, the questions readers ask, the
bad configurations refused on construction (naming the fix), the later decisions (ring size, `memory="auto"`) as new
descriptions, and the one writer of the config's ZeRO section."""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.parallel.layout import ParallelLayout
from lightning_ulysses.parallel.run_spec import (LIGHTNING_SUB_GROUP_SIZE, RunSpec, deep_merge, inference_config,
                                                 read_sequence_parallel_size)

SP2_DP2 = ParallelLayout(world_size=4, sequence_parallel_size=2)
OFFLOADING = {"zero_optimization": {"stage": 3, "sub_group_size": 1e8, "reduce_scatter": True,
                                    "offload_optimizer": {"device": "cpu", "ratio": 0.25, "pin_memory": False},
                                    "offload_param": {"device": "nvme"}},
              "data_types": {"grad_accum_dtype": "fp32"}}


@pytest.fixture
def offloading() -> RunSpec:
    return RunSpec.of_config(OFFLOADING, layout=SP2_DP2, precision="bf16-mixed", device="cpu")


# -- each field from a config -------------------------------------------------------------------------------------------
def test_layout_is_the_one_given(offloading):
    assert offloading.layout == SP2_DP2
    assert (offloading.sequence_parallel_size, offloading.data_parallel_size, offloading.world_size) == (2, 2, 4)


def test_zero_stage_from_the_config(offloading):
    assert offloading.zero_stage == 3


def test_zero_stage_defaults_to_deepspeeds_zero():
    assert RunSpec.of_config({}).zero_stage == 0


def test_optimizer_offload_device_ratio_and_pinning(offloading):
    assert offloading.optimizer_offload_device == "cpu"
    assert offloading.optimizer_offload_ratio == 0.25
    assert offloading.optimizer_offload_pin_memory is False


def test_pinning_defaults_to_deepspeeds_true():
    assert RunSpec.of_config({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}).optimizer_offload_pin_memory


def test_parameter_offload_device(offloading):
    assert offloading.parameter_offload_device == "nvme"


def test_device_none_means_no_offload():
    spec = RunSpec.of_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}})
    assert spec.optimizer_offload_device is None
    assert not spec.offloads_optimizer


def test_sub_group_size_is_an_integer(offloading):
    assert offloading.sub_group_size == 10**8 and isinstance(offloading.sub_group_size, int)


def test_sub_group_size_unset_is_none():
    assert RunSpec.of_config({"zero_optimization": {"stage": 3}}).sub_group_size is None


def test_reduce_scatter_from_the_config():
    assert RunSpec.of_config({"zero_optimization": {"stage": 2, "reduce_scatter": False}}).reduce_scatter is False


def test_grad_accum_dtype(offloading):
    assert offloading.grad_accum_dtype == "fp32"


def test_precision_and_device(offloading):
    assert offloading.precision == "bf16-mixed"
    assert offloading.device == torch.device("cpu")


# -- what readers ask ----------------------------------------------------------------------------------------------------
def test_offloads_optimizer_and_parameters(offloading):
    assert offloading.offloads_optimizer and offloading.offloads_parameters
    assert not RunSpec().offloads_optimizer and not RunSpec().offloads_parameters


def test_optimizer_share_on_host_is_the_ratio_under_zero3_only(offloading):
    assert offloading.optimizer_share_on_host == 0.25
    zero2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.25}}}
    assert RunSpec.of_config(zero2).optimizer_share_on_host == 1.0  # ZeRO-1/2 offload their partition whole
    assert RunSpec().optimizer_share_on_host == 0.0


@pytest.mark.parametrize("precision, expected", [("32-true", 4), ("bf16-mixed", 2), ("16-mixed", 2),
                                                 ("bf16-true", 2), ("16-true", 2)])
def test_compute_bytes_follow_the_precision(precision, expected):
    assert RunSpec(precision=precision).compute_bytes == expected


def test_on_cuda_follows_the_device():
    assert RunSpec(device="cuda").on_cuda
    assert not RunSpec(device=torch.device("cpu")).on_cuda


@pytest.mark.parametrize("zero, expected", [({"stage": 0}, 1.0), ({"stage": 2}, 1.0),
                                            ({"stage": 2, "reduce_scatter": False}, 1.0), ({"stage": 3}, 4.0),
                                            ({"stage": 3, "reduce_scatter": True}, 4.0)])
def test_loss_gradient_scale_per_zero_stage(zero, expected):
    layout = ParallelLayout(world_size=4, sequence_parallel_size=4)
    assert RunSpec.of_config({"zero_optimization": zero}, layout=layout).loss_gradient_scale == expected


# -- refused in one place, naming the fix ------------------------------------------------------------------------------
def test_zero3_without_reduce_scatter_is_refused_under_sequence_parallelism():
    # Its contiguous buckets divide by DP, its oversized ones by DP × SP: no one scale is exact.
    with pytest.raises(ValueError, match="Leave reduce_scatter on"):
        RunSpec.of_config({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, layout=SP2_DP2)


def test_zero3_without_reduce_scatter_trains_at_sp_1():
    # DP × SP = DP: both of its paths agree.
    spec = RunSpec.of_config({"zero_optimization": {"stage": 3, "reduce_scatter": False}},
                             layout=ParallelLayout(world_size=2, sequence_parallel_size=1))
    assert spec.loss_gradient_scale == 1.0


def test_unknown_zero_stage_is_refused():
    with pytest.raises(ValueError, match="zero_optimization.stage in the DeepSpeed config"):
        RunSpec.of_config({"zero_optimization": {"stage": 4}})


def test_offload_ratio_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="Set zero_optimization.offload_optimizer.ratio to a fraction"):
        RunSpec.of_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}})


def test_a_bad_layout_is_refused_by_the_layout():
    with pytest.raises(ValueError, match="does not divide world_size"):
        RunSpec(layout=ParallelLayout(world_size=4, sequence_parallel_size=3))


# -- later decisions, and writing them ---------------------------------------------------------------------------------
def test_with_ring_size_changes_only_the_layout(offloading):
    ringed = offloading.with_ring_size(2)
    assert ringed.layout == SP2_DP2.with_ring_size(2)
    assert ringed.with_ring_size(1) == offloading


def test_memory_choice_offloads_to_pinned_cpu_and_takes_the_sub_groups_on_cuda():
    spec = RunSpec.of_config({"zero_optimization": {"stage": 3}}, device="cuda")
    chosen = spec.with_memory_choice(0.3, 5000)
    assert (chosen.optimizer_offload_device, chosen.optimizer_offload_ratio) == ("cpu", 0.3)
    assert chosen.optimizer_offload_pin_memory
    assert chosen.sub_group_size == 5000


def test_memory_choice_keeps_a_configured_offload(offloading):
    chosen = RunSpec.of_config(OFFLOADING, device="cuda").with_memory_choice(0.9, 5000)
    assert (chosen.optimizer_offload_ratio, chosen.optimizer_offload_pin_memory) == (0.25, False)


def test_memory_choice_on_cpu_keeps_the_sub_groups(offloading):
    assert offloading.with_memory_choice(0.0, 5000).sub_group_size == offloading.sub_group_size


def test_written_into_sets_the_decided_fields_and_keeps_the_others():
    config = {"zero_optimization": {"stage": 3, "overlap_comm": True}, "gradient_clipping": 1.0}
    chosen = RunSpec.of_config(config, device="cuda").with_memory_choice(0.3, 5000)
    written = chosen.written_into(config)
    assert written["zero_optimization"] == {"stage": 3, "overlap_comm": True, "sub_group_size": 5000,
                                            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3}}
    assert written["gradient_clipping"] == 1.0
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}  # the caller's dict is left alone


def test_written_config_describes_the_same_run():
    config = {"zero_optimization": {"stage": 3}}
    chosen = RunSpec.of_config(config, device="cuda").with_memory_choice(0.3, 5000)
    assert RunSpec.of_config(chosen.written_into(config), device="cuda") == chosen


def test_inference_config_keeps_the_zero_section_under_zero3_only():
    config = {"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}
    assert inference_config(config, zero_stage_3=True)["zero_optimization"] == {"stage": 3}
    assert "zero_optimization" not in inference_config(config, zero_stage_3=False)


# -- from the strategy's arguments (a recipe, before any strategy exists) ------------------------------------------
def test_of_strategy_arguments_follows_the_zero_arguments():
    spec = RunSpec.of_strategy_arguments({"stage": 3, "offload_optimizer": True, "sub_group_size": 1000})
    assert (spec.zero_stage, spec.optimizer_offload_device, spec.sub_group_size) == (3, "cpu", 1000)
    assert spec.optimizer_offload_pin_memory is False  # Lightning's pin_memory default


def test_of_strategy_arguments_defaults_are_the_strategys():
    spec = RunSpec.of_strategy_arguments({})
    assert (spec.zero_stage, spec.sub_group_size, spec.offloads_optimizer) == (3, LIGHTNING_SUB_GROUP_SIZE, False)


def test_of_strategy_arguments_merges_the_overrides():
    spec = RunSpec.of_strategy_arguments({"offload_optimizer": True,
                                          "config_overrides": {"zero_optimization": {"offload_optimizer": {"ratio": 0.4}}}})
    assert spec.optimizer_share_on_host == 0.4


def test_of_strategy_arguments_reads_a_given_config_without_its_ulysses_block():
    spec = RunSpec.of_strategy_arguments({"config": {"zero_optimization": {"stage": 1},
                                                     "ulysses": {"sequence_parallel_world_size": 2}}})
    assert spec.zero_stage == 1


# -- the dialect ---------------------------------------------------------------------------------------------------------
def test_ulysses_block_gives_the_sequence_parallel_size():
    config, size = read_sequence_parallel_size({"ulysses": {"sequence_parallel_world_size": 4}}, None)
    assert (config, size) == ({}, 4)


def test_ring_size_is_checked_against_a_known_sequence_parallel_size():
    with pytest.raises(ValueError, match="ring_size\\(3\\) does not divide sequence_parallel_size\\(4\\)"):
        read_sequence_parallel_size(None, 4, ring_size=3)


def test_deep_merge_skips_none():
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "c": 3}}) == {"a": {"b": 1, "c": 3}}


# -- the planner's view of the run -------------------------------------------------------------------------------------
def test_the_planner_plans_the_run_it_is_given(offloading):
    from lightning_ulysses.planning.planner import TrainingSetup

    setup = TrainingSetup.of_run(offloading, 4096)
    assert (setup.seq_len, setup.sequence_parallel_size, setup.data_parallel_size) == (4096, 2, 2)
    assert (setup.zero_stage, setup.offload_optimizer, setup.compute_bytes) == (3, 0.25, 2)
    assert (setup.sub_group_size, setup.offload_pin_memory) == (10**8, False)


def test_the_planner_takes_the_choices_tried_over_the_run(offloading):
    from lightning_ulysses.planning.planner import TrainingSetup

    setup = TrainingSetup.of_run(offloading, 4096, offload_optimizer=0.5, sub_group_size=7)
    assert (setup.offload_optimizer, setup.sub_group_size) == (0.5, 7)


def test_the_planner_keeps_its_sub_group_default_where_the_run_sets_none():
    from lightning_ulysses.planning.planner import TrainingSetup

    assert TrainingSetup.of_run(RunSpec(), 1).sub_group_size == TrainingSetup.sub_group_size
