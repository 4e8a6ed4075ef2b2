"""Runs leave the process as they found it: one process (2 ranks, SP 2) trains ZeRO-3,
has a ZeRO-3 run refused in its first step, trains ZeRO-2, then takes a plain torch SGD step; each is exact
against a process that ran nothing before it, and finds the process-wide state as such a process has it.

Under ZeRO-3 Lightning builds the model inside DeepSpeed's `zero.Init`, which replaces `torch.nn.functional.linear`
with its ZeRO-3 linear for the whole process and leaves it (lightning_ulysses/integration/process_state.py): before the
strategy put it back at teardown, the ZeRO-2 run, the plain step and everything after them computed every
`nn.Linear` with DeepSpeed's autograd function. The models are the native GPT (biased linears, built in
`configure_model`); the first run also switches expandable segments on (on CPU: `PYTORCH_CUDA_ALLOC_CONF` only).
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.reference import assert_weights_match, reference_training
from tests.distributed.test_parity import _case, check_parity

WORKER = ROOT / "tests" / "distributed" / "workers" / "process_state.py"
TRAINED = [
    _case(2, 2, 3, "mqa", suffix="-gpt-first", model="gpt", in_configure_model=True,
          strategy_kwargs={"memory": {"expandable_segments": True}}),
    _case(2, 2, 2, "mqa", suffix="-gpt-after-zero3", model="gpt", in_configure_model=True),
]
REFUSED = _case(2, 2, 3, "mqa", suffix="-gpt-refused", model="gpt", refused=True, steps=1)
CASES = [TRAINED[0], REFUSED, TRAINED[1]]
PLAIN_STEP = {"model": "gpt", "kv_heads": 1, "seq_len": 16, "lr": 0.5, "samples": [0, 1]}
# One launch for the whole job (its runs must share a process): "runs", not "cases", which pool.py would launch
# one by one, each on fresh ranks.
JOB = shared(2, "process_state", WORKER, {"runs": CASES, "plain_step": PLAIN_STEP})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


@pytest.mark.parametrize("case", TRAINED, ids=[case["name"] for case in TRAINED])
def test_each_run_is_exact_against_the_reference(ranks, case):
    check_parity(case, [rank["runs"][case["name"]] for rank in ranks], claims=("losses", "weights"))


def test_a_run_finds_torchs_linear_and_leaves_it_back(ranks):
    """DeepSpeed's linear only inside a ZeRO-3 run, as in a process of its own; torch's after every run, the refused
    one too, and in the ZeRO-2 run after them."""
    for rank in ranks:
        assert rank["state_before"]["linear_is_torchs"]
        runs = [rank["runs"][case["name"]] for case in CASES]
        assert [run["state_in_training"]["linear_is_torchs"] for run in runs] == [False, False, True]
        assert [run["state_after"]["linear_is_torchs"] for run in runs] == [True, True, True]
        assert rank["runs"][REFUSED["name"]]["refusal"] is not None
        assert rank["state_after_plain_step"]["linear_is_torchs"]


def test_nothing_else_process_wide_is_left_changed(ranks):
    """The allocator's variable (set while the first run trains), the SDPA kernel order, transformers' attention
    functions (the one name the strategy adds, `"ulysses"`, aside), global module hooks, DeepSpeed's `mpu`, and the
    hooks on the trained modules (as many as on a new model: none)."""
    for rank in ranks:
        before = rank["state_before"]
        first = rank["runs"][TRAINED[0]["name"]]
        assert first["state_in_training"]["allocator_variable"] == "expandable_segments:True"
        for run in rank["runs"].values():
            after = run["state_after"]
            assert after["allocator_variable"] == before["allocator_variable"] is None
            assert after["sdpa_order"] == before["sdpa_order"]
            added = set(after["attention_functions"]) - set(before["attention_functions"])
            assert added <= {"ulysses"}
            assert {name: after["attention_functions"][name] for name in before["attention_functions"]} == \
                before["attention_functions"]
            assert after["global_module_hooks"] == before["global_module_hooks"] == 0
            assert not after["deepspeed_mpu"]
            assert after["module_hooks"] == rank["plain_step"]["module_hooks_of_a_new_model"]


def test_a_plain_torch_step_after_the_runs_is_a_fresh_processs(ranks):
    """The same step in this (pytest's) process: the same loss and weights, and torch's own autograd nodes (no
    DeepSpeed function in the graph)."""
    reference = reference_training(PLAIN_STEP["kv_heads"], PLAIN_STEP["seq_len"], [[PLAIN_STEP["samples"]]],
                                   lr=PLAIN_STEP["lr"], kind=PLAIN_STEP["model"])
    for rank in ranks:
        step = rank["plain_step"]
        assert abs(step["loss"] - reference["losses"][0][0]) < 1e-5
        assert_weights_match(step["weights"], reference)
        assert not [name for name in step["graph_nodes"] if "ZeroStage3" in name], step["graph_nodes"]
        assert "AddmmBackward0" in step["graph_nodes"]  # torch's biased linear (DeepSpeed's adds the bias itself)
