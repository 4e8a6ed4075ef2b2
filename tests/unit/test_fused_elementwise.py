"""`fused_elementwise`: the compiled RMSNorm, low-memory RMSNorm and gated activation equal eager (inductor: fp32
within 1e-6 relative, bf16 within bf16 rounding; forward and backward); a tiny Llama with it (alone and with every
other memory feature, under layer checkpointing's dispatch mode and host offload) equals the plain model; tiles and
lengths reuse the compiled code; the models it cannot fuse are refused before anything changes.

The model-level tests compile with `aot_eager` (dynamo capture and AOT autograd, the same graphs inductor gets,
without C++ builds); one test runs the real CPU inductor kernels.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
from torch import nn

from lightning_ulysses.memory import MemoryOptions, apply_memory_options
from lightning_ulysses.memory.fused import call_compiled, gated_activation, rms_norm
from lightning_ulysses.memory.norms import _backward_body, _forward_body, low_memory_rms_norm
from tests.distributed.common import tiny_gpt, tiny_llama
from tests.distributed.families import FAMILIES, family_model
from tests.unit.test_memory import SEQ_LEN, _assert_same, _batch, _loss_and_grads, _saved_for_backward

CHEAP = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo(request):
    if "warm_dynamo" in request.fixturenames:  # the family matrix shares one cache (`warm_dynamo`)
        yield
        return
    torch._dynamo.reset()  # every test compiles afresh, within dynamo's per-function cache limit
    yield
    torch._dynamo.reset()


# `aot_eager` (CHEAP), counting the calls of the graphs it compiled: "the compiled code ran" also where dynamo's cache
# already held the graph (no new graph to count).
COUNTED = "counted_aot_eager"
_compiled_calls = [0]  # calls of the graphs COUNTED compiled, so far


def _counted_aot_eager(graph_module, example_inputs):
    compiled = torch._dynamo.lookup_backend(CHEAP)(graph_module, example_inputs)

    def run(*args):
        _compiled_calls[0] += 1
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # aot_autograd's calling convention (a list of args)
    return run


torch._dynamo.register_backend(_counted_aot_eager, name=COUNTED)


@pytest.fixture(scope="module")
def warm_dynamo():
    """One dynamo cache for the whole family matrix, as in one process of a real run: the families share the fused
    functions (the same norm and gate at the same sizes), so each compiles only what its dtypes, epsilons and
    activations add, instead of everything again (~2 s a family). Where dynamo would give up compiling (its
    recompile limit) it raises instead of running the eager path."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=64):
        yield
    torch._dynamo.reset()


def _unique_graphs() -> int:
    """Graphs dynamo compiled in this process so far (`reset` does not clear the count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _replaced(model) -> list[str]:
    return sorted(name for name, m in model.named_modules() if "forward" in m.__dict__)


EPS = 1e-6
# name: (eager, fused with a backend, the arguments' shapes: hidden 16, intermediate 24)
FUNCTIONS = {
    "rms_norm": (lambda h, w: rms_norm(h, w, EPS),
                 lambda backend, h, w: call_compiled(rms_norm, backend, h, w, EPS), ((2, 5, 16), (16,))),
    "low_memory_rms_norm": (lambda h, w: low_memory_rms_norm(h, w, EPS),
                            lambda backend, h, w: low_memory_rms_norm(h, w, EPS, backend), ((2, 5, 16), (16,))),
    "silu_gate": (lambda g, u: gated_activation("silu", g, u),
                  lambda backend, g, u: call_compiled(gated_activation, backend, "silu", g, u), ((2, 5, 24),) * 2),
}
TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def test_inductor_kernels_equal_eager_forward_and_backward():
    """The CPU inductor kernels of the fused functions against their eager op sequences, fp32 and bf16."""
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in TOLERANCES.items():
        for name, (eager, fused, shapes) in FUNCTIONS.items():
            inputs = [(3 * torch.randn(shape, generator=generator)).to(dtype) for shape in shapes]
            expected_inputs = [t.clone().requires_grad_() for t in inputs]
            fused_inputs = [t.clone().requires_grad_() for t in inputs]
            expected, actual = eager(*expected_inputs), fused("inductor", *fused_inputs)
            torch.testing.assert_close(actual, expected, **tolerance, msg=f"{name} {dtype} forward")
            grad = torch.randn(expected.shape, generator=generator).to(dtype)
            expected.backward(grad)
            actual.backward(grad)
            for index, (a, b) in enumerate(zip(fused_inputs, expected_inputs)):
                torch.testing.assert_close(a.grad, b.grad, **tolerance, msg=f"{name} {dtype} gradient {index}")
    # What inductor's partitioner keeps for backward (bf16, the graphs compiled above): the norm its 16-bit input, its
    # weight and an fp32 rstd per token, as low_memory_norms does (eager: also fp32 copies); the gate `gate` and `up`
    # (eager: also act(gate)).
    hidden, weight, gate = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for shape in
                            ((2, 5, 16), (16,), (2, 5, 24)))
    assert sorted(_saved(FUNCTIONS["rms_norm"][1], hidden, weight)) == sorted(
        [((2, 5, 16), torch.bfloat16), ((16,), torch.bfloat16), ((2, 5, 1), torch.float32)])
    assert _saved(FUNCTIONS["silu_gate"][1], gate, gate.detach().clone().requires_grad_()) == [
        ((2, 5, 24), torch.bfloat16)] * 2


def _saved(fused, *inputs) -> list[tuple]:
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fused("inductor", *inputs)
    return saved


# Every other memory feature too: the fused norms and gates run under layer checkpointing (forward without
# gradients, recompute under the kept-attention dispatch mode), host offload and uneven MLP tiles (5 + 5 + 3 tokens).
WITH_EVERYTHING = dict(tiled_mlp=True, mlp_tile_tokens=5, tiled_logits_loss=True, logits_tile_tokens=3,
                       activation_checkpointing=True, offload_activations=True, checkpoint_interval=2,
                       keep_attention_outputs=True)
CASES = {"alone": {}, "with_low_memory_norms": dict(low_memory_norms=True), "with_everything": WITH_EVERYTHING,
         "with_everything_and_low_memory_norms": dict(WITH_EVERYTHING, low_memory_norms=True)}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_llama_equals_plain_model(case):
    plain = tiny_llama(2).train()
    input_ids, labels = _batch()
    expected = _loss_and_grads(plain, input_ids, labels)
    model, graphs = copy.deepcopy(plain), _unique_graphs()
    apply_memory_options(model, MemoryOptions(fused_elementwise=True, fused_backend=CHEAP, **CASES[case]))
    layers = [f"model.layers.{i}" for i in range(2)]
    norms = [f"{layer}.{norm}" for layer in layers for norm in ("input_layernorm", "post_attention_layernorm")]
    assert {*norms, "model.norm", *(f"{layer}.mlp" for layer in layers)} <= set(_replaced(model))
    _assert_same(expected, _loss_and_grads(model, input_ids, labels))
    assert _unique_graphs() > graphs  # the compiled functions ran (not the eager path)


def test_fused_low_memory_norm_keeps_only_its_16_bit_input():
    model = tiny_llama(2).to(torch.bfloat16)
    apply_memory_options(model, MemoryOptions(fused_elementwise=True, fused_backend=CHEAP, low_memory_norms=True))
    hidden = torch.randn(2, SEQ_LEN, 32, dtype=torch.bfloat16, requires_grad=True)
    assert _saved_for_backward(model.model.layers[0].input_layernorm, hidden) == [
        ((2, SEQ_LEN, 32), torch.bfloat16), ((2, SEQ_LEN, 1), torch.float32), ((32,), torch.bfloat16)]


def test_tiles_and_lengths_reuse_the_compiled_code():
    """Other sequence lengths (and so other last-tile lengths) and batch sizes compile nothing new once warm."""
    model = tiny_llama(2).train()
    apply_memory_options(model, MemoryOptions(fused_elementwise=True, fused_backend=CHEAP, tiled_mlp=True,
                                              mlp_tile_tokens=4, activation_checkpointing=True))

    def step(batch_size, length):
        input_ids = torch.randint(0, 64, (batch_size, length))
        model(input_ids=input_ids, labels=input_ids).loss.backward()

    for batch_size, length in ((2, 13), (1, 1), (1, 5)):  # warm-up: dynamic dims, then size 1 specialised once
        step(batch_size, length)
    warm = _unique_graphs()
    for batch_size, length in ((2, 11), (3, 7), (2, 17), (1, 9), (2, 6)):  # last tiles of 3, 3, 1, 1, 2 tokens
        step(batch_size, length)
    assert _unique_graphs() == warm


class _FusedGateUp(nn.Module):
    """Phi-3's MLP shape: one `gate_up_proj`, which the fused gate does not recognise."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_up_proj = nn.Linear(32, 96, bias=False)
        self.down_proj, self.act_fn = mlp.down_proj, mlp.act_fn

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class _ScaledGate(nn.Module):
    """LlamaMLP's attributes, other arithmetic: the probe tells them apart."""

    def __init__(self, mlp):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


def test_fuses_what_it_recognises_and_refuses_a_model_with_nothing():
    model = tiny_llama(2)
    model.model.layers[0].mlp = _FusedGateUp(model.model.layers[0].mlp)
    model.model.layers[1].mlp = _ScaledGate(model.model.layers[1].mlp)
    apply_memory_options(model, MemoryOptions(fused_elementwise=True, fused_backend=CHEAP))
    assert not [name for name in _replaced(model) if name.endswith("mlp")]  # neither MLP: only the norms
    assert len(_replaced(model)) == 5

    gpt = tiny_gpt(2)  # LayerNorms and an ungated MLP: nothing to fuse
    with pytest.raises(ValueError, match=r"GPT has neither\. Switch it off .*fused_elementwise=false"):
        apply_memory_options(gpt, MemoryOptions(fused_elementwise=True, fused_backend=CHEAP, tiled_mlp=True))
    assert not _replaced(gpt)


def test_refuses_other_norms_and_unknown_backends_before_changing_anything():
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match=r"GemmaRMSNorm\) is not one: .*Switch fused_elementwise off.*"
                                         r"strategy\.memory\.fused_elementwise=false"):
        apply_memory_options(gemma, MemoryOptions(fused_elementwise=True, fused_backend=CHEAP, tiled_mlp=True))
    with pytest.raises(ValueError, match=r"Switch low_memory_norms and fused_elementwise off"):
        apply_memory_options(gemma, MemoryOptions(fused_elementwise=True, low_memory_norms=True))
    assert not _replaced(gemma)
    model = tiny_llama(2)
    with pytest.raises(ValueError, match=r"fused_backend='no-such-backend' is not a torch\.compile backend"):
        apply_memory_options(model, MemoryOptions(fused_elementwise=True, fused_backend="no-such-backend"))
    assert not _replaced(model)


def test_compiles_under_the_kept_attention_dispatch_mode():
    """Dynamo runs a compiled function eagerly under a dispatch mode that does not ignore compile internals, and
    skips its code for good after such a first call: layer checkpointing's `_KeptOutputs` must ignore them."""
    from lightning_ulysses.memory.checkpointing import ATTENTION, MATMULS, _KeptOutputs

    gate, up, graphs = torch.randn(2, 3, 8), torch.randn(2, 3, 8), _unique_graphs()
    with _KeptOutputs(None, frozenset({ATTENTION, MATMULS})):
        fused = call_compiled(gated_activation, CHEAP, "silu", gate, up)
    assert _unique_graphs() == graphs + 1
    assert torch.equal(fused, gated_activation("silu", gate, up))


def test_benchmark_syntax_auto_keeps_what_is_set_and_the_step_time_factor():
    """`fused` in the features syntax; memory="auto" keeps it as set (whatever the layout allows); the step-time
    model's factor (calibrated: 0.75) is the only term it changes."""
    import dataclasses

    from lightning_ulysses.planning.auto import AutoMemory, choose
    from lightning_ulysses.parallel.run_spec import RunSpec
    from lightning_ulysses.planning.plan import memory_options
    from lightning_ulysses.planning.planner import GIB, MODELS, TrainingSetup
    from lightning_ulysses.planning.step_time import H200, predict_step_time

    assert memory_options("ac,norms,fused") == MemoryOptions(activation_checkpointing=True, low_memory_norms=True,
                                                             fused_elementwise=True)
    shape = MODELS["llama3.2-1b"]
    for fused, allowed in itertools.product((False, True), (False, True)):
        request = AutoMemory(seq_len=32768, device_margin=0, host_margin=0, fused_elementwise=fused)
        run = RunSpec(precision="bf16-mixed", device="cuda")
        assert choose(shape, request, run, (100 * GIB, 100 * GIB), kernel="cudnn",
                      fused_elementwise=allowed).memory.fused_elementwise is fused

    setup = TrainingSetup(seq_len=32768, memory=memory_options("ac,attn,norms,fused"))
    plain = predict_step_time(shape, dataclasses.replace(setup, memory=memory_options("ac,attn,norms"))).terms
    unity = predict_step_time(shape, setup, speeds=dataclasses.replace(H200, fused_elementwise_factor=1.0)).terms
    assert unity == plain
    fused = predict_step_time(shape, setup).terms
    assert fused["elementwise kernels"] == pytest.approx(0.75 * plain["elementwise kernels"])
    changed = {name for name in plain if fused[name] != plain[name]}
    assert changed == {"elementwise kernels", "recompute: layer forwards"}  # a recompute runs the fused kernels too


def test_auto_may_switch_it_on_only_where_it_applies():
    """`fused_elementwise_applies`: what memory="auto" asks before it switches the option on (it must never pick
    an option the model then refuses); it changes nothing."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from lightning_ulysses.memory import fused_elementwise_applies

    llama = tiny_llama(2)
    assert fused_elementwise_applies(llama) and not _replaced(llama)
    assert not fused_elementwise_applies(tiny_gpt(2))  # LayerNorms and an ungated MLP
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    assert not fused_elementwise_applies(gemma)  # (1 + weight) RMSNorms, refused by the option


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_is_fused_exactly_or_refused(family, warm_dynamo):
    """memory="auto" switches `fused_elementwise` on (on CUDA) for every model `fused_elementwise_applies` accepts:
    over the whole family matrix, a model it accepts trains exactly like the plain one (fp32 loss and gradients,
    compiled code ran), and one it does not accept is refused by the option itself — never neither."""
    from lightning_ulysses.memory import fused_elementwise_applies

    settings = FAMILIES[family]
    plain = family_model(family)
    plain = (plain.double() if settings.get("float64") else plain).train(not settings.get("eval"))
    model = copy.deepcopy(plain)
    options = MemoryOptions(fused_elementwise=True, fused_backend=COUNTED)
    if not fused_elementwise_applies(plain):
        with pytest.raises(ValueError):
            apply_memory_options(model, options)
        return
    torch.manual_seed(1)
    input_ids = torch.randint(0, plain.config.vocab_size, (2, 12))
    expected = _loss_and_grads(plain, input_ids, input_ids, use_cache=False)
    calls = _compiled_calls[0]
    apply_memory_options(model, options)
    _assert_same(expected, _loss_and_grads(model, input_ids, input_ids, use_cache=False))
    assert _replaced(model) and _compiled_calls[0] > calls  # the compiled functions ran
