"""validate_hf_model refuses, before any collective, the models Ulysses attention would leave silently wrong."""

import pytest
import torch
from transformers import LlamaForCausalLM

from lightning_ulysses.hf import find_token_mixers, validate_hf_model
from lightning_ulysses.hf.validation import _unswitched_module
from tests.distributed.families import family_model, tiny_model


def test_a_model_transformers_cannot_switch_is_refused():
    # An adapter takes Falcon's attention modules over (adapters/falcon.py), whether transformers can switch its
    # attention (from 5.25 on) or not (up to 5.24: set_attn_implementation only warns): it passes.
    assert validate_hf_model(tiny_model("falcon"), 2) == "sdpa"
    # A class whose source transformers cannot read (here: its module is not importable) and that no adapter
    # covers is refused.
    # (transformers caches its verdict on the class, and a subclass would inherit Llama's from any earlier switch)
    unreadable = type("NotebookLlama", (LlamaForCausalLM,), {"__module__": "a_notebook_cell",
                                                             "_can_set_attn_implementation_cached_value": None})
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
def test_token_mixers_outside_attention_are_found_and_accepted(family, overrides, named):
    """They run on whole rows (attention/mixers.py); the family matrix checks them exact."""
    model = tiny_model(family, "eager" if family == "mamba" else "sdpa", **overrides)
    assert named in find_token_mixers(model)
    validate_hf_model(model, 2)


@pytest.mark.parametrize("family, named", [
    # a dynamic mask built from the keys' values before the attention call (transformers 5.24)
    ("doge", "model.layers.0.self_attn (DogeAttention) builds a dynamic mask"),
    # recurrent loops re-reading keys from extra cache layers
    ("dory", "model.layers.0.self_attn (DoryAttention) re-reads keys"),
    # a short convolution over the keys inside the attention module (handed the shard, before the exchange)
    ("inkling_text", "model.layers.0.self_attn.k_sconv (InklingShortConvolution), inside the attention"),
    ("zaya", "model.layers.0.self_attn.qkv_proj (ZayaCCAProjection), inside the attention"),
    # a cell handed its query, key, value and gates by its layer (shard-shaped under sequence parallelism)
    ("xlstm", "(xLSTMBackend), which takes per-token inputs besides the hidden states (key, value, igate, fgate)"),
])
def test_attention_the_exchange_cannot_carry_is_refused_by_name(family, named):
    model = family_model(family)
    validate_hf_model(model, 1)  # (without sequence parallelism nothing is refused)
    with pytest.raises(NotImplementedError, match="sequence_parallel_size=1") as refusal:
        validate_hf_model(model, 2)
    assert named in str(refusal.value)


def test_layer_kinds_that_are_not_attention_are_refused():
    model = tiny_model("llama")
    validate_hf_model(model, 2)
    model.config.layer_types = ["full_attention", "retention"]  # a kind whose module this check cannot name
    with pytest.raises(NotImplementedError, match="layer 1 is 'retention' in config.layer_types"):
        validate_hf_model(model, 2)


def test_a_causal_convolution_is_run_by_the_module_that_calls_it():
    model = tiny_model("llama")
    model.model.layers[1].mlp.act_fn = torch.nn.Conv1d(64, 64, 3, groups=64)
    assert find_token_mixers(model) == ["model.layers.1.mlp (LlamaMLP)"]
    validate_hf_model(model, 2)
    model.model.layers[1].self_attn.act = torch.nn.Conv1d(8, 8, 3)  # a unit that would also hold attention
    model.model.layers[1].conv = torch.nn.Conv1d(8, 8, 3)
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1 \(LlamaDecoderLayer\), which also holds attention"):
        validate_hf_model(model, 2)


def test_llama4_nope_temperature_tuning_is_accepted():
    """Corrected from global positions (adapters/llama4.py); the family matrix checks it exact."""
    validate_hf_model(tiny_model("llama4_text", no_rope_layers=[1, 0]), 2)


def test_dense_families_pass():
    for family in ("llama", "gpt2", "opt", "qwen3_moe"):
        assert validate_hf_model(tiny_model(family), 2) == "sdpa"


@pytest.mark.parametrize("overrides", [{}, {"alibi": True}], ids=["rotary", "alibi"])
def test_at_sp_1_an_inline_attention_family_keeps_its_own_attention_exactly(overrides):
    # Up to transformers 5.24 Falcon cannot be switched at all; from 5.25 on it can, but a family an adapter takes over
    # at SP > 1 keeps its own attention at SP 1 (hf/prepare.py): switched, Falcon's ALiBi variant would add
    # its bias to the mask the "ulysses" key replaces.
    from lightning_ulysses.hf import prepare_hf_model

    model = tiny_model("falcon", **overrides)
    model.eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    with torch.no_grad():
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        prepared = prepare_hf_model(model, None)
        assert model.config._attn_implementation != "ulysses"
        assert torch.equal(model(input_ids=input_ids, attention_mask=attention_mask).logits, expected)
    prepared.restore()


def test_a_ring_refuses_token_mixers_that_cannot_split_by_their_heads():
    # whole-rows mixers run under pure Ulysses only: RecurrentGemma's 4 RG-LRU heads are fewer than 4 x 2 ranks
    model = tiny_model("recurrent_gemma", block_types=["recurrent", "attention"])
    with pytest.raises(NotImplementedError, match="ring_size=1"):
        validate_hf_model(model, 4, ring_size=2)
    validate_hf_model(model, 4)  # pure Ulysses: on whole rows (warned when prepared)
    # a mixer split by its own heads runs on a ring too, over all SP ranks (mixers/ranks.py)
    validate_hf_model(model, 2, ring_size=2)
    validate_hf_model(tiny_model("lfm2", layer_types=["conv", "full_attention"]), 1, ring_size=2)


@pytest.mark.parametrize("family", ["bert", "roberta", "bart", "marian", "bert-generation", "xlnet"])
def test_causal_lm_heads_of_encoder_families_are_refused_under_sequence_parallelism(family):
    """Encoder (and encoder-decoder) families' causal-LM heads are not in the family matrix: refused before training at
    SP > 1, by name and with the fix; at SP 1 they stay as they are."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    sizes = {"xlnet": dict(d_model=32, n_layer=1, n_head=4, d_head=8, d_inner=48),
             "bart": dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48)}
    sizes["marian"] = dict(sizes["bart"], pad_token_id=0, decoder_start_token_id=0, decoder_vocab_size=64)
    config = transformers.AutoConfig.for_model(family, vocab_size=64, **sizes.get(family, dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)))
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])(config)
    with pytest.raises(NotImplementedError, match=rf"causal-LM head of '{family}', an encoder.*sequence_parallel_size=1"):
        validate_hf_model(model, 2)
    validate_hf_model(model, 1)
