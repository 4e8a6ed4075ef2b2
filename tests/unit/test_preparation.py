"""The module pipeline (`lightning_ulysses.integration.preparation`): scan → check → prepare, and one undo that restores.

Single process, SP 1 (the pipeline's logic; the distributed tests prepare through the strategy at SP 2 and 4)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_ulysses.adapters import family_of
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.integration import preparation
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.families import family_model, tiny_model


def _runtime(memory=None) -> preparation.SequenceParallelRuntime:
    groups = SimpleNamespace(sequence_parallel_world_size=1, ulysses_size=1, ring_size=1, ulysses_group=None,
                             ring_group=None)
    slot = BatchRowsSlot()
    return preparation.SequenceParallelRuntime(groups, SequenceSharder(1, 0, batch_rows=slot), slot,
                                               SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot),
                                               MemoryOptions.coerce(memory))


class _Module(torch.nn.Module):
    def __init__(self, *models):
        super().__init__()
        self.models = torch.nn.ModuleList(models)


def _state(model) -> tuple:  # the loss function, and whether the memory engine tiled the first MLP
    return model.loss_function, "forward" in vars(model.model.layers[0].mlp)


def test_restore_undoes_every_adapter():
    model = tiny_model("llama")
    before = _state(model)
    prepared = preparation.scan(_Module(model), 1).prepare(_runtime({"tiled_mlp": True, "mlp_tile_tokens": 4}))
    assert _state(model)[0] is not before[0], "the HF adapter swapped the loss"
    assert _state(model)[1], "the memory engine tiled the MLP"
    assert set(prepared.hf_configs) == {"models.0"}
    prepared.restore()
    assert _state(model) == before


def test_a_failing_adapter_undoes_the_ones_before_it(monkeypatch):
    model = tiny_model("llama")
    loss_before = model.loss_function

    def fail(self, found, runtime):
        raise RuntimeError("prepare failed")

    monkeypatch.setattr(preparation.LossHosts, "prepare", fail)
    found = preparation.scan(_Module(model), 1)
    with pytest.raises(RuntimeError, match="prepare failed"):
        found.prepare(_runtime())
    assert model.loss_function is loss_before, "the HF model was left prepared"


def test_a_sharded_module_without_token_exchange_is_refused():
    with pytest.raises(ValueError, match="nothing would exchange tokens"):
        preparation.scan(_Module(torch.nn.Linear(2, 2)), 2)


def test_scan_reports_heads_and_the_position_rule():
    opt = tiny_model("opt")
    found = preparation.scan(_Module(opt), 2)
    assert found.head_counts == [(4, 4)]
    assert found.position_rule is not None and found.position_rule is family_of(opt.config).position_rule
    assert preparation.scan(_Module(tiny_model("llama")), 2).position_rule is None


def test_hub_kernels_are_suspended_while_a_model_is_prepared(tmp_path):
    # From transformers 5.25 on `from_pretrained` turns `use_kernels` on by default (wherever `kernels`, one of its
    # dependencies, is installed), and transformers kernelizes the model again at every train()/eval() that changes
    # its mode, deleting the forwards preparation installs on layers with a kernel slot (hub_kernels.py): measured, the
    # first eval() removed Qwen3.5's Gated DeltaNet split (packed documents no longer restarted it) and every
    # low-memory norm. The model runs as prepared until restored, then gets its kernels back.
    from transformers import AutoModelForCausalLM

    def load(name: str):
        family_model(name).save_pretrained(tmp_path / name)
        return AutoModelForCausalLM.from_pretrained(tmp_path / name, attn_implementation="sdpa").train()

    hybrid, dense = load("qwen3_5_text"), load("llama")
    kernels_were_on = (hybrid.use_kernels, dense.use_kernels)
    packed = {"input_ids": torch.arange(3, 19).reshape(2, 8),
              "position_ids": torch.cat([torch.arange(3), torch.arange(5)])[None].expand(2, -1)}
    preparations = [preparation.scan(_Module(hybrid), 1).prepare(_runtime()),
                    preparation.scan(_Module(dense), 1).prepare(_runtime({"low_memory_norms": True}))]
    norms = [module for module in dense.modules() if type(module).__name__ == "LlamaRMSNorm"]
    with torch.no_grad():
        expected = hybrid(**packed).logits
        hybrid.eval(), dense.eval()  # Lightning's sanity check and validation
        hybrid.train(), dense.train()
        torch.testing.assert_close(hybrid(**packed).logits, expected, rtol=0, atol=0)
    assert norms and all("forward" in vars(norm) for norm in norms), "the low-memory norms are still installed"
    for prepared in preparations:
        prepared.restore()
    assert (hybrid.use_kernels, dense.use_kernels) == kernels_were_on
    assert not any("forward" in vars(norm) for norm in norms)
