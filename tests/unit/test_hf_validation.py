"""validate_hf_model refuses, before any collective, the models Ulysses attention would leave silently wrong."""

import pytest
import torch
from transformers import LlamaForCausalLM

from lightning_ulysses.attention.hf import _unswitched_module, find_token_mixers, validate_hf_model
from tests.distributed.families import tiny_model


def test_a_model_transformers_cannot_switch_is_refused():
    # Falcon's attention does not dispatch through the interface: set_attn_implementation only warns.
    with pytest.raises(ValueError, match="cannot switch the attention of FalconForCausalLM.*UlyssesAttention"):
        validate_hf_model(tiny_model("falcon"), 2)
    # A class whose source transformers cannot read (here: its module is not importable) is refused the same way.
    unreadable = type("NotebookLlama", (LlamaForCausalLM,), {"__module__": "a_notebook_cell"})
    model = tiny_model("llama")
    model.__class__ = unreadable
    with pytest.raises(ValueError, match="NotebookLlama.*importable module"):
        validate_hf_model(model, 2)
    validate_hf_model(model, 1)  # without sequence parallelism nothing is swapped


def test_a_switch_that_did_not_take_is_found():
    model = tiny_model("llama")
    private = {id(model.config): model.config}
    model.config._attn_implementation_internal = "ulysses"
    assert _unswitched_module(model, private) is None
    model.model.config = type(model.config)(**model.config.to_dict())  # a sub-model left on sdpa
    assert _unswitched_module(model, private) is model.model


@pytest.mark.parametrize("family, overrides, named", [
    ("qwen3_next", {}, "model.layers.0.linear_attn (Qwen3NextGatedDeltaNet)"),
    ("lfm2", {"layer_types": ["conv", "full_attention"]}, "model.layers.0.conv (Lfm2ShortConv)"),
    ("mamba", {}, "backbone.layers.0.mixer (MambaMixer)"),
])
def test_token_mixers_outside_attention_are_refused(family, overrides, named):
    with pytest.raises(NotImplementedError, match="sequence_parallel_size=1") as refusal:
        validate_hf_model(tiny_model(family, "eager" if family == "mamba" else "sdpa", **overrides), 2)
    assert named in str(refusal.value)


def test_layer_kinds_that_are_not_attention_are_refused():
    model = tiny_model("llama")
    validate_hf_model(model, 2)
    model.config.layer_types = ["full_attention", "retention"]  # a kind whose module this check cannot name
    with pytest.raises(NotImplementedError, match="layer 1 is 'retention' in config.layer_types"):
        validate_hf_model(model, 2)


def test_a_causal_convolution_is_found_without_its_name():
    model = tiny_model("llama")
    model.model.layers[1].mlp.act_fn = torch.nn.Conv1d(64, 64, 3, groups=64)
    assert find_token_mixers(model) == ["model.layers.1.mlp.act_fn (Conv1d)"]
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.act_fn \(Conv1d\)"):
        validate_hf_model(model, 2)


def test_llama4_nope_temperature_tuning_is_refused_when_active():
    with pytest.raises(NotImplementedError, match=r"layers\.1\.self_attn.*attn_temperature_tuning=False"):
        validate_hf_model(tiny_model("llama4_text", no_rope_layers=[1, 0]), 2)
    validate_hf_model(tiny_model("llama4_text", no_rope_layers=[1, 0], attn_temperature_tuning=False), 2)
    validate_hf_model(tiny_model("llama4_text", no_rope_layers=[1, 1]), 2)  # every layer with RoPE: not active


def test_dense_families_pass():
    for family in ("llama", "gpt2", "opt", "qwen3_moe"):
        assert validate_hf_model(tiny_model(family), 2) == "sdpa"


def test_at_sp_1_a_model_transformers_cannot_switch_keeps_its_own_attention_exactly():
    from lightning_ulysses.attention.hf import prepare_hf_model

    model = tiny_model("falcon")
    model.eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        prepared = prepare_hf_model(model, None)
        assert model.config._attn_implementation != "ulysses"
        assert torch.equal(model(input_ids=input_ids).logits, expected)
    prepared.restore()


def test_a_pure_ring_refuses_token_mixers_like_ulysses():
    # ring_size 2 over one Ulysses rank: the sequence is still cut, so a short convolution would see only its shard.
    model = tiny_model("lfm2", layer_types=["conv", "full_attention"])
    with pytest.raises(NotImplementedError, match="sequence_parallel_size=1"):
        validate_hf_model(model, 1, ring_size=2)
    validate_hf_model(model, 1)  # SP 1: nothing is cut
