"""Per-model facts live on each prepared model, never in module globals: the all-to-all transport and the mask
configuration of one model are not seen by another model (or another Trainer) in the same process.

Single process: models prepared at SP 1 (their attention is switched and bound at every SP size), and for the
sharded mask path the stand-in bindings of test_masks.py (no collective runs here).
"""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from transformers import masking_utils as hf_masks

from lightning_ulysses.attention.core import UlyssesAttention
from lightning_ulysses.attention.documents import AttentionPattern
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import ULYSSES_ATTENTION, binding_of, prepare_hf_model
from lightning_ulysses.hf import forward as hf_forward
from lightning_ulysses.hf.forward import _register_attention
from lightning_ulysses.hf.mask_interface import BoundImplementation, _unmark
from lightning_ulysses.integration import preparation
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.families import tiny_model


def _transports_seen(monkeypatch) -> list:
    """Record the transport every "ulysses" attention call hands the core (then run the core as it is)."""
    seen = []
    core = hf_forward.ulysses_attention

    def recording(*args, transport=None, **kwargs):
        seen.append(transport)
        return core(*args, transport=transport, **kwargs)

    monkeypatch.setattr(hf_forward, "ulysses_attention", recording)
    return seen


def test_two_models_keep_their_own_transport(monkeypatch):
    seen = _transports_seen(monkeypatch)
    first, second = tiny_model("llama"), tiny_model("llama", seed=1)
    copy_transport, other_transport = object(), object()
    prepared = [prepare_hf_model(first, None, transport=copy_transport),
                prepare_hf_model(second, None, transport=other_transport)]
    tokens = torch.randint(0, 100, (1, 8))
    for model, transport in ((first, copy_transport), (second, other_transport), (first, copy_transport)):
        seen.clear()
        model(input_ids=tokens)
        assert seen and all(t is transport for t in seen), "a model exchanged over another model's transport"
    for p in prepared:
        p.restore()
    assert binding_of(first) is None and binding_of(second) is None


class _Holder(torch.nn.Module):
    def __init__(self, *modules):
        super().__init__()
        self.held = torch.nn.ModuleList(modules)


def _runtime(transport) -> preparation.SequenceParallelRuntime:
    groups = SimpleNamespace(sequence_parallel_world_size=1, ulysses_size=1, ring_size=1, ulysses_group=None,
                             ring_group=None)
    slot = BatchRowsSlot()
    return preparation.SequenceParallelRuntime(groups, SequenceSharder(1, 0, batch_rows=slot), slot,
                                               SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot),
                                               MemoryOptions.coerce(None), transport=transport)


def test_two_runs_hand_their_transport_to_their_own_modules_only():
    """Two Trainers' preparations in one process: each run's transport reaches its HF model's binding and its
    native attention layers, and restoring one run leaves the other's in place."""
    runs = []
    for transport in (object(), object()):
        model, native = tiny_model("llama"), UlyssesAttention("sdpa")
        runs.append((transport, model, native,
                     preparation.scan(_Holder(model, native), 1).prepare(_runtime(transport))))
    for transport, model, native, _ in runs:
        assert binding_of(model).transport is transport and native._transport is transport
    runs[0][3].restore()
    transport, model, native, _ = runs[1]
    assert binding_of(model).transport is transport and native._transport is transport
    assert binding_of(runs[0][1]) is None and runs[0][2]._transport is None


def _stand_in_binding(sequence_parallel_size: int):
    return SimpleNamespace(group=SimpleNamespace(world_size=sequence_parallel_size), backend="sdpa",
                           ring=SimpleNamespace(world_size=1), decode=None, sharded=sequence_parallel_size > 1)


def _windowed_config(binding) -> LlamaConfig:
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attention_chunk_size=None, sliding_window=5)
    config._attn_implementation = ULYSSES_ATTENTION
    config._attn_implementation_internal = BoundImplementation("TinyModel", binding)  # as prepare_hf_model binds it
    return config


def _sliding_mask(config):
    return hf_masks.create_sliding_window_causal_mask(
        config=config, inputs_embeds=torch.zeros(2, 8, 8), attention_mask=torch.ones(2, 8, dtype=torch.long),
        cache=None, position_ids=None)


def test_each_model_builds_masks_from_its_own_binding():
    """One model sharded over 2 ranks, one at SP 1, same family and window: the sharded one's windowed layers get
    the window carried to the whole rows; the SP 1 one's get transformers' own mask, as unprepared."""
    _register_attention()
    sharded, unsharded = _windowed_config(_stand_in_binding(2)), _windowed_config(_stand_in_binding(1))
    padding, pattern = _unmark(_sliding_mask(sharded))
    assert pattern == AttentionPattern(sliding_window=5) and padding.shape == (2, 8)
    own = _sliding_mask(unsharded)
    assert _unmark(own)[1] is None and own.dim() == 4  # the model's own sdpa mask, the window applied in it
    # A deep copy of a prepared model (an EMA copy) shares its modules' binding, and so its configs' too: the copy's
    # windowed layers still get their window (with a table keyed by the config's id the copy found none).
    assert _unmark(_sliding_mask(copy.deepcopy(sharded)))[1] == AttentionPattern(sliding_window=5)


def test_a_prepared_config_saves_prints_and_pickles_as_before():
    model = tiny_model("llama")
    prepared = prepare_hf_model(model, None)
    config = model.config
    assert config._attn_implementation == ULYSSES_ATTENTION and config._attn_implementation.binding is binding_of(model)
    assert "_attn_implementation" not in config.to_json_string() and "LlamaConfig" in repr(config)
    assert pickle.loads(pickle.dumps(config))._attn_implementation == ULYSSES_ATTENTION  # a plain name, no groups
    prepared.restore()
    assert not isinstance(config._attn_implementation, BoundImplementation)  # the private copy names no binding
    assert model.config._attn_implementation == "sdpa"
