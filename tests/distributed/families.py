"""Tiny random causal LMs of every family the installed transformers can build, for the model-family matrix.

One generic recipe (`tiny_config`) shrinks a family's default config: only the settings the family has are
changed, every dropout is zeroed and layer patterns keep one layer of each kind the family mixes.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 96
SEQ_LEN = 24  # cut into 2 or 4 shards of 12 or 6 tokens: sliding windows (5) and chunks (8) cross them

_SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, n_embd=32, d_model=32, intermediate_size=64, ffn_dim=64, n_inner=64,
    num_hidden_layers=2, n_layer=2, num_layers=2, num_attention_heads=4, n_head=4, num_key_value_heads=2,
    head_dim=8, max_position_embeddings=64, n_positions=64, sliding_window=5, attention_chunk_size=8,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
    rotary_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # linear attention and state-space mixers (their defaults make CPU scans over chunks of 256 tokens)
    linear_key_head_dim=8, linear_value_head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
    mamba_d_state=16, mamba_chunk_size=8, chunk_size=8, ssm_state_size=16, state_size=16, mamba_num_heads=8,
    moe_shared_expert_intermediate_size=32, shared_intermediate_size=64, block_size=8, linear_head_dim=8,
    adapter_rank=8,
)

# Decoder families added to MODEL_FOR_CAUSAL_LM_MAPPING by transformers 5.24 and 5.25 (and older decoders the
# matrix had not built), with the settings their tiny models need.
NEWER_FAMILIES = {
    **{name: {} for name in (
        "afmoe", "apertus1p5_text", "aria_text", "beam", "cohere2_moe", "ctrl", "cwm", "doge", "dory", "ergo", "exaone",
        "exaone_moe", "flex_olmo", "flint", "gpt-sw3", "gpt_neox_japanese", "granite_swa", "granitemoe_swa",
        "granitemoeshared", "hrm_text", "hy_v3", "hy_v4", "hyperclovax", "inkling2_loop_text", "inkling2_text",
        "inkling_text", "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna", "mellum",
        "mimo_v2_flash", "minicpm5_moe", "minimax_m3_vl_text", "ministral3", "modernbert-decoder", "moshi",
        "openai-gpt", "param2moe", "sarvam_moe", "solar_open", "vaultgemma", "xlstm", "cpmant", "deepseek_v4",
    )},
    # per-layer inputs and settings (Gemma 3n/4) shrunk; layer kinds the defaults leave unset or too few
    **{name: {"per_layer_config": {}, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8}
       for name in ("gemma4_text", "gemma4_unified_text")},
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                     "laurel_rank": 4},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1, "mixers": "split"},
    "lara_mini": {"mixers": "split"}, "lfm3": {"mixers": "split"},
    "zaya": {"num_experts_per_tok": 1},
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3,
              "attention_head_dim": 16, "n_mamba_heads": 2, "mixers": "whole rows"},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
                       "indexer_compress_ratio": 2, "hc_lowrank": 8, "ple_embed_dim": 8, "ngram_vocab_size_base": 200,
                       "split_ngram_parts": 2, "linear_num_key_heads": 4, "linear_num_value_heads": 4},
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 1},
    "dots3_note_text": {"per_layer_config": {}, "num_key_value_heads": 4, "head_dim": 16},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    # multi-head latent attention: as many KV heads as heads
    **{name: {"num_key_value_heads": 4} for name in ("axk1", "axk2", "deepseek_v32", "glm_moe_dsa", "sarvam_mla")},
    "bailing_hybrid": {"num_key_value_heads": 4, "mixers": "split"},
}

# Families newer than the oldest transformers the dependency allows (5.24): the matrix builds them where the installed
# release has them (`test_the_matrix_covers_every_causal_lm`: any other family missing from it is an error).
SINCE_5_25 = frozenset({"ergo", "kolibri1_1", "minicpm5_moe", "param2moe"})

_ENCODER = ("an encoder (or an encoder-decoder's decoder) with a causal-LM head, not a decoder-only family: refused"
            " at SP > 1 by name (hf/validation.py `_reject_encoder_families`)")
_COMPOSITE = "a multimodal model: its text decoder is in the matrix as"
# The causal LMs of the installed MODEL_FOR_CAUSAL_LM_MAPPING the matrix does not build, and why (the coverage test
# holds the two lists to the mapping: a family transformers adds fails it until it is put in one of them).
NOT_IN_MATRIX = {
    **{name: _ENCODER for name in (
        "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small", "camembert",
        "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp", "pegasus", "plbart",
        "prophetnet", "rembert", "reformer", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "trocr",
        "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod")},
    **{name: f"{_COMPOSITE} {text}" for name, text in (
        ("gemma3", "gemma3_text"), ("gemma3n", "gemma3n_text"), ("gemma4", "gemma4_text"),
        ("gemma4_unified", "gemma4_unified_text"), ("llama4", "llama4_text"), ("qwen3_5", "qwen3_5_text"),
        ("qwen3_5_moe", "qwen3_5_moe_text"), ("qwen4_exp", "qwen4_exp_text"), ("dots3_note", "dots3_note_text"))},
    **{name: "a multimodal model (vision or audio encoder with a decoder) the tiny recipe does not shrink" for name in (
        "emu3", "fuyu", "git", "got_ocr2", "mllama", "moss_transcribe_diarize", "phi4_multimodal", "musicgen",
        "musicgen_melody")},
    "gemma4_assistant": "a drafter for Gemma 4's speculative decoding, built around a target's text config",
    "gemma4_unified_assistant": "a drafter for Gemma 4's speculative decoding, built around a target's text config",
    "blt": "byte latent transformer: patcher, local encoder and decoder sub-models the tiny recipe does not shrink",
}

# The families of MODEL_FOR_CAUSAL_LM_MAPPING built by the generic tiny recipe, plus settings that put a layer of
# each kind a hybrid mixes into two or three layers.
FAMILIES = {
    # dense and MoE decoders
    **{name: {} for name in (
        "llama", "mistral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma3_text",
        "phi", "phi3", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "codegen", "opt", "biogpt", "falcon",
        "stablelm", "starcoder2", "olmo", "olmo2", "olmo3", "olmoe", "cohere", "cohere2", "granite", "granitemoe",
        "smollm3", "glm", "glm4", "glm4_moe", "ernie4_5", "ernie4_5_moe", "seed_oss", "apertus",
        "hunyuan_v1_dense", "hunyuan_v1_moe", "helium", "nemotron", "persimmon", "exaone4", "internlm3", "arcee",
        "bitnet", "dots1", "minimax_m2", "nanochat",
    )},
    # differential attention subtracts two softmax maps: fp32 rounding reaches 1e-4 of some gradients at SP 4 (and
    # 1e-12 in float64, where the model is compared)
    "diffllama": {"float64": True},
    "phimoe": {"eval": True},  # its router samples experts at random in training (Gumbel): compared in eval mode
    # multi-head latent attention: as many KV heads as heads
    **{name: {"num_key_value_heads": 4} for name in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3",
                                                       "longcat_flash", "youtu")},
    "kimi_linear": {"num_key_value_heads": 4, "mixers": "split"},
    # eager-only in transformers (no sdpa): Gemma 2's soft-capping and GPT-OSS's sinks run in their own eager
    # attention on whole rows of each rank's heads; BLOOM, MPT, XGLM and GPT-Neo attend inline (families/)
    **{name: {} for name in ("gemma2", "gpt_oss", "bloom", "mpt", "xglm")},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 5},  # its local window crosses shards
    # hybrid and recurrent token mixers ("mixers": how they run, checked layer by layer: split by heads or on whole
    # rows)
    "qwen3_next": {"mixers": "split"}, "qwen3_5_text": {"mixers": "split"}, "qwen3_5_moe_text": {"mixers": "split"},
    "lfm2": {"layer_types": ["conv", "full_attention"], "mixers": "split"},
    # Falcon-H1 with its gated norm over 2 groups (split with the heads at SP 2, across ranks at SP 4) and muP
    # multipliers that differ per part of the projection
    "falcon_h1": {"mamba_rms_norm": True, "mamba_n_groups": 2, "ssm_in_multiplier": 0.5,
                  "ssm_multipliers": [0.5, 1.5, 0.75, 1.25, 2.0], "mixers": "split"},
    "granitemoehybrid": {"mamba_n_heads": 8, "layer_types": ["mamba", "attention"], "mixers": "split"},
    "nemotron_h": {"mixers": "split"},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "mixers": "split"},
    "bamba": {"mamba_n_heads": 8, "attn_layer_indices": [1], "mixers": "split"}, "minimax": {"mixers": "split"},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"], "mamba_headdim": 8, "n_mamba_heads": 8, "mixers": "split"},
    "olmo_hybrid": {"mixers": "split"}, "mamba": {"mixers": "split"}, "falcon_mamba": {"mixers": "split"},
    "mamba2": {"num_heads": 8, "n_groups": 1, "mixers": "split"},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "mixers": "split"}, "rwkv": {"mixers": "whole rows"},
    "llama4_text": {"no_rope_layers": [1, 0]},  # layer 1 without RoPE: the NoPE temperature tuning is active
    **NEWER_FAMILIES,
}
FAMILIES = {name: settings for name, settings in FAMILIES.items()
            if name not in SINCE_5_25 or name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
# Keys of a `FAMILIES` entry that say how the matrix runs the family, not settings of its config: compared in eval
# mode (`eval`), in float64 (`float64`); its token mixers that are not attention checked layer by layer, expected to
# run "split" by heads or on "whole rows" (`mixers`).
MARKERS = ("eval", "float64", "mixers")


def settings_of(name: str) -> dict:
    """The config settings of `FAMILIES[name]` (its markers left out)."""
    return {key: value for key, value in FAMILIES.get(name, {}).items() if key not in MARKERS}


def _has_setting(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # a per-layer setting (Gemma 4's head_dim) refuses a global read, but is set globally
        return True


# Hybrids whose mixers' units do not divide by SP 2 or 4 (`family_model("<family>@uneven")`): each rank then takes
# ⌈U/SP⌉ or ⌊U/SP⌋ of them (lightning_ulysses/mixers/channels.py). Gated DeltaNet with 9 value heads reading 3 key
# heads, and Mamba2 with 9 heads reading 3 groups of B and C: at SP 2 (5 and 4 heads) each rank's heads read two
# groups unequally (one copy of its group per head), at SP 4 (3, 2, 2, 2) rank 2's read one head of each of two
# groups, and the norm's groups span ranks; LFM2's short convolution over 31 channels (16, 15; 8, 8, 8, 7). The
# others split 5 heads (3, 2; 2, 1, 1, 1) or Mamba's 35 channels (18, 17; 9, 9, 9, 8); Qwen3.5's and OLMo-hybrid's
# 5 value heads read 5 key heads (one each), Falcon-H1's 9 heads 3 groups, with its own gated norm.
UNEVEN = {
    "qwen3_next": {"linear_num_key_heads": 3, "linear_num_value_heads": 9},
    "mamba2": {"num_heads": 9, "n_groups": 3, "head_dim": 8, "hidden_size": 36, "expand": 2},
    "lfm2": {"layer_types": ["conv", "full_attention"], "hidden_size": 31, "head_dim": 8},
    "qwen3_5_text": {"linear_num_key_heads": 5, "linear_num_value_heads": 5},
    "olmo_hybrid": {"linear_num_key_heads": 5, "linear_num_value_heads": 5},
    "falcon_h1": {"mamba_n_heads": 9, "mamba_d_ssm": 72, "mamba_n_groups": 3, "mamba_d_head": 8},
    "kimi_linear": {"linear_num_heads": 5},
    "mamba": {"intermediate_size": 35},
    "minimax": {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 8},
    "recurrent_gemma": {"num_attention_heads": 5, "num_key_value_heads": 1, "hidden_size": 40, "lru_width": 40,
                        "head_dim": 8},
}
# `<family>@router`: the MoE load-balancing term in the model's output (`aux_loss`) and loss, weighted to matter.
ROUTER = {"qwen3_moe": {"output_router_logits": True, "router_aux_loss_coef": 0.5}}


def tiny_config(model_type: str, **overrides):
    default = AutoConfig.for_model(model_type)
    settings = {key: value for key, value in _SMALL.items()  # derived read-only settings (properties) stay derived
                if _has_setting(default, key) and not isinstance(getattr(type(default), key, None), property)}
    for key, value in default.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key == "layerdrop"):
            settings[key] = 0.0
    layer_types = getattr(default, "layer_types", None)
    derived = "layer_types" in getattr(default, "attribute_map", {}) or isinstance(
        getattr(type(default), "layer_types", None), property)  # computed from another setting: left to it
    if isinstance(layer_types, list) and layer_types and not derived:
        kinds = list(dict.fromkeys(layer_types))  # one layer of each kind, at least two layers
        settings["layer_types"] = (kinds * 2)[: max(2, len(kinds))]
        settings["num_hidden_layers"] = len(settings["layer_types"])
    settings.update(overrides)
    return AutoConfig.for_model(model_type, **settings)


def tiny_model(model_type: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).float()


def family_model(name: str):
    """The tiny model of family `name` with the matrix's settings (`FAMILIES`; `<family>@uneven`: with `UNEVEN`'s,
    `<family>@router`: with `ROUTER`'s),
    in sdpa, or in eager where transformers allows only that (GPT-OSS, Gemma 2, ...)."""
    name, _, variant = name.partition("@")
    overrides = settings_of(name)
    if variant:
        overrides.update({"uneven": UNEVEN, "router": ROUTER}[variant][name])
    try:
        return tiny_model(name, "sdpa", **overrides)
    except ValueError as error:
        if "scaled_dot_product_attention" not in str(error):
            raise
        return tiny_model(name, "eager", **overrides)
