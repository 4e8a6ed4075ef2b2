"""Token mixers split by heads (lightning_ulysses/mixers/), what the 4-rank family matrix cannot show on CPU: the
path a split Mamba2 mixer takes where mamba_ssm's fused kernel is installed (GPU), and which groups (B and C, key
heads) each rank's heads read when they split unevenly.

One process at SP 1, where a declared split is installed too: a row of one document runs through the mixer itself
(its fused kernel kept), packed rows through the local view and its stand-ins, one document at a time, as at any SP
size; exactness over several ranks is the matrix's (tests/distributed/test_families.py). Also the matrix's own
whole-rows reference of a mixer: one copy of the layer run twice starts each time as a fresh copy does.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from lightning_ulysses.hf import token_mixer_modules
from lightning_ulysses.mixers import install_mixers, left_on_whole_rows, mamba2, split_of, why_on_whole_rows
from lightning_ulysses.mixers.kernels import LinearTimeKernels
from tests.distributed.families import FAMILIES, SEQ_LEN, family_model, tiny_model
from tests.distributed.workers.families import _call_kwargs, _first, _on_whole_rows, _outermost_mixer_kinds, _Work

MAMBA2_FAMILIES = ("mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2")
# Rows of 8 tokens packing two documents of 4: the model's positions restart (what routes a mixer through its view).
PACKED = torch.cat([torch.arange(4), torch.arange(4)])[None].expand(2, -1)
FUSED = "mamba2_split_conv1d_scan_combined"  # the module-level name these mixers call their fused kernel by


def _mixer(family: str):
    path, module = token_mixer_modules(family_model(family))[0]
    return path, module.train()


def _fused_kernel(monkeypatch, module: torch.nn.Module) -> list:
    """Stand in for mamba_ssm's fused kernel as installed (it answers for every call, from the weights it is handed)
    in `module`'s modeling file; returns the list of its calls."""
    calls = []

    def fused(projected_states, *args, outproj_weight=None, **kwargs):
        calls.append(outproj_weight)
        return projected_states.new_zeros(*projected_states.shape[:-1], outproj_weight.shape[0])

    monkeypatch.setattr(sys.modules[type(module).__module__], FUSED, fused)
    return calls


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_a_split_mamba2_mixer_never_takes_the_fused_kernel_path(family, monkeypatch):
    # Where mamba_ssm is installed (GPU), these mixers in training hand their projected states to its fused kernel,
    # which normalises and projects out by itself from `out_proj.weight`: around the split's exchanges.
    path, mixer = _mixer(family)
    calls = _fused_kernel(monkeypatch, mixer)
    hidden = torch.randn(2, 8, mixer.hidden_size, generator=torch.Generator().manual_seed(0))
    mixer(hidden)
    assert len(calls) == 1  # the unprepared mixer takes it: the stand-in kernel is where the mixer looks
    with torch.no_grad():  # the path that calls the modules (the fused one is taken in training only), by document
        unfused = torch.cat([mixer.eval()(hidden[:, :4]), mixer(hidden[:, 4:])], dim=1)
    mixer.train()
    positions = PACKED
    handles, whole_rows = install_mixers([(path, mixer)], None, positions=lambda: positions)
    assert handles and not whole_rows
    try:
        output = mixer(hidden)
        assert len(calls) == 1, family  # the split view does not take it
        positions = PACKED[:, :4].repeat(1, 2) + torch.tensor([0, 0, 0, 0, 4, 4, 4, 4])  # one document per row
        mixer(hidden)
        assert len(calls) == 2, family  # a row of one document at SP 1: the mixer itself, its fused kernel kept
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(output, unfused)


def test_a_split_view_that_would_take_a_fused_path_is_refused(monkeypatch):
    # Were a declaration to leave the view in training, the fused kernel would read the output projection's weight
    # through its stand-in: refused, naming the fix, rather than projecting this rank's head rows.
    path, mixer = _mixer("mamba2")
    _fused_kernel(monkeypatch, mixer)
    declared = mamba2.split

    def in_training(module, parts, rank):
        split = declared(module, parts, rank)
        return type(split)(**{**split.__dict__, "attributes": {
            name: value for name, value in split.attributes.items() if name != "training"}})

    monkeypatch.setattr(mamba2, "split", in_training)
    handles, _ = install_mixers([(path, mixer)], None, positions=lambda: PACKED)
    try:
        with pytest.raises(NotImplementedError, match="sequence_parallel_size=1"):
            mixer(torch.randn(2, 8, mixer.hidden_size))
    finally:
        for handle in handles:
            handle.remove()


def test_mamba2_groups_split_with_the_heads_or_are_shared_or_copied_per_head():
    mixer = token_mixer_modules(tiny_model("mamba2", "eager", num_heads=12, n_groups=3, expand=3))[0][1]
    # 3 groups of 4 heads: over 3 ranks, one each; over 6, two ranks read each group; over 2, rank 0's 6 heads read
    # 4 of group 0 and 2 of group 1 (unequal: one copy of its group per head); over 5 (3, 3, 2, 2, 2 heads), rank 1's
    # heads 3-5 read group 0 once and group 1 twice (copies), rank 2's heads 6-7 group 1 alone
    def groups_of(parts: int, rank: int) -> int:
        return mamba2.split(mixer, parts, rank).attributes["n_groups"]

    assert [groups_of(3, rank) for rank in range(3)] == [1, 1, 1]
    assert [groups_of(6, rank) for rank in range(6)] == [1] * 6
    assert [groups_of(2, rank) for rank in range(2)] == [6, 6]
    assert [groups_of(5, rank) for rank in range(5)] == [1, 3, 1, 1, 1]
    assert [mamba2.split(mixer, 5, rank).attributes["num_heads"] for rank in range(5)] == [3, 3, 2, 2, 2]
    conv = mamba2.split(mixer, 6, 0).parameters["conv1d.weight"][1]
    state, inner = mixer.ssm_state_size, mixer.intermediate_size
    x = 2 * mixer.head_dim  # the rank's 2 heads' channels of x, then its group's of B
    b_of_rank = [conv.local_channels(rank, 6)[x:x + state] for rank in range(6)]
    assert [int(channels[0]) - inner for channels in b_of_rank] == [0, 0, state, state, 2 * state, 2 * state]
    x = 3 * mixer.head_dim  # over 5 ranks, rank 1: heads 3, 4, 5 read groups 0, 1, 1: three copies of B's channels
    b_of_rank_1 = conv.local_channels(1, 5)[x:x + 3 * state].view(3, state)[:, 0] - inner
    assert b_of_rank_1.tolist() == [0, state, state]
    # the norm's groups (4 heads each) are whole on every rank over 3 ranks only: there it runs unchanged, elsewhere
    # its sums of squares are summed over the ranks
    assert "norm" not in mamba2.split(mixer, 3, 0).replaced
    assert all("norm" in mamba2.split(mixer, parts, 0).replaced for parts in (2, 5, 6))


@pytest.mark.parametrize("family", ("mamba", "falcon_mamba"))
def test_a_split_mamba_mixer_never_takes_the_fused_kernel_path(family, monkeypatch):
    # Mamba1 in training hands its projected states to mamba_ssm's fused `mamba_inner_fn` where installed, which
    # reads x_proj's, dt_proj's and out_proj's weights itself: around the split (mixers/mamba.py). Falcon-Mamba has
    # that path up to transformers 5.24 only (from 5.25 on its modeling file has no `mamba_inner_fn`): there the
    # split is held to the same unfused result, and nothing can take a fused path.
    path, mixer = _mixer(family)
    fused_path = hasattr(sys.modules[type(mixer).__module__], "mamba_inner_fn")
    calls = []

    def fused(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, out_proj_weight, *args, **kwargs):
        calls.append(out_proj_weight)
        return xz.new_zeros(xz.shape[0], xz.shape[2], out_proj_weight.shape[0])

    if fused_path:
        monkeypatch.setattr(sys.modules[type(mixer).__module__], "mamba_inner_fn", fused)
    hidden = torch.randn(2, 8, mixer.hidden_size, generator=torch.Generator().manual_seed(0))
    mixer(hidden)
    assert len(calls) == int(fused_path)  # the unprepared mixer takes it where its family has it
    with torch.no_grad():
        unfused = torch.cat([mixer.eval()(hidden[:, :4]), mixer(hidden[:, 4:])], dim=1)
    mixer.train()
    handles, whole_rows = install_mixers([(path, mixer)], None, positions=lambda: PACKED)
    assert handles and not whole_rows
    try:
        output = mixer(hidden)
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == int(fused_path), family  # the split view does not take it
    torch.testing.assert_close(output, unfused)


def test_only_a_mixer_with_fewer_units_than_ranks_runs_on_whole_rows_and_says_why():
    # Qwen3.5's Gated DeltaNet with 3 value heads (3 key heads): split unevenly over 2 ranks (2 and 1 heads), on
    # whole rows over 4 (a rank would hold no head), with the reason in the warning; over 3 ranks, one head each.
    model = tiny_model("qwen3_5_text", linear_num_key_heads=3, linear_num_value_heads=3)
    mixers = token_mixer_modules(model)
    assert left_on_whole_rows(mixers, 2) == left_on_whole_rows(mixers, 3) == []
    assert [path for path, _ in left_on_whole_rows(mixers, 4)] == [path for path, _ in mixers]
    assert why_on_whole_rows(mixers[0][1], 2) is None
    assert "its 3 heads/channels are fewer than the 4 SP ranks" in why_on_whole_rows(mixers[0][1], 4)
    split = [split_of(mixers[0][1], 2, rank) for rank in range(2)]
    assert [s.attributes["num_v_heads"] for s in split] == [2, 1]
    assert [s.attributes["num_k_heads"] for s in split] == [2, 1]


def test_gated_deltanet_value_heads_split_unevenly_with_the_key_heads_they_read():
    # Qwen3-Next's in_proj_qkvz is grouped by key head: [query | key | its value heads' values | their gates]. With
    # 9 value heads over 3 key heads (3 each) at SP 4 (3, 2, 2, 2 value heads), rank 2's value heads 5 and 6 read key
    # heads 1 and 2, one each: its view holds 2 key heads of one value head each.
    mixer = token_mixer_modules(family_model("qwen3_next@uneven"))[0][1]
    split = split_of(mixer, 4, 2)
    assert (split.attributes["num_k_heads"], split.attributes["num_v_heads"]) == (2, 2)
    key, value = mixer.head_k_dim, mixer.head_v_dim
    block = 2 * key + 3 * 2 * value  # one key head's block of in_proj_qkvz
    channels = split.inputs["in_proj_qkvz"].local_channels(2, 4)
    expected = []
    for key_head, within in ((1, 2), (2, 0)):  # value head 5 is key head 1's third, 6 is key head 2's first
        start = key_head * block
        expected += [*range(start, start + 2 * key),  # its query and key
                     *range(start + 2 * key + within * value, start + 2 * key + (within + 1) * value),  # the value
                     *range(start + 2 * key + (3 + within) * value, start + 2 * key + (4 + within) * value)]  # gate
    assert channels.tolist() == expected


# Every family whose mixers the matrix checks layer by layer (test_families.py `MIXER_FAMILIES`), and an uneven one.
MIXER_FAMILIES = (*(name for name, settings in FAMILIES.items() if "mixers" in settings), "recurrent_gemma@uneven")


@pytest.mark.parametrize("family", MIXER_FAMILIES)
def test_the_matrix_reference_runs_one_copy_of_a_mixer_twice_as_two_fresh_copies(family):
    """The family matrix's whole-rows reference of a mixer (workers/families.py `_on_whole_rows`) runs one copy of the
    layer twice: transformers' kernels, then ours with the work counted. Both runs start as a fresh copy does: the
    first gives a fresh copy's output and input gradient, the second counts a fresh copy's work (measured, transformers
    5.25.0: every mixer family but one, on one copy called as transformers calls it, runs twice alike). RecurrentGemma's
    recurrent block, called with its default `use_cache=True`, keeps its final states (and their graph) on itself and
    starts its next call from them: its second run's backward met the first's freed graph, the failure once blamed on
    Mamba2 (docs/internals.md, "RecurrentGemma's recurrent block")."""
    model = family_model(family)
    for path, module in _outermost_mixer_kinds(model).values():
        hidden, weights, expected, whole_grad, work = _on_whole_rows(module, model, seed=11)
        assert hidden.shape[1] == SEQ_LEN
        fresh, whole = copy.deepcopy(module), hidden.clone().requires_grad_(True)
        output = _first(fresh(whole, **_call_kwargs(fresh, whole)))  # (a fresh copy: no state, whatever its cache)
        (output * weights).sum().backward()
        assert torch.equal(output, expected) and torch.equal(whole.grad, whole_grad), path
        fresh, again = copy.deepcopy(module), hidden.clone().requires_grad_(True)
        with LinearTimeKernels(type(fresh)).in_place(), _Work(fresh) as fresh_work:
            (_first(fresh(again, **_call_kwargs(fresh, again))) * weights).sum().backward()
        # FLOPs and rows; not the saved bytes, which `_Work` keys by storage address: a storage freed inside the
        # forward whose address a later saved tensor reuses counts once, as the allocator's history falls (seen once,
        # after four other test files: BailingHybridDeltaAttention 6,504,144 against 6,487,760 bytes; equal alone).
        counted, fresh_counted = work.totals(), fresh_work.totals()
        assert (counted["flops"], counted["rows"]) == (fresh_counted["flops"], fresh_counted["rows"]), path

