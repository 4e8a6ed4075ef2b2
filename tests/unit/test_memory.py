"""Memory features, one process: loss and every gradient equal the plain model's (fp32), each feature alone and
all together, for the native GPT and a Hugging Face Llama; tiles that do not divide the sequence. Low-memory norms:
bit-identical to Hugging Face's in bf16, what they keep for backward, and the norms they refuse."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from torch.utils._python_dispatch import TorchDispatchMode

from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ulysses.attention.backends import check_sdpa_kernel_priority
from lightning_ulysses.fences import _deepspeed_private as deepspeed_private
from lightning_ulysses.memory import HostActivationStore, MemoryOptions, apply_memory_options
from lightning_ulysses.memory.checkpointing import _ATTENTION_KERNELS, _with_log_sumexp
from tests.distributed.common import tiny_gpt, tiny_llama

SEQ_LEN = 13  # tiles of 4 and 3 tokens leave a short last tile
# Partial layer checkpointing and selective recompute (in both matrices below)
SELECTIVE = {
    # some layers checkpointed (the first; then the last, by index), the others keep their activations
    "partial_checkpoints": dict(activation_checkpointing=True, checkpoint_layers=1, offload_activations=True),
    "partial_checkpoints_by_index": dict(activation_checkpointing=True, checkpoint_layers=(1,),
                                         keep_attention_outputs=True),
    # selective recompute: the products (and attention) replayed, the elementwise work run again
    "kept_products": dict(activation_checkpointing=True, keep_attention_outputs=True, keep_matmul_outputs=True),
    "kept_products_offloaded_tiled": dict(tiled_mlp=True, mlp_tile_tokens=5, activation_checkpointing=True,
                                          offload_activations=True, keep_matmul_outputs=True,
                                          low_memory_norms=True),
    "kept_products_sparse": dict(activation_checkpointing=True, checkpoint_interval=2, keep_matmul_outputs=True),
}
FEATURES = {
    "tiled_mlp": dict(tiled_mlp=True, mlp_tile_tokens=4),
    "tiled_logits_loss": dict(tiled_logits_loss=True, logits_tile_tokens=3),
    "checkpointing": dict(activation_checkpointing=True),
    "checkpointing_offload": dict(activation_checkpointing=True, offload_activations=True),
    "low_memory_norms": dict(low_memory_norms=True),
    "all": dict(tiled_mlp=True, mlp_tile_tokens=5, tiled_logits_loss=True, logits_tile_tokens=3,
                activation_checkpointing=True, offload_activations=True, low_memory_norms=True),
    "sparse_checkpoints_kept_attention": dict(activation_checkpointing=True, checkpoint_interval=2,
                                              keep_attention_outputs=True),
    "all_sparse": dict(tiled_mlp=True, mlp_tile_tokens=5, tiled_logits_loss=True, logits_tile_tokens=3,
                       activation_checkpointing=True, offload_activations=True, checkpoint_interval=2,
                       keep_attention_outputs=True),
    **SELECTIVE,
}


def _batch(batch_size=2):
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 64, (batch_size, SEQ_LEN), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100  # masked prefix: the token count is not the length
    labels[1, 8] = -100
    return input_ids, labels


def _loss_and_grads(model, input_ids, labels, **kwargs):
    model.zero_grad()
    loss = model(input_ids=input_ids, labels=labels, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(expected, actual):
    (loss, grads), (loss_actual, grads_actual) = expected, actual
    torch.testing.assert_close(loss_actual, loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_actual.keys()
    for name in grads:
        torch.testing.assert_close(grads_actual[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_equals_plain_path(kind, feature):
    plain = tiny_gpt(2) if kind == "gpt" else tiny_llama(2)
    plain.train()
    input_ids, labels = _batch()
    expected = _loss_and_grads(plain, input_ids, labels)
    model = copy.deepcopy(plain)
    store = HostActivationStore()
    restores = apply_memory_options(model, MemoryOptions(**FEATURES[feature]), store)
    # The native GPT's LayerNorms are left alone (low_memory_norms alone changes nothing there); a Llama's
    # 2 × 2 layer norms and its final norm are replaced.
    assert bool(restores) == (kind == "llama" or feature != "low_memory_norms")
    replaced_norms = [m for m in model.modules() if "forward" in m.__dict__ and "Norm" in type(m).__name__]
    assert len(replaced_norms) == (5 if kind == "llama" and FEATURES[feature].get("low_memory_norms") else 0)
    actual = _loss_and_grads(model, input_ids, labels)
    _assert_same(expected, actual)
    if (FEATURES[feature].get("offload_activations") and "checkpoint_interval" not in FEATURES[feature]
            and not FEATURES[feature].get("keep_matmul_outputs")):
        # The checkpointed layers' inputs (batch 2 × 13 tokens × width 32, fp32; both layers, or the one of
        # checkpoint_layers=1) went to the host store and came back; a second step reuses the same buffers.
        checkpointed = FEATURES[feature].get("checkpoint_layers", 2)
        assert store.host_bytes == checkpointed * (2 * SEQ_LEN * 32 * 4)
        _assert_same(expected, _loss_and_grads(model, input_ids, labels))
        assert store.host_bytes == checkpointed * (2 * SEQ_LEN * 32 * 4)
    outputs = model(input_ids=input_ids, labels=labels)
    assert (outputs.logits is None) == bool(FEATURES[feature].get("tiled_logits_loss"))
    # Evaluation returns logits as usual; undoing gives the plain model back.
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, plain.eval()(input_ids=input_ids).logits)
    for restore in reversed(restores):
        restore()
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    model.train(), plain.train()
    _assert_same(expected, _loss_and_grads(model, input_ids, labels))
    assert model(input_ids=input_ids, labels=labels).logits is not None


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tiled_logits_loss_composes_with_sequence_parallel_loss(kind):
    """With the strategy's loss (labels it did not shift read as Hugging Face reads them, ZeRO gradient scale)
    the fused path reduces the same way: value equal, gradient scaled the same."""
    plain = tiny_gpt(2) if kind == "gpt" else tiny_llama(2)
    plain.train()
    input_ids, labels = _batch()
    sp_loss = SequenceParallelCausalLMLoss(group=None, gradient_scale=2.0)
    plain.loss_function = sp_loss
    expected = _loss_and_grads(plain, input_ids, labels)
    model = copy.deepcopy(plain)
    model.loss_function = sp_loss
    apply_memory_options(model, MemoryOptions(tiled_logits_loss=True, logits_tile_tokens=4))
    _assert_same(expected, _loss_and_grads(model, input_ids, labels))


def test_hugging_face_num_items_in_batch():
    plain = tiny_llama(2).train()
    input_ids, labels = _batch()
    expected = _loss_and_grads(plain, input_ids, labels, num_items_in_batch=torch.tensor(40))
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(tiled_logits_loss=True, logits_tile_tokens=4))
    _assert_same(expected, _loss_and_grads(model, input_ids, labels, num_items_in_batch=torch.tensor(40)))


class _CountAttentionKernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in _ATTENTION_KERNELS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind,interval,offload", [("llama", 2, True), ("llama", 3, False), ("gpt", 3, True),
                                                   ("llama", 1, True)])
def test_sparse_checkpoints_and_kept_attention(kind, interval, offload):
    """5 layers in stretches of `interval` (the last one shorter): loss and gradients equal the plain path; every
    layer runs twice, plus once more for each layer whose successor in its stretch lost its input; the attention
    kernel runs once per layer (forward only); the host keeps ceil(5 / interval) inputs and every layer's attention
    output and log-sum-exp."""
    layers = 5
    plain = (tiny_gpt(2, num_layers=layers) if kind == "gpt" else tiny_llama(2, num_layers=layers)).train()
    input_ids, labels = _batch()
    expected = _loss_and_grads(plain, input_ids, labels)
    model = copy.deepcopy(plain)
    store = HostActivationStore()
    options = MemoryOptions(activation_checkpointing=True, offload_activations=offload, checkpoint_interval=interval,
                            keep_attention_outputs=True)
    restores = apply_memory_options(model, options, store)
    mlp_calls = [0] * layers
    blocks = model.blocks if kind == "gpt" else model.model.layers
    for index, block in enumerate(blocks):
        block.mlp.register_forward_hook(lambda *_, index=index: mlp_calls.__setitem__(index, mlp_calls[index] + 1))
    with _CountAttentionKernels() as kernels:
        actual = _loss_and_grads(model, input_ids, labels)
    _assert_same(expected, actual)
    last_in_stretch = [index % interval == interval - 1 or index == layers - 1 for index in range(layers)]
    assert mlp_calls == [2 + (not last) for last in last_in_stretch]
    assert kernels.count == layers
    if offload:
        config = plain.config
        heads = config.num_heads if kind == "gpt" else config.num_attention_heads
        hidden = input_ids.numel() * config.hidden_size * 4
        log_sum_exp = input_ids.numel() * heads * 4
        assert store.host_bytes == -(-layers // interval) * hidden + layers * (hidden + log_sum_exp)
    else:
        assert store.host_bytes == 0
    for restore in reversed(restores):
        restore()


def test_recorded_attention_kernels_compute_the_log_sum_exp():
    """The checkpointed forward runs without gradients, where F.scaled_dot_product_attention asks the cuDNN and
    memory-efficient kernels for no log-sum-exp; the recording must ask for it (the recompute's backward reads it)."""
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.zeros(1)
    assert _with_log_sumexp(cudnn, (q, q, q, None, False, 0.0, True), {}) == ((q, q, q, None, True, 0.0, True), {})
    assert _with_log_sumexp(efficient, (q, q, q, None), {"compute_log_sumexp": False}) == \
        ((q, q, q, None), {"compute_log_sumexp": True})
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # always returns it
    assert _with_log_sumexp(cpu, (q, q, q, 0.0, True), {}) == ((q, q, q, 0.0, True), {})


def test_kept_attention_needs_one_kernel_choice_in_forward_and_backward():
    """A recompute that picks another SDPA kernel than its forward cannot replay it: a clear error either way round;
    one choice over both (what the strategy's `sdpa_kernel_priority` ensures) is exact."""
    plain = tiny_llama(2).train()
    input_ids, labels = _batch()
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, keep_attention_outputs=True))
    math_only = functools.partial(sdpa_kernel, [SDPBackend.MATH])  # on CPU torch ignores a priority order
    with math_only():
        loss = model(input_ids=input_ids, labels=labels).loss
    with pytest.raises(RuntimeError, match="must pick the same SDPA kernels"):
        loss.backward()
    loss = model(input_ids=input_ids, labels=labels).loss
    with math_only(), pytest.raises(RuntimeError, match="must pick the same SDPA kernels"):
        loss.backward()
    with math_only():
        _assert_same(_loss_and_grads(plain, input_ids, labels), _loss_and_grads(model, input_ids, labels))
    with pytest.raises(ValueError, match="distinct SDPA kernels from"):
        check_sdpa_kernel_priority(["cudnn", "fast"])


def test_sdpa_kernel_priority_keeps_kernels_switched_off_process_wide_off():
    from lightning_ulysses.attention.backends import sdpa_priority

    before = torch._C._get_sdp_priority_order()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        with sdpa_priority(("math",)):
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
        with sdpa_priority(("flash", "math")):  # named: the user asked for it
            assert torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    # The whole order comes back: torch's own exit would leave the switched-off flash last, behind math.
    assert torch._C._get_sdp_priority_order() == before


def test_sparse_checkpoints_replay_dropout():
    """Recomputing a layer's input from an earlier one draws the same dropout masks as the forward did."""
    plain = tiny_llama(2, num_layers=3)
    for layer in plain.model.layers:
        layer.self_attn.attention_dropout = 0.3
    plain.train()
    input_ids, labels = _batch()
    torch.manual_seed(11)
    expected = _loss_and_grads(plain, input_ids, labels)
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, checkpoint_interval=3))
    torch.manual_seed(11)
    _assert_same(expected, _loss_and_grads(model, input_ids, labels))
    torch.manual_seed(12)
    assert not torch.equal(_loss_and_grads(model, input_ids, labels)[0], expected[0])  # dropout is really on


def _tiny_gpt2(dropout: float):
    """A Hugging Face GPT-2 (dropout in its embeddings, attention, attention output and MLP; `use_cache=True` by
    default, its blocks get the cache by position; Conv1D layers that flatten with `view`)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def _tile_by_autograd(mlps, tile_tokens):
    """The reference for a tiled MLP with dropout: the same tiles, in the same order, kept by plain autograd, so
    they draw the same dropout masks (one tile's mask is not the matching slice of the untiled MLP's mask)."""
    for mlp in mlps:
        mlp.forward = functools.partial(
            lambda forward, x: torch.cat([forward(tile.contiguous()) for tile in x.split(tile_tokens, dim=-2)], -2),
            mlp.forward)


def _seeded(seed, run, *args):
    torch.manual_seed(seed)
    return run(*args)


DROPOUT_FEATURES = {
    "tiled_mlp": dict(tiled_mlp=True, mlp_tile_tokens=4),
    "checkpointing": dict(activation_checkpointing=True),
    "tiled_mlp_sparse_kept_offloaded": dict(tiled_mlp=True, mlp_tile_tokens=4, tiled_logits_loss=True,
                                            logits_tile_tokens=3, activation_checkpointing=True,
                                            offload_activations=True, checkpoint_interval=2,
                                            keep_attention_outputs=True),
    **SELECTIVE,  # the same selective-recompute options as the exactness matrix's
}


@pytest.mark.parametrize("feature", list(DROPOUT_FEATURES))
def test_gpt2_dropout_gradients_equal_the_plain_model(feature):
    """GPT-2 with dropout 0.1 everywhere, batch of 2 (tiles are strided views): every recompute (a tile's, a
    checkpointed layer's, a stretch's) draws the masks its forward drew, so loss and gradients equal the plain
    model's under the same seed (with the MLP tiled the same way by plain autograd where it is tiled). A checkpointed
    layer's forward runs without gradients: its MLP is tiled there too, or its recompute would draw other masks."""
    options = MemoryOptions(**DROPOUT_FEATURES[feature])
    plain = _tiny_gpt2(dropout=0.1)
    model = copy.deepcopy(plain)
    if options.tiled_mlp:
        _tile_by_autograd([block.mlp for block in plain.transformer.h], options.mlp_tile_tokens)
    input_ids, labels = _batch()
    expected = _seeded(11, _loss_and_grads, plain, input_ids, labels)
    apply_memory_options(model, options)
    _assert_same(expected, _seeded(11, _loss_and_grads, model, input_ids, labels))
    assert not torch.equal(_seeded(12, _loss_and_grads, model, input_ids, labels)[0], expected[0])  # dropout is on


def test_gpt2_cache_passed_by_position_is_dropped_under_checkpointing():
    """GPT2Model calls `block(hidden_states, cache, causal_mask, ...)` with a DynamicCache (`use_cache=True` is
    GPT-2's default): the recompute must not append its keys and values to the cache the forward filled, where
    attention would read the forward's detached copies and the K/V projection (c_attn) lose its gradients."""
    plain = _tiny_gpt2(dropout=0.0)
    assert plain.config.use_cache
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True))
    input_ids, labels = _batch()
    expected, actual = _loss_and_grads(plain, input_ids, labels), _loss_and_grads(model, input_ids, labels)
    for name in [n for n in expected[1] if "c_attn" in n]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)
    _assert_same(expected, actual)


def test_lora_dropout_gradients_equal_the_plain_model():
    """PEFT LoRA (`lora_dropout=0.1`) on a Llama's attention and MLP projections: tiled MLP and checkpointed layers
    (sparse, offloaded) give the adapters' gradients of the plain adapted model under the same seed."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    plain = get_peft_model(tiny_llama(2), config).train()
    model = copy.deepcopy(plain)
    options = MemoryOptions(tiled_mlp=True, mlp_tile_tokens=4, activation_checkpointing=True,
                            offload_activations=True, checkpoint_interval=2)
    _tile_by_autograd([layer.mlp for layer in plain.base_model.model.model.layers], options.mlp_tile_tokens)
    input_ids, labels = _batch()
    expected = _seeded(11, _loss_and_grads, plain, input_ids, labels)
    assert expected[1] and all("lora_" in name for name in expected[1])
    apply_memory_options(model, options)
    _assert_same(expected, _seeded(11, _loss_and_grads, model, input_ids, labels))


def _count_calls(modules):
    calls = [0]

    def count(*_):
        calls[0] += 1

    for module in modules:
        module.register_forward_hook(count)
    return calls


@pytest.mark.parametrize("family,output_unread,deferred", [("llama", True, True), ("gemma3_text", False, False),
                                                          ("gpt2-dropout", True, False)])
def test_checkpointed_recompute_leaves_out_the_tiled_mlp_forward(family, output_unread, deferred):
    """A checkpointed layer's recompute only carries gradients back: its tiled MLP's forward is left out (the MLP's
    backward recomputes its tiles anyway), from the second step on, once the first recompute's graph showed nothing
    keeps the MLP's output values. Gemma 3 normalises the MLP's output before the residual (the norm keeps it), and a
    GPT-2 MLP with dropout draws random numbers: their MLPs run in every recompute. Gradients are exact throughout."""
    from tests.distributed.families import family_model

    plain = _tiny_gpt2(dropout=0.1) if family == "gpt2-dropout" else (
        tiny_llama(2) if family == "llama" else family_model(family))
    plain.train()
    model = copy.deepcopy(plain)
    options = MemoryOptions(tiled_mlp=True, mlp_tile_tokens=4, activation_checkpointing=True)
    if family == "gpt2-dropout":
        _tile_by_autograd([block.mlp for block in plain.transformer.h], options.mlp_tile_tokens)
    apply_memory_options(model, options)
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    calls = _count_calls([next(iter(mlp.children())) for mlp in mlps])
    input_ids, labels = _batch()
    tiles = 4 * len(mlps)  # 13 tokens in tiles of 4: 4 tiles per MLP
    for step in range(3):
        calls[0] = 0
        expected = _seeded(step, _loss_and_grads, plain, input_ids, labels)
        _assert_same(expected, _seeded(step, _loss_and_grads, model, input_ids, labels))
        # forward, (recompute,) the MLP's own backward
        assert calls[0] == (2 if deferred and step > 0 else 3) * tiles, step
    assert [m.forward.deferrable for m in mlps] == [output_unread] * len(mlps)


@pytest.mark.parametrize("tile_tokens", [4, SEQ_LEN, 64], ids=["tiles", "one-full-tile", "one-short-tile"])
def test_a_tiled_mlp_keeps_only_its_input_for_backward_however_many_tiles(tile_tokens):
    """Without checkpointing, a tiled MLP keeps its input and nothing else, also where the rows fit in one tile
    (before: the plain MLP ran there and kept its intermediates for every layer, which the planner does not count:
    8B at 4K without checkpointing needed ≥ 140.1 GiB against 135.4 predicted). Same output and gradients."""
    plain = tiny_llama(2).train()
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(tiled_mlp=True, mlp_tile_tokens=tile_tokens))
    hidden = torch.randn(2, SEQ_LEN, 32, requires_grad=True)
    mlp, plain_mlp = model.model.layers[0].mlp, plain.model.layers[0].mlp
    assert len(_saved_for_backward(plain_mlp, hidden)) > 1  # gate, up, their activation...
    assert _saved_for_backward(mlp, hidden) == [((2, SEQ_LEN, 32), torch.float32)]
    grad = torch.randn(2, SEQ_LEN, 32)
    expected = torch.autograd.grad(plain_mlp(hidden), [hidden, *plain_mlp.parameters()], grad)
    got = torch.autograd.grad(mlp(hidden), [hidden, *mlp.parameters()], grad)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_one_tile_mlp_runs_twice_per_step_under_checkpointing(family):
    """Rows no longer than a tile: after the first step (which checks the graph) the MLP runs twice per step either
    way — left out of the recompute and recomputed in its own backward (Llama), or run in the recompute with plain
    autograd as without tiling (Gemma 3, whose output a norm keeps), never three times."""
    from tests.distributed.families import family_model

    plain = (tiny_llama(2) if family == "llama" else family_model(family)).train()
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(tiled_mlp=True, mlp_tile_tokens=16, activation_checkpointing=True))
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    calls = _count_calls([next(iter(mlp.children())) for mlp in mlps])
    input_ids, labels = _batch()
    for step in range(3):
        calls[0] = 0
        _assert_same(_loss_and_grads(plain, input_ids, labels), _loss_and_grads(model, input_ids, labels))
        assert calls[0] == (3 if step == 0 else 2) * len(mlps), step


def test_a_graph_that_starts_keeping_the_deferred_mlp_output_is_refused():
    """A tiled MLP left out of the recompute because nothing kept its output: a hook added later multiplies that
    output by a trainable tensor (whose gradient needs it). The step stops with the reason instead of giving
    wrong gradients."""
    model = tiny_llama(2).train()
    apply_memory_options(model, MemoryOptions(tiled_mlp=True, mlp_tile_tokens=4, activation_checkpointing=True))
    input_ids, labels = _batch()
    for _ in range(2):
        _loss_and_grads(model, input_ids, labels)
    scale = torch.ones(32, requires_grad=True)
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * scale)
    with pytest.raises(RuntimeError, match="the layer's graph changed between steps"):
        _loss_and_grads(model, input_ids, labels)


@pytest.mark.parametrize("trainable", ["q_proj", "nothing", "everything"])
def test_leaf_layers_give_frozen_hidden_states_a_gradient_only_where_a_layer_trains(trainable):
    """ZeRO-3 leaf layers (`mark_leaf_layers`): DeepSpeed releases a leaf's parameters when its inputs' gradient is
    computed, so a layer with trainable parameters must get hidden states that need one, also behind a frozen
    embedding (LoRA). The parameters' gradients are those of the unmarked model; nothing changes where the hidden
    states need a gradient already or the layer trains nothing; a layer over the size bound is not marked."""
    from lightning_ulysses.memory import LEAF_LAYER_MAX_PARAMETERS, mark_leaf_layers

    plain = tiny_llama(2).train()
    for name, parameter in plain.named_parameters():
        parameter.requires_grad_(trainable == "everything" or trainable in name)
    model = copy.deepcopy(plain)
    undo = mark_leaf_layers(model, MemoryOptions())
    assert all(deepspeed_private.is_z3_leaf(layer) for layer in model.model.layers)
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].requires_grad))
    input_ids, labels = _batch()
    expected = _loss_and_grads(plain, input_ids, labels) if trainable != "nothing" else None
    if trainable == "nothing":
        with torch.no_grad():
            model(input_ids=input_ids, labels=labels)
        model(input_ids=input_ids, labels=labels)
        assert seen == [False] * 4
    else:
        _assert_same(expected, _loss_and_grads(model, input_ids, labels))
        assert seen == [True, True]
    for remove in undo:
        remove()
    assert mark_leaf_layers(tiny_llama(2), MemoryOptions(activation_checkpointing=True, checkpoint_interval=2)) == []
    big = tiny_llama(2)
    big.model.layers[0].register_parameter("extra", torch.nn.Parameter(torch.empty(0)))
    big.model.layers[0].extra.ds_numel = LEAF_LAYER_MAX_PARAMETERS
    mark_leaf_layers(big, MemoryOptions())
    assert [deepspeed_private.is_z3_leaf(layer) for layer in big.model.layers] == [False, True]


def test_checkpoint_interval_refuses_layers_marked_leaves():
    model = tiny_llama(2)
    for layer in model.model.layers:
        deepspeed_private.mark_z3_leaf(layer)  # as the user's deepspeed.utils.set_z3_leaf_modules would
    with pytest.raises(ValueError, match="zero3_leaf_layers=False"):
        apply_memory_options(model, MemoryOptions(activation_checkpointing=True, checkpoint_interval=2))


def test_kept_attention_replays_the_kernels_random_draws(monkeypatch):
    """A fused attention kernel with dropout (CUDA's flash, memory-efficient and cuDNN kernels) draws from the
    generator; its replay draws nothing, so the dropout after it would draw other masks in the recompute than in
    the forward unless the replay leaves the generator where the kernel left it. On CPU no fused kernel takes
    dropout: a kernel that draws and returns a tuple (`native_dropout`: output and mask) stands in for one."""
    from lightning_ulysses.memory import checkpointing

    stand_in = torch.ops.aten.native_dropout.default
    monkeypatch.setattr(checkpointing, "_ATTENTION_KERNELS", checkpointing._ATTENTION_KERNELS | {stand_in})

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.output = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, hidden):
            attended = stand_in(self.attention(hidden), 0.3, True)[0]
            return hidden + self.output(torch.nn.functional.dropout(attended, 0.3))

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Layer() for _ in range(3)])
    inputs = torch.randn(2, 5, 8, requires_grad=True)

    def gradients(stack):
        hidden = inputs
        for layer in stack:
            hidden = layer(hidden)
        inputs.grad = None
        stack.zero_grad()
        hidden.square().sum().backward()
        return [inputs.grad, *(p.grad for p in stack.parameters())]

    expected = _seeded(5, gradients, layers)
    checkpointed = copy.deepcopy(layers)
    checkpointing.checkpoint_layers(list(checkpointed), None, interval=2, keep_attention_outputs=True)
    with _CountAttentionKernels() as kernels:
        actual = _seeded(5, gradients, checkpointed)
    assert kernels.count == 0  # counted by the real kernel set: the stand-in was replayed, not run again
    for got, wanted in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)


SPARSE_KEPT_OFFLOADED = MemoryOptions(activation_checkpointing=True, offload_activations=True, checkpoint_interval=2,
                                      keep_attention_outputs=True)


def test_checkpointed_layers_with_frozen_inputs_still_get_gradients():
    """Frozen embeddings (fine-tuning, adapters): no layer input requires grad, yet the layers' parameters do."""
    plain = tiny_llama(2, num_layers=4).train()
    plain.model.embed_tokens.weight.requires_grad_(False)
    input_ids, labels = _batch()
    expected = _loss_and_grads(plain, input_ids, labels)
    model = copy.deepcopy(plain)
    apply_memory_options(model, SPARSE_KEPT_OFFLOADED)
    _assert_same(expected, _loss_and_grads(model, input_ids, labels))


def test_sparse_checkpoints_follow_the_hidden_states_not_the_layer_order():
    """A stretch is only recomputed through layers that really fed each other: hidden states changed between two
    layers (here scaled out of place, then in place) start a new stretch, so gradients stay exact, and so does a
    detached output (nothing before it runs backward). An alias of a layer's output (what DeepSpeed ZeRO-3's module
    hooks hand on) continues the stretch."""
    from lightning_ulysses.memory.checkpointing import checkpoint_layers

    torch.manual_seed(3)
    layers = [torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, 8)) for _ in range(5)]
    inputs = torch.randn(3, 8, requires_grad=True)

    def gradients(stack, change):
        hidden = inputs
        for index, layer in enumerate(stack):
            hidden = layer(hidden)
            if change == "transform" and index == 0:
                hidden = hidden * 3
            if change == "transform" and index == 2:
                hidden.mul_(2)
            if change == "detach" and index == 1:
                hidden = hidden.detach()
        inputs.grad = None
        for parameter in (p for layer in stack for p in layer.parameters()):
            parameter.grad = None
        hidden.square().sum().backward()
        return [inputs.grad, *(p.grad for layer in stack for p in layer.parameters())]

    # stretches [0] [1, 2] [3, 4] with the transforms, [0, 1, 2] [3, 4] else, [0, 1] [2, 3, 4] after a detach: a
    # layer whose successor in its stretch kept no input runs once more; none before the detach runs backward
    for change, expected_calls in (("transform", [2, 3, 2, 3, 2]), (None, [3, 3, 2, 3, 2]), ("detach", [1, 1, 3, 3, 2])):
        expected = gradients(layers, change)
        checkpointed = copy.deepcopy(layers)
        checkpoint_layers(checkpointed, None, interval=3)
        calls = [0] * len(layers)
        for index, layer in enumerate(checkpointed):
            layer[1].register_forward_hook(lambda *_, index=index, calls=calls: calls.__setitem__(index, calls[index] + 1))
            layer.register_forward_hook(lambda module, args, output: output.view_as(output))
        for actual, wanted in zip(gradients(checkpointed, change), expected, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)
        assert calls == expected_calls, change


def test_dropped_forward_gives_its_host_buffers_back_and_second_backward_is_refused():
    """A forward whose graph is dropped without backward (a skipped step) returns its host buffers to the store
    at once (on a GPU they are pinned: kept, they would be lost for good); a second backward through the same
    checkpointed layers is refused with a clear error rather than an AttributeError."""
    model = tiny_llama(2, num_layers=4).train()
    input_ids, labels = _batch()
    store = HostActivationStore()
    apply_memory_options(model, SPARSE_KEPT_OFFLOADED, store)
    _loss_and_grads(model, input_ids, labels)
    step_bytes = store.host_bytes
    dropped = model(input_ids=input_ids, labels=labels).loss
    del dropped  # its graph goes without backward
    assert store.host_bytes == step_bytes
    _loss_and_grads(model, input_ids, labels)
    assert store.host_bytes == step_bytes  # the next step reused the buffers, none were added
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran backward twice"):
        loss.backward()


def test_host_store_keeps_the_buffers_of_the_lengths_in_use_only():
    """Batches of varying length: each length's buffers replace the idle ones of the others (a store keeping every
    length's buffers grows, pinned, until the host runs out); non-dense tensors are found again under their layout."""
    model = tiny_llama(2, num_layers=4).train()
    store = HostActivationStore()
    apply_memory_options(model, SPARSE_KEPT_OFFLOADED, store)
    input_ids, labels = _batch()
    _loss_and_grads(model, input_ids, labels)
    full_length_bytes = store.host_bytes
    _loss_and_grads(model, input_ids[:, :7], labels[:, :7])
    assert 0 < store.host_bytes < full_length_bytes  # only the 7-token buffers
    _loss_and_grads(model, input_ids, labels)
    assert store.host_bytes == full_length_bytes
    strided = torch.randn(4, 6)[:, ::2]
    for _ in range(2):
        stashed = store.stash(strided)
        torch.testing.assert_close(store.peek(stashed), strided, rtol=0, atol=0)
        store.give_back(stashed)
    assert store.host_bytes == strided.numel() * 4


def test_host_store_unpins_every_buffer_it_drops(monkeypatch):
    """The GPU path's bookkeeping, with `cudaHostRegister` recorded instead of called: buffers of a length no longer
    in use are unpinned when dropped, and `release` unpins the rest (also those still stashed)."""
    import torch.cuda._pin_memory_utils as pinning

    registered = set()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(pinning, "pin_memory", lambda pointer, size: registered.add(pointer))
    monkeypatch.setattr(pinning, "unpin_memory", registered.remove)  # KeyError if unpinned twice or never pinned
    store = HostActivationStore()
    long_rows = [store.stash(torch.randn(2, 16, 8)) for _ in range(3)]
    for stashed in long_rows:
        store.give_back(stashed)
    short_rows = [store.stash(torch.randn(2, 12, 8)) for _ in range(2)]
    assert registered == {stashed[0].data_ptr() for stashed in short_rows}  # the idle long-row buffers are gone
    store.give_back(short_rows[0])
    store.release()
    assert registered == set() and store.host_bytes == 0


HIDDEN = 32  # tiny_llama's hidden size: how the store tells a layer input from an attention output


class _LoggingStore(HostActivationStore):
    """A host store that logs which layer's tensor each copy back starts (`fetch`) and is waited for (`wait`)."""

    def __init__(self, log):
        super().__init__()
        self.log, self.layer, self.owners = log, None, {}

    def stash(self, tensor):
        stashed = super().stash(tensor)
        kind = "input" if tensor.dim() == 3 and tensor.shape[-1] == HIDDEN else "attention"
        self.owners[stashed.buffer.data_ptr()] = (self.layer, kind)
        return stashed

    def fetch(self, stashed):
        owner = self.owners[stashed.buffer.data_ptr()]
        self.log.append(("fetch", *owner))
        fetch = super().fetch(stashed)
        wait = fetch.wait
        fetch.wait = lambda: (self.log.append(("wait", *owner)), wait())[1]
        return fetch


@pytest.mark.parametrize("interval", [1, 2])
def test_offloaded_tensors_come_back_while_the_layer_after_them_runs_backward(interval):
    """Each layer's backward starts the copy back of the next layer's kept input before it recomputes itself (on a GPU
    the copy then runs beside that recompute and backward), and each recompute starts its attention outputs' copy
    before the layer runs; every copy started is waited for exactly once (none wasted, none made twice)."""
    layers, log = 4, []
    model = tiny_llama(2, num_layers=layers).train()
    store = _LoggingStore(log)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, offload_activations=True,
                                              checkpoint_interval=interval, keep_attention_outputs=True), store)
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, index=index: setattr(store, "layer", index))
        layer.mlp.register_forward_hook(lambda *_, index=index: log.append(("mlp", index)))
    input_ids, labels = _batch()
    loss = model(input_ids=input_ids, labels=labels).loss
    del log[:]
    loss.backward()
    fetches = [entry[1:] for entry in log if entry[0] == "fetch"]
    assert sorted(fetches) == sorted(entry[1:] for entry in log if entry[0] == "wait")
    kept_inputs = range(0, layers, interval)
    # with stretches, a kept input comes back twice: for its stretch's recompute, then for its own layer's backward
    assert sorted(layer for layer, kind in fetches if kind == "input") == sorted([*kept_inputs] * min(interval, 2))
    # The backward recompute of a layer is its last MLP call. A stretch's kept input is fetched before the first layer
    # of the next stretch recomputes for its backward, and waited for after it (the last stretch's: at once).
    last_mlp = {index: max(i for i, entry in enumerate(log) if entry == ("mlp", index)) for index in range(layers)}
    for layer in kept_inputs[:-1]:
        assert (log.index(("fetch", layer, "input")) < last_mlp[layer + interval]
                < log.index(("wait", layer, "input")))
    for layer in range(layers):  # every attention output is fetched before its layer's recompute runs it
        assert log.index(("fetch", layer, "attention")) < last_mlp[layer]


def test_offloaded_input_changed_in_place_is_refused():
    """The copy of a layer's input to the host runs beside the layer's forward on a GPU: a layer that changes its
    input in place would leave a torn copy for backward's recompute, so it is refused at the end of its forward."""
    model = tiny_llama(2, num_layers=2).train()
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, offload_activations=True),
                         HostActivationStore())
    model.model.layers[1].input_layernorm.register_forward_pre_hook(lambda module, args: args[0].mul_(1.0))
    input_ids, labels = _batch()
    with pytest.raises(RuntimeError, match="LlamaDecoderLayer changed its input .hidden states. in place"):
        model(input_ids=input_ids, labels=labels)


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="needs activation_checkpointing=True"):
        MemoryOptions(offload_activations=True)
    with pytest.raises(ValueError, match="need activation_checkpointing=True"):
        MemoryOptions(checkpoint_interval=2)
    with pytest.raises(ValueError, match="need activation_checkpointing=True"):
        MemoryOptions(keep_attention_outputs=True)
    with pytest.raises(ValueError, match="checkpoint_interval must be a positive integer"):
        MemoryOptions(activation_checkpointing=True, checkpoint_interval=0)
    with pytest.raises(ValueError, match="Unknown memory option"):
        MemoryOptions.coerce({"tiled_mpl": True})
    with pytest.raises(ValueError, match="positive integer"):
        MemoryOptions(tiled_mlp=True, mlp_tile_tokens=0)
    model = tiny_gpt(2)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="recomputed twice"):
        apply_memory_options(model, MemoryOptions(tiled_mlp=True, activation_checkpointing=True))
    assert "forward" not in model.blocks[0].mlp.__dict__  # refused before anything changed


def _saved_for_backward(run, *args):
    """(shape, dtype) of every tensor autograd saves while `run(*args)` runs."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run(*args)
    return saved


def _bytes_alive_after(run, *args):
    """Bytes that `run(*args)` allocated and had not freed when it returned (its output included): what the
    forward leaves for backward, however it is kept (saved tensors, attributes of the autograd context)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        output = run(*args)  # alive until the profiler has stopped
    del output
    return sum(event.self_cpu_memory_usage for event in profiler.events())


def test_low_memory_norms_bit_identical_in_bf16_and_keep_only_the_input():
    """A bf16 Llama: loss and every gradient bit-identical to Hugging Face's norms; one norm keeps its bf16 input,
    an fp32 rstd per token and its weight, and no fp32 `[batch, seq, hidden]` copy (Hugging Face's does)."""
    plain = tiny_llama(2).to(torch.bfloat16).train()
    input_ids, labels = _batch()
    expected_loss, expected_grads = _loss_and_grads(plain, input_ids, labels)
    model = copy.deepcopy(plain)
    apply_memory_options(model, MemoryOptions(low_memory_norms=True))
    loss, grads = _loss_and_grads(model, input_ids, labels)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys()
    assert all(torch.equal(grads[name], expected_grads[name]) for name in grads)

    hidden = torch.randn(2, SEQ_LEN, 32, dtype=torch.bfloat16, requires_grad=True)
    norm, replaced = plain.model.layers[0].input_layernorm, model.model.layers[0].input_layernorm
    assert torch.equal(replaced(hidden), norm(hidden))
    full_fp32 = ((2, SEQ_LEN, 32), torch.float32)
    assert full_fp32 in _saved_for_backward(norm, hidden)  # the copy this option removes
    assert _saved_for_backward(replaced, hidden) == [((2, SEQ_LEN, 32), torch.bfloat16), ((2, SEQ_LEN, 1), torch.float32),
                                                     ((32,), torch.bfloat16)]
    tokens, values = 2 * SEQ_LEN, 2 * SEQ_LEN * 32
    assert _bytes_alive_after(replaced, hidden) == 2 * values + 4 * tokens  # bf16 output + fp32 rstd per token
    # Hugging Face's: also the fp32 copy of its input and the bf16 normalised values.
    assert _bytes_alive_after(norm, hidden) == (2 + 4 + 2) * values + 4 * tokens
    # The native GPT's LayerNorm (left alone) keeps no fp32 copy of its input either.
    layer_norm = tiny_gpt(2).to(torch.bfloat16).blocks[0].attention_norm
    assert all(dtype == torch.bfloat16 for _, dtype in _saved_for_backward(layer_norm, hidden))


def test_low_memory_norms_read_no_weight_values():
    """Under ZeRO-3 a norm's weight is an empty partition when the options are applied: the check must not read it."""
    from lightning_ulysses.memory.norms import llama_style_norms

    model = tiny_llama(2)
    for norm in [model.model.norm, *(m for layer in model.model.layers
                                     for m in (layer.input_layernorm, layer.post_attention_layernorm))]:
        norm.weight.ds_shape = norm.weight.shape  # what DeepSpeed leaves on a partitioned parameter
        norm.weight.data = torch.empty(0)
    assert len(llama_style_norms(model)) == 5


class _GemmaStyleRMSNorm(torch.nn.Module):
    """Llama's attributes and signature, Gemma's arithmetic: `x * (1 + weight)`, rounded after the multiply."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        upcast = hidden_states.float()
        normalized = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normalized * (1.0 + self.weight.float())).type_as(hidden_states)


def test_low_memory_norms_refuse_other_norms():
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match=r"GemmaRMSNorm\) is not one: .*Switch low_memory_norms off"):
        apply_memory_options(gemma, MemoryOptions(low_memory_norms=True, tiled_mlp=True))
    assert not [m for m in gemma.modules() if "forward" in m.__dict__]  # refused before anything changed

    # The same attributes as Llama's norm: the probe (random weights, fp32 and bf16) tells them apart.
    model = tiny_llama(2)
    model.model.layers[1].post_attention_layernorm = _GemmaStyleRMSNorm(32)
    with pytest.raises(ValueError, match=r"layers\.1\.post_attention_layernorm \(_GemmaStyleRMSNorm\) is not one: its"
                                         r" forward computes something else"):
        apply_memory_options(model, MemoryOptions(low_memory_norms=True))
    assert not [m for m in model.modules() if "forward" in m.__dict__]
