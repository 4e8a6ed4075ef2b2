"""The "ulysses" mask interface: causal + padding + packed documents, sliding windows and chunks pass (windows and
chunks carried to the attention, which applies them on whole rows); every other pattern is refused (one process).

Masks are built by transformers' own `create_*_mask` functions, as the models call them, for one shard of 8
tokens of a row of 16 at SP 2 (the binding is a stand-in: no collective runs here).
"""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers import masking_utils as hf_masks

from lightning_ulysses.attention.documents import AttentionPattern, DocumentMask, allowed_mask
from lightning_ulysses.attention.masks import read_mask_function, reject_unsupported_pattern
from lightning_ulysses.hf.forward import (_reject_unsharded_inputs, _unsupported, register_model_attention,
                                          unregister_model_attention)
from lightning_ulysses.hf.mask_interface import _unmark

LOCAL, SP = 8, 2  # the whole row: 16 tokens


@pytest.fixture
def config():
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attention_chunk_size=None)
    binding = SimpleNamespace(group=SimpleNamespace(world_size=SP), ring=SimpleNamespace(world_size=1), decode=None, sharded=True)
    name = register_model_attention("TinyModel", binding)  # as prepare_hf_model names a prepared model's configs
    config._attn_implementation = name
    yield config
    unregister_model_attention(name)


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


@pytest.mark.parametrize("position_ids", [None, PACKED])
@pytest.mark.parametrize("attention_mask", [False, True])
def test_windowed_and_chunked_layers_get_their_pattern(config, attention_mask, position_ids):
    config.sliding_window, config.attention_chunk_size = 5, 4
    kwargs = mask_kwargs(config, attention_mask, position_ids)
    for build, expected in ((hf_masks.create_sliding_window_causal_mask, AttentionPattern(sliding_window=5)),
                            (hf_masks.create_chunked_causal_mask, AttentionPattern(chunk_size=4))):
        padding, pattern = _unmark(build(**kwargs))
        assert pattern == expected
        assert (padding is None) == (not attention_mask)  # the shard's 2-D mask rides along
    # a layer that got the marker through a copy sees an empty 1-D mask, which the attention refuses
    marker = hf_masks.create_sliding_window_causal_mask(**kwargs)
    with pytest.raises(ValueError, match="1-D attention mask"):
        _reject_unsharded_inputs(SimpleNamespace(), _unmark(marker.clone())[0], {})


ROW = 16


def transformers_mask(mask_function, attention_mask=None, position_ids=None):
    """transformers' own boolean sdpa mask of the whole row, [batch, 1, ROW, ROW]."""
    config = LlamaConfig(hidden_size=8, num_attention_heads=2)
    config._attn_implementation = "sdpa"
    return hf_masks.sdpa_mask(batch_size=2, q_length=ROW, kv_length=ROW, q_offset=0, kv_offset=0,
                              mask_function=mask_function, attention_mask=attention_mask,
                              allow_is_causal_skip=False, config=config)


@pytest.mark.parametrize("rows", ["plain", "left_padded", "packed"])
@pytest.mark.parametrize("pattern", [AttentionPattern(sliding_window=5), AttentionPattern(chunk_size=6),
                                     AttentionPattern(sliding_window=3, chunk_size=8)])
def test_patterns_on_whole_rows_are_transformers_masks(rows, pattern):
    """The pattern the Ulysses core applies after the exchange is the mask transformers builds for the unsharded
    row: windows counted back from each query, chunks from the first real token (left padding) or from each
    packed document's start."""
    padding = position_ids = None
    if rows == "left_padded":
        padding = torch.ones(2, ROW, dtype=torch.long)
        padding[0, :3] = 0
    if rows == "packed":
        position_ids = torch.stack([torch.cat([torch.arange(7), torch.arange(ROW - 7)]), torch.arange(ROW)])
    function = hf_masks.causal_mask_function
    if pattern.sliding_window is not None:
        function = hf_masks.and_masks(function, hf_masks.sliding_window_overlay(pattern.sliding_window))
    if pattern.chunk_size is not None:
        left = torch.zeros(2, dtype=torch.long) if padding is None else (padding == 0).long().cumprod(1).sum(1)
        function = hf_masks.and_masks(function, hf_masks.chunked_overlay(pattern.chunk_size, left))
    if position_ids is not None:
        function = hf_masks.remap_positions_for_packed_sequence(function, position_ids)
        documents = hf_masks.find_packed_sequence_indices(position_ids)
        function = hf_masks.and_masks(function, hf_masks.packed_sequence_mask_function(documents))
    expected = transformers_mask(function, padding)
    ours = allowed_mask(2, ROW, DocumentMask.from_rows(2, position_ids, padding), True, pattern, "cpu")
    assert torch.equal(ours, expected.expand_as(ours))


@pytest.mark.parametrize("extra", [
    {"or_mask_function": lambda *args: torch.tensor(True)},  # Gemma 3's use_bidirectional_attention
    {"block_sequence_ids": torch.full((2, LOCAL), -1)},  # image tokens (here: none in this shard)
    {"and_mask_function": lambda b, h, q, kv: kv >= 0},  # a model's own restriction
])
def test_overlays_are_refused_even_where_they_change_nothing(config, extra):
    with pytest.raises(NotImplementedError, match=r"TinyModel builds its attention mask with .*use a model without it"):
        hf_masks.create_causal_mask(**mask_kwargs(config), **extra)


def test_bidirectional_is_refused(config):
    config.is_causal = False
    with pytest.raises(NotImplementedError, match="bidirectional attention"):
        hf_masks.create_causal_mask(**mask_kwargs(config))


def test_masks_for_generate_of_a_hybrid_model(config):
    config.layer_types = ["full_attention", "sliding_attention"]
    config.sliding_window = 8
    masks = hf_masks.create_masks_for_generate(**mask_kwargs(config))
    assert _unmark(masks["sliding_attention"])[1] == AttentionPattern(sliding_window=8)
    assert masks["full_attention"] is None


def test_pieces_read_from_the_closures():
    pattern = read_mask_function(hf_masks.and_masks(hf_masks.sliding_window_causal_mask_function(5),
                                                    hf_masks.chunked_overlay(7, torch.zeros(1))))
    assert (pattern.sliding_windows, pattern.chunk_sizes, pattern.unsupported) == ((5,), (7,), None)
    assert "does not know" in read_mask_function(lambda b, h, q, kv: kv <= q).unsupported


def test_at_sp_1_a_window_shorter_than_the_row_runs_the_models_own_attention():
    """SP 1: what the core does not apply to unsharded rows is left to the model's own attention function."""
    module = SimpleNamespace()
    assert _unsupported(module, None, {"sliding_window": 15}, 16)
    assert not _unsupported(module, None, {"sliding_window": 16}, 16)
    assert _unsupported(module, None, {"softcap": 30.0}, 16)


def test_at_sp_1_a_flex_block_mask_runs_the_models_own_attention():
    """SP 1, flex_attention: a windowed layer gets transformers' own BlockMask, which the model's flex attention
    reads (no dense mask); under SP it is refused like any mask that is not 2-D."""
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv < 5), None, None, 16, 16, device="cpu")
    assert _unsupported(SimpleNamespace(), block_mask, {"sliding_window": 5}, 16)
    with pytest.raises(ValueError, match="got a BlockMask attention mask"):
        _reject_unsharded_inputs(SimpleNamespace(), block_mask, {})


def test_a_window_mask_no_layer_reads_changes_nothing():
    # Qwen2-MoE without use_sliding_window builds a sliding mask of window 0 that no layer uses.
    window = hf_masks.and_masks(hf_masks.causal_mask_function, hf_masks.sliding_window_overlay(0))
    reject_unsupported_pattern(window, 16, "Qwen2MoeForCausalLM", layer_types=["full_attention"] * 2)
    with pytest.raises(NotImplementedError, match="sliding window of 0 tokens"):
        reject_unsupported_pattern(window, 16, "Qwen2MoeForCausalLM", layer_types=["sliding_attention", "full_attention"])
