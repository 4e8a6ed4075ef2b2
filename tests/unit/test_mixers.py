"""Token mixers split by heads (lightning_ulysses/mixers/), in one process: a group of one rank runs the same local
view as every rank of a larger group (the split's exactness and scaling are checked over 2 and 4 ranks in
tests/distributed/test_families.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from transformers import MambaConfig
from transformers.models.mamba import modeling_mamba

from lightning_ulysses.mixers import install_mixers, mamba


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _mamba_mixer() -> torch.nn.Module:
    config = MambaConfig(hidden_size=16, intermediate_size=32, state_size=4, num_hidden_layers=1, vocab_size=8)
    torch.manual_seed(0)
    return modeling_mamba.MambaMixer(config, layer_idx=0).train()


def _fused_kernel(*args, **kwargs):
    raise AssertionError("the fused kernel was called")


def test_a_split_mamba_mixer_avoids_the_fused_kernel_that_reads_its_weights(one_rank_group, monkeypatch):
    # In training Mamba calls mamba_inner_fn (mamba-ssm's fused kernel where installed), which reads x_proj's and
    # out_proj's weights instead of calling them: the split must take the path through its stand-ins instead.
    mixer = _mamba_mixer()
    hidden = torch.randn(2, 6, 16)
    with torch.no_grad():
        expected = mixer.eval()(hidden)  # the unfused path
    mixer.train()
    monkeypatch.setattr(modeling_mamba, "mamba_inner_fn", _fused_kernel)  # as if mamba-ssm were installed
    with pytest.raises(AssertionError, match="fused kernel"):
        mixer(hidden)
    handles, whole_rows = install_mixers([("mixer", mixer)], one_rank_group)
    assert not whole_rows
    torch.testing.assert_close(mixer(hidden), expected)
    for handle in handles:
        handle.remove()


def test_a_split_mixer_that_reads_a_projection_s_weight_is_stopped_with_the_fix(one_rank_group, monkeypatch):
    # A family whose declaration does not lead it away from such a kernel: reading the weight of a stand-in says so.
    split = mamba.split
    monkeypatch.setattr(mamba, "split", lambda module, parts: dataclasses.replace(split(module, parts), attributes={
        name: value for name, value in split(module, parts).attributes.items() if name != "training"}))
    monkeypatch.setattr(modeling_mamba, "mamba_inner_fn", lambda xz, conv, bias, x_proj_weight, *rest, **kw: None)
    mixer = _mamba_mixer()
    handles, _ = install_mixers([("mixer", mixer)], one_rank_group)
    with pytest.raises(AttributeError, match="read the weight of a layer it calls.*sequence_parallel_size=1"):
        mixer(torch.randn(2, 6, 16))
    for handle in handles:
        handle.remove()
