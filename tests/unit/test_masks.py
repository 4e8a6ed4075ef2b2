"""The "ulysses" mask interface refuses every pattern but causal + padding + packed documents (one process).

Masks are built by transformers' own `create_*_mask` functions, as the models call them, for one shard of 8
tokens of a row of 16 at SP 2 (the binding is a stand-in: no collective runs here).
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers import masking_utils as hf_masks

from lightning_ulysses.attention import hf
from lightning_ulysses.attention.masks import read_mask_function, reject_unsupported_pattern

LOCAL, SP = 8, 2  # the whole row: 16 tokens


@pytest.fixture
def config():
    hf._register_attention()
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attention_chunk_size=None)
    config._attn_implementation = hf.ULYSSES_ATTENTION
    binding = SimpleNamespace(group=SimpleNamespace(world_size=SP), ring=SimpleNamespace(world_size=1), decode=None, sharded=True)
    hf._MASK_CONFIGS[id(config)] = (lambda: config, "TinyModel", binding)
    yield config
    del hf._MASK_CONFIGS[id(config)]


def mask_kwargs(config, attention_mask=False, position_ids=None):
    embeds = torch.zeros(2, LOCAL, 8)
    mask = torch.ones(2, LOCAL, dtype=torch.long) if attention_mask else None
    return dict(config=config, inputs_embeds=embeds, attention_mask=mask, cache=None, position_ids=position_ids)


# Rank 1's positions of two packed rows: one restarts inside the shard, one does not (transformers then adds its
# packed-sequence wrapping on some shards only; the decision must not depend on it).
PACKED = torch.tensor([[8, 9, 10, 0, 1, 2, 3, 4], [8, 9, 10, 11, 12, 13, 14, 15]])


@pytest.mark.parametrize("position_ids", [None, PACKED, PACKED[1:].expand(2, -1)])
@pytest.mark.parametrize("attention_mask", [False, True])
def test_plain_causal_passes_with_padding_and_packing(config, attention_mask, position_ids):
    kwargs = mask_kwargs(config, attention_mask, position_ids)
    result = hf_masks.create_causal_mask(**kwargs)
    assert (result is None) == (not attention_mask)  # the 2-D mask, handed on as it is


@pytest.mark.parametrize("window, refused", [(15, True), (16, False), (4096, False)])
@pytest.mark.parametrize("position_ids", [None, PACKED])
def test_sliding_window_is_judged_against_the_whole_row(config, window, refused, position_ids):
    config.sliding_window = window
    kwargs = mask_kwargs(config, position_ids=position_ids)
    if refused:
        with pytest.raises(NotImplementedError, match=rf"TinyModel uses a sliding window of {window} tokens, shorter"
                                                      r" than its rows of 16 tokens.*Use rows of at most"):
            hf_masks.create_sliding_window_causal_mask(**kwargs)
    else:
        hf_masks.create_sliding_window_causal_mask(**kwargs)


@pytest.mark.parametrize("chunk, refused", [(8, True), (16, False)])
def test_chunked_attention_is_judged_against_the_whole_row(config, chunk, refused):
    config.attention_chunk_size = chunk
    kwargs = mask_kwargs(config, attention_mask=True)
    if refused:
        with pytest.raises(NotImplementedError, match=rf"chunked attention with chunks of {chunk} tokens"):
            hf_masks.create_chunked_causal_mask(**kwargs)
    else:
        hf_masks.create_chunked_causal_mask(**kwargs)


@pytest.mark.parametrize("extra", [
    {"or_mask_function": lambda *args: torch.tensor(True)},  # Gemma 3's use_bidirectional_attention
    {"block_sequence_ids": torch.full((2, LOCAL), -1)},  # image tokens (here: none in this shard)
    {"and_mask_function": lambda b, h, q, kv: kv >= 0},  # a model's own restriction
])
def test_overlays_are_refused_even_where_they_change_nothing(config, extra):
    with pytest.raises(NotImplementedError, match=r"TinyModel builds its attention mask with .*use a model without"):
        hf_masks.create_causal_mask(**mask_kwargs(config), **extra)


def test_bidirectional_is_refused(config):
    config.is_causal = False
    with pytest.raises(NotImplementedError, match="bidirectional attention"):
        hf_masks.create_causal_mask(**mask_kwargs(config))


def test_masks_for_generate_of_a_hybrid_model(config):
    config.layer_types = ["full_attention", "sliding_attention"]
    config.sliding_window = 8
    with pytest.raises(NotImplementedError, match="sliding window of 8 tokens"):
        hf_masks.create_masks_for_generate(**mask_kwargs(config))
    config.sliding_window = 16
    assert set(hf_masks.create_masks_for_generate(**mask_kwargs(config))) == {"full_attention", "sliding_attention"}


def test_pieces_read_from_the_closures():
    pattern = read_mask_function(hf_masks.and_masks(hf_masks.sliding_window_causal_mask_function(5),
                                                    hf_masks.chunked_overlay(7, torch.zeros(1))))
    assert (pattern.sliding_windows, pattern.chunk_sizes, pattern.unsupported) == ((5,), (7,), None)
    assert "does not know" in read_mask_function(lambda b, h, q, kv: kv <= q).unsupported


def test_window_kwarg_follows_the_same_rule():
    """Mistral passes its window to the attention too: refused by the same rule, the same message."""
    module = SimpleNamespace()
    with pytest.raises(NotImplementedError, match="sliding window of 15 tokens, shorter than its rows of 16"):
        hf._reject_unsupported(module, None, {"sliding_window": 15}, 16)
    hf._reject_unsupported(module, None, {"sliding_window": 16}, 16)


def test_a_window_mask_no_layer_reads_changes_nothing():
    # Qwen2-MoE without use_sliding_window builds a sliding mask of window 0 that no layer uses.
    window = hf_masks.and_masks(hf_masks.causal_mask_function, hf_masks.sliding_window_overlay(0))
    reject_unsupported_pattern(window, 16, "Qwen2MoeForCausalLM", layer_types=["full_attention"] * 2)
    with pytest.raises(NotImplementedError, match="sliding window of 0 tokens"):
        reject_unsupported_pattern(window, 16, "Qwen2MoeForCausalLM", layer_types=["sliding_attention", "full_attention"])
