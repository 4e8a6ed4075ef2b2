"""Selective recompute and partial layer checkpointing, one process: exact against the plain model (fp32), the
recompute really skips what is kept (products counted in backward), the kept bytes are the planner's (bf16), and
`memory="auto"` moves from every layer checkpointed to some to none as the device grows."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import prepare_hf_model
from lightning_ulysses.memory import MemoryOptions, apply_memory_options, checkpointing
from lightning_ulysses.mixers import ssd
from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning import layer_kinds
from lightning_ulysses.planning.auto import AutoMemory, choose
from lightning_ulysses.planning.planner import GIB, MODELS, ModelShape, TrainingSetup, plan_memory
from lightning_ulysses.planning.selective import layer_costs
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.common import tiny_llama
from tests.unit.test_hybrid_shapes import _qwen3_next_like, _tiny

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "linalg_solve_triangular"}
KEEP_ALL = dict(activation_checkpointing=True, keep_attention_outputs=True, keep_matmul_outputs=True,
                keep_token_mixer_outputs=True)


class _CountProducts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _hybrid(dtype=torch.float32, seed=0, family="qwen3_next"):
    """The tiny Qwen3-Next (3 Gated DeltaNet layers, 1 gated attention) or Nemotron-H (Mamba2, MLP, attention and
    expert blocks), prepared as the strategy prepares it at SP 1 (our chunked delta rule or blockwise SSD scan, in
    its marked region), and a batch for it."""
    config = _tiny(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).train()
    slot = BatchRowsSlot()
    prepare_hf_model(model, None, SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot), batch_rows=slot)
    tokens = torch.randint(0, config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    return model, SequenceSharder(1, 0, batch_rows=slot)({"input_ids": tokens, "labels": tokens})


def _llama(seed=0):
    torch.manual_seed(seed)
    model = tiny_llama(2).train()
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(7))
    return model, {"input_ids": tokens, "labels": tokens}


def _step(model, batch, count_backward=False):
    """Loss, every gradient, and the products the backward ran (recomputes included)."""
    model.zero_grad()
    loss = model(**batch).loss
    counter = _CountProducts()
    with counter if count_backward else torch.enable_grad():
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counter.counts


def _assert_same(expected, actual):
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=1e-6)
    assert expected[1].keys() == actual[1].keys()
    for name in expected[1]:
        torch.testing.assert_close(actual[1][name], expected[1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "nemotron_h"])
def test_recompute_skips_the_kept_products(family):
    """With every product kept (and the attention), a checkpointed layer's recompute runs no product again: the
    backward runs exactly the products the plain model's backward runs. Recomputing everything runs more (each
    layer's forward products again); keeping only the linear layers' leaves the delta rule's to recompute."""
    build = _llama if family == "llama" else lambda: _hybrid(family=family)
    plain, batch = build()
    expected = _step(plain, batch, count_backward=True)
    counts = {}
    for name, options in {"all": KEEP_ALL, "none": dict(activation_checkpointing=True),
                          "linear": dict(activation_checkpointing=True, keep_matmul_outputs=True)}.items():
        model, _ = build()
        apply_memory_options(model, MemoryOptions(**options))
        actual = _step(model, batch, count_backward=True)
        _assert_same(expected, actual)
        counts[name] = sum(actual[2].values())
    assert counts["all"] == sum(expected[2].values()) > 0
    assert counts["none"] > counts["all"]
    if family != "llama":  # the delta rule's (the scan's) products still recomputed: more than with everything kept
        assert counts["none"] > counts["linear"] > counts["all"]
    else:
        assert counts["linear"] == counts["all"]


@pytest.mark.parametrize("which", [2, (0, 3), (1,)], ids=["first2", "indices", "one-deltanet"])
def test_partial_checkpointing_of_a_hybrid_with_kept_products_equals_the_plain_model(which):
    plain, batch = _hybrid()
    expected = _step(plain, batch)
    model, _ = _hybrid()
    apply_memory_options(model, MemoryOptions(**KEEP_ALL, checkpoint_layers=which))
    checkpointed = ["forward" in layer.__dict__ for layer in model.model.layers]
    assert checkpointed == [index in (range(which) if isinstance(which, int) else which) for index in range(4)]
    _assert_same(expected, _step(model, batch))


def _recorded_bytes(model, batch, monkeypatch) -> list[int]:
    """Per checkpointed layer call, the bytes its kept-outputs mode recorded in one forward."""
    modes = []
    original = checkpointing._KeptOutputs.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        modes.append(self)

    monkeypatch.setattr(checkpointing._KeptOutputs, "__init__", record)
    loss = model(**batch).loss
    sizes = [mode.kept_bytes for mode in modes]
    del loss
    return sizes


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
@pytest.mark.parametrize("keep", ["keep_matmul_outputs", "keep_token_mixer_outputs", "keep_attention_outputs"])
def test_kept_bytes_of_a_hybrid_are_the_planned_ones(keep, family, monkeypatch):
    """What the mode records per layer (bf16, 128 tokens) against `layer_kinds`' declared bytes, layer by layer:
    the linear layers' products (projections, router, routed and shared experts), the delta rule's and the SSD
    scan's fp32 products, the attention kernel's output and log-sum-exp. The scan in blocks of 64 tokens, so that
    the row holds two (each keeps the state leaving it)."""
    monkeypatch.setattr(ssd, "BLOCK_TOKENS", 64)
    monkeypatch.setattr(layer_kinds, "SSD_BLOCK_TOKENS", 64)
    model, batch = _hybrid(torch.bfloat16, family=family)
    options = MemoryOptions(activation_checkpointing=True, **{keep: True})
    apply_memory_options(model, options)
    measured = _recorded_bytes(model, batch, monkeypatch)
    shape = ModelShape.from_hf_config(_tiny(family))
    planned = [cost.product_bytes + cost.attention_bytes for cost in
               layer_costs(shape, 2, options, [0.0] * shape.num_layers)]
    assert len(measured) == shape.num_layers
    for layer, (have, want) in enumerate(zip(measured, planned)):
        assert have == pytest.approx(want * 128, rel=0.03), (layer, have, want * 128)


def test_kept_bytes_of_a_llama_layer_are_the_planned_ones(monkeypatch):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16)
    options = MemoryOptions(activation_checkpointing=True, keep_matmul_outputs=True, keep_attention_outputs=True)
    apply_memory_options(model.train(), options)
    tokens = torch.randint(0, 128, (1, 96))
    measured = _recorded_bytes(model, {"input_ids": tokens, "labels": tokens}, monkeypatch)
    shape = ModelShape.from_hf_config(config)
    cost = layer_costs(shape, 2, options, [0.0] * 2)[0]
    assert measured == [pytest.approx((cost.product_bytes + cost.attention_bytes) * 96, rel=0.03)] * 2


def test_a_product_written_into_in_the_forward_is_run_again_and_a_recompute_that_writes_is_refused():
    """DeepSpeed ZeRO-3's linear adds its bias in place into the product (through the 3-D `_unsafe_view` of it, which
    has a version counter of its own): that product is not kept, its recompute runs it again, exactly. A write that
    only the recompute makes is refused."""
    plain, batch = _llama()
    expected = _step(plain, batch, count_backward=True)
    model, _ = _llama()
    down = model.model.layers[0].mlp.down_proj
    forward = down.forward
    down.forward = lambda x: forward(x).mul_(2.0).div_(2.0)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, keep_matmul_outputs=True,
                                              keep_attention_outputs=True))
    actual = _step(model, batch, count_backward=True)
    _assert_same(expected, actual)
    assert sum(actual[2].values()) == sum(expected[2].values()) + 1  # the one product run again
    model, _ = _llama()
    down = model.model.layers[0].mlp.down_proj
    forward = down.forward
    down.forward = lambda x: forward(x).mul_(1.0) if torch.is_grad_enabled() else forward(x)
    apply_memory_options(model, MemoryOptions(activation_checkpointing=True, keep_matmul_outputs=True))
    with pytest.raises(RuntimeError, match="changed in place"):
        model(**batch).loss.backward()


@pytest.mark.parametrize("family,options", [
    ("qwen3_next", dict(activation_checkpointing=True)),
    ("qwen3_next", KEEP_ALL),
    ("llama", dict(activation_checkpointing=True, checkpoint_layers=1, keep_matmul_outputs=True)),
    ("llama", dict(tiled_mlp=True, mlp_tile_tokens=5)),
], ids=["checkpointed", "kept-products", "partial-kept-products", "tiled-mlp"])
def test_a_recompute_runs_under_the_forwards_autocast(family, options):
    """Lightning's bf16-mixed on FSDP2 runs the forward under autocast and the backward outside it: a checkpointed
    layer's or a tiled MLP's recompute runs under the forward's autocast state again (fp32 weights, CPU autocast to
    bf16), so every product of the backward runs in bf16 as the plain model's do, and a checkpointed model's
    gradients are the plain model's bit for bit (a tiled MLP sums its tiles' gradients: within bf16's rounding).
    Without it the recompute ran its products in fp32 (the delta rule's and the MLP's), and a kept product replayed
    there had the wrong dtype."""
    build = _llama if family == "llama" else _hybrid

    class ProductDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
                self.dtypes.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    def autocast_step(model, batch):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        with ProductDtypes() as backward:
            loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, \
            backward.dtypes

    plain, batch = build()
    expected = autocast_step(plain, batch)
    model, _ = build()
    apply_memory_options(model, MemoryOptions(**options))
    actual = autocast_step(model, batch)
    assert actual[2] == expected[2] and torch.bfloat16 in expected[2]
    assert torch.equal(actual[0], expected[0])
    for name, gradient in expected[1].items():
        if options.get("tiled_mlp"):
            torch.testing.assert_close(actual[1][name], gradient, rtol=2e-2, atol=1e-3, msg=name)
        else:
            assert torch.equal(actual[1][name], gradient), name


def test_a_replay_of_another_dtype_is_refused():
    """The same product on the same shapes in another dtype (a recompute under another autocast state) is not the
    forward's: refused, never replayed."""
    mode = checkpointing._KeptOutputs(None, frozenset({checkpointing.MATMULS}))
    a = torch.randn(4, 4)
    with mode:
        a.bfloat16() @ a.bfloat16()
    mode.unwatch()
    with pytest.raises(RuntimeError, match="same shapes and dtypes"), mode.replaying():
        a @ a


@pytest.mark.parametrize("options,message", [
    (dict(keep_matmul_outputs=True), "need activation_checkpointing=True"),
    (dict(activation_checkpointing=True, checkpoint_layers=0), "at least 1"),
    (dict(activation_checkpointing=True, checkpoint_layers=[1, 1]), "distinct"),
    (dict(activation_checkpointing=True, checkpoint_layers=2, checkpoint_interval=2), "Use one of them"),
])
def test_bad_selective_options_name_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        MemoryOptions(**options)


def test_checkpoint_layers_beyond_the_model_are_refused():
    model, _ = _llama()
    with pytest.raises(ValueError, match="names layer 5, but the model has 2 decoder layers"):
        apply_memory_options(model, MemoryOptions(activation_checkpointing=True, checkpoint_layers=(0, 5)))


def _choices(shape, seq, frees, **kwargs):
    gpu = RunSpec(precision="bf16-mixed", device="cuda")
    return [choose(shape, AutoMemory(seq_len=seq), gpu, (free * GIB, 120 * GIB), kernel="cudnn", **kwargs)
            for free in frees]


def _checkpointed(choice) -> int:
    m = choice.memory
    if not m.activation_checkpointing:
        return 0
    layers = choice.shape.num_layers
    return layers if m.checkpoint_layers is None else (
        m.checkpoint_layers if isinstance(m.checkpoint_layers, int) else len(m.checkpoint_layers))


@pytest.mark.parametrize("seq,frees", [(32768, (80, 139, 250, 600)), (131072, (100, 139, 250, 2000))])
def test_auto_checkpoints_fewer_layers_as_the_8b_device_grows(seq, frees):
    """Llama-3-8B on one H200 (141 GB: ~139 GiB free) and on imagined larger devices: every layer checkpointed
    where memory is tightest, then some (the first ones: the last keep their activations, freed first in backward),
    then none; each plan fits and is at least as fast as the one before it."""
    choices = _choices(MODELS["llama3-8b"], seq, frees, fused_elementwise=True)
    layers = [_checkpointed(choice) for choice in choices]
    assert layers[0] == 32 and 0 < layers[1] < 32 and layers[2] < layers[1] and layers[-1] == 0, layers
    assert all(isinstance(c.memory.checkpoint_layers, (int, type(None))) for c in choices)  # the first ones
    times = [choice.best.time.total for choice in choices]
    assert times == sorted(times, reverse=True)
    assert all(c.best.plan.gpu_total <= c.budget.device for c in choices)
    # On the H200 itself, the partial plan beats every layer checkpointed by the step-time model
    assert "with every layer checkpointed: +" in choices[1].reasons["checkpoint_layers"]


@pytest.mark.parametrize("seq,frees", [(32768, (60, 100)), (131072, (100, 139, 600))])
def test_auto_checkpoints_fewer_hybrid_layers_and_keeps_the_delta_rule_products(seq, frees):
    """The Qwen3-Next-like shape: where it must checkpoint, it keeps the delta rule's products (its recompute is the
    slow part) and leaves the layers it can afford un-checkpointed; with room for everything, none."""
    choices = _choices(ModelShape.from_hf_config(_qwen3_next_like()), seq, frees,
                       refused=frozenset({"low_memory_norms"}))
    layers = [_checkpointed(choice) for choice in choices]
    assert 0 < layers[0] < 4 and layers[-1] == 0 and layers == sorted(layers, reverse=True), layers
    assert choices[0].memory.keep_token_mixer_outputs
    if seq == 131072:  # the H200: some layers checkpointed, the delta rule's products kept, faster than all
        h200 = choices[1]
        assert 0 < layers[1] < 4 and h200.memory.keep_token_mixer_outputs
        every = plan_memory(h200.shape, TrainingSetup(seq_len=seq, memory=MemoryOptions(
            activation_checkpointing=True, keep_attention_outputs=True, tiled_logits_loss=True)))
        assert every.gpu_total <= h200.budget.device  # (what auto chose before: every layer, attention kept)
        assert "with every layer checkpointed: +" in h200.reasons["checkpoint_layers"]
