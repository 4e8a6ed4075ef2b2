"""Packed documents and padding are decided once per batch, from the rows the sharder publishes, not in every layer.

One 4-rank launch (see workers/batch_rows.py): the published rows give the same `DocumentMask` as the gather path
(SP 2, SP 4, SP 4 = Ulysses 2 × ring 2; plain, packed, right-, left- and packed + padded rows, also of a length the
sharder pads); the ring's
refusals are raised from them on every rank; a 4-layer model at SP 2 gathers nothing and builds one
`DocumentMask` per forward (none in the recompute of activation checkpointing) where the gather path did it in
every layer, with the same loss and gradients; the strategy's training steps take the published path.
"""

import pytest

from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.workers.batch_rows import NUM_LAYERS, ROW_KINDS

WORKER = ROOT / "tests" / "distributed" / "workers" / "batch_rows.py"
LAYOUTS = {"sp2_ring1": (2, 1), "sp4_ring1": (4, 1), "sp4_ring2": (4, 2)}
JOB = shared(4, "batch_rows", WORKER, {"layouts": list(LAYOUTS.values())})  # in the shared 4-rank launch (pool.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_published_rows_equal_the_gathered_rows(results, layout, kind):
    for rank in results:
        found = rank[layout]
        names = [kind] + ([f"{kind}_with_padding"] if "padded" in kind else [])
        for name in names:
            assert found[f"described_{name}"], name
            assert found[f"same_documents_{name}"], name
            assert found[f"has_documents_{name}"] == kind.startswith("packed"), name
            assert found[f"has_padding_{name}"] == name.endswith("with_padding"), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_only_the_sharded_tensor_itself_is_described(results, layout, kind):
    for rank in results:
        found = rank[layout]
        assert found[f"detached_described_{kind}"]  # the recompute of activation checkpointing detaches inputs
        assert not found[f"clone_described_{kind}"]
        assert not found[f"modified_described_{kind}"]


def test_ring_refuses_from_the_published_rows_on_every_rank(results):
    for rank in results:
        found = rank["sp4_ring2"]
        assert "cannot keep packed documents apart" in found["ring_packed_error"]
        assert "padding_side='right'" in found["ring_left_padded_error"]
        assert found["ring_right_padded_error"] is None
        for kind in ("packed", "left_padded", "right_padded"):
            assert found[f"ring_{kind}_same_error"], kind
            assert found[f"ring_{kind}_described_whole_rows"] == 0, kind
            assert found[f"ring_{kind}_gathered_whole_rows"] > 0, kind


# Per attention call on the packed, padded rows: the native GPT passes positions only, Llama positions and mask.
GATHERED_INPUTS = {"gpt": 1, "gpt_checkpointed": 1, "llama": 2}
# The loss shifts the batch's (unshifted) labels across the shards: one all-gather of the integer labels per forward,
# on either path; the attention's own gathers are what the described path removes.
LABEL_SHIFT_GATHERS = 1
# The value check compares each of the first two training steps' loss and logged values over the SP group in one
# small all-gather (logged_values.SameValueCheck); the strategy's steps below are both checked.
VALUE_CHECK_GATHERS = 1


@pytest.mark.parametrize("model", GATHERED_INPUTS)
def test_a_forward_gathers_nothing_and_builds_the_document_mask_once(results, model):
    inputs = GATHERED_INPUTS[model]
    for rank in results:
        found = {key[len(model) + 1:]: value for key, value in rank["sp2_ring1"].items() if key.startswith(f"{model}_")}
        assert found["gathered_forward_whole_rows"] == NUM_LAYERS * inputs
        assert found["gathered_forward_all_gather"] == NUM_LAYERS * inputs + LABEL_SHIFT_GATHERS
        assert found["gathered_forward_from_rows"] == NUM_LAYERS
        assert found["described_forward_whole_rows"] == 0
        assert found["described_forward_all_gather"] == LABEL_SHIFT_GATHERS
        assert found["described_forward_from_rows"] == 1
        # One host sync per input of every `from_rows` the described path no longer runs.
        saved = found["gathered_forward_host_syncs"] - found["described_forward_host_syncs"]
        assert saved == (NUM_LAYERS - 1) * inputs
        recomputed = NUM_LAYERS if model.endswith("checkpointed") else 0
        assert found["gathered_backward_from_rows"] == recomputed
        assert found["gathered_backward_all_gather"] == recomputed * inputs
        assert found["described_backward_from_rows"] == found["described_backward_all_gather"] == 0
        assert found["gathered_backward_host_syncs"] - found["described_backward_host_syncs"] == recomputed * inputs
        assert found["loss_difference"] < 1e-6
        assert found["grad_difference"] < 1e-6


def test_strategy_steps_use_the_published_rows(results):
    for rank in results:
        steps = rank["strategy_steps"]
        assert len(steps) == 2
        for counts in steps:
            assert counts.get("whole_rows", 0) == 0, counts
            assert counts.get("all_gather", 0) == LABEL_SHIFT_GATHERS + VALUE_CHECK_GATHERS, counts
            assert counts["from_rows"] == 1, counts
        assert rank["strategy_rows_released"]
